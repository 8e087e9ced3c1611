# evidence agent: the recording daemon for Kubernetes nodes and CI sidecars.
#   docker build -t evidence:0.1.0 .
# BCC comes from Debian's python3-bpfcc (PyPI's "bcc" is an unrelated package). It compiles the probes
# at start-up against the host kernel's headers, so the host's /lib/modules and /usr/src are mounted
# read-only at run time (deploy/kubernetes/base/daemonset.yaml); none are baked into the image.
FROM debian:bookworm-slim

ARG DEBIAN_FRONTEND=noninteractive

# Debian's own versions, not pinned: the image is rebuilt for security updates and pinned by digest
# where it is deployed (deploy/kubernetes/overlays/production).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        ca-certificates \
        python3 \
        python3-bpfcc \
        python3-venv \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/evidence/src
COPY pyproject.toml ./
COPY evidence/ evidence/
COPY agent/ agent/
COPY bundle/ bundle/
COPY policy/ policy/
COPY probes/ probes/
COPY setup.py ./
COPY src/ src/

# A venv that also sees Debian's bcc module (--system-site-packages); the project's own dependencies
# come pinned by pyproject's lower bounds from PyPI. Full detail's hot path (src/fast/) is compiled
# here, its compiler and headers removed in the same layer (OpenSSL's library stays: Python's own).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libssl-dev python3-dev \
    && python3 -m venv --system-site-packages /opt/evidence/venv \
    && /opt/evidence/venv/bin/pip install --no-cache-dir --disable-pip-version-check "/opt/evidence/src[agent]" \
    && /opt/evidence/venv/bin/python -c "import bcc, evidence.agent.daemon.service, evidence.bundle.reader, evidence.bundle._fast" \
    && apt-get purge -y --auto-remove gcc libc6-dev libssl-dev python3-dev \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/lib/evidence/bundles /run/evidence

ENV PATH=/opt/evidence/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

WORKDIR /
# Runs as uid 0 on purpose: BPF and tracefs need it. The DaemonSet drops every capability except the
# few it names, each with its reason.
ENTRYPOINT ["evidence", "agent"]
CMD ["--config", "/etc/evidence/agent.yaml"]
