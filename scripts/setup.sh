#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian machine (run as root): system packages, kernel headers
# for BCC (never linked under /lib/modules), and a virtualenv at .venv that sees Debian's bcc module.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
/usr/bin/python3 -c 'import bcc' 2>/dev/null || need_apt+=(python3-bpfcc bpfcc-tools)
/usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
command -v strace >/dev/null || need_apt+=(strace)
command -v runc >/dev/null || need_apt+=(runc)
command -v chromium >/dev/null || need_apt+=(chromium)  # renders show --format html in a test
[ -x /bin/busybox ] || need_apt+=(busybox-static)
command -v ip >/dev/null || need_apt+=(iproute2)
/usr/bin/python3 -c 'import seccomp' 2>/dev/null || need_apt+=(python3-seccomp)  # the exec supervisor's filter
# full detail's hot path is a C extension (src/fast/), built by the install below
command -v cc >/dev/null || need_apt+=(gcc)
/usr/bin/python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_path("include") + "/Python.h"))' \
  || need_apt+=(python3-dev)
[ -e /usr/include/openssl/evp.h ] || need_apt+=(libssl-dev)
[ -e /usr/include/zstd.h ] || need_apt+=(libzstd-dev)  # the premade files' writer thread (src/fast/zfile.h)
need_headers=
ls -d /usr/src/linux-headers-*-common >/dev/null 2>&1 || [ -e "/lib/modules/$(uname -r)/build" ] || need_headers=1
if [ ${#need_apt[@]} -gt 0 ] || [ -n "$need_headers" ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  if [ -n "$need_headers" ]; then
    # the running kernel's own headers when the distro has them; else the distro's generic ones
    # (the probes take no struct layout from headers: see docs/architecture.md)
    for pkg in "linux-headers-$(uname -r)" linux-headers-cloud-amd64 linux-headers-amd64; do
      if apt-cache show "$pkg" >/dev/null 2>&1; then need_apt+=("$pkg"); break; fi
    done
  fi
  echo "setup: installing ${need_apt[*]}" >&2
  apt-get install -y -q --no-install-recommends "${need_apt[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import bcc' 2>/dev/null; then
  rm -rf .venv
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
stamp=.venv/.installed-$(cat pyproject.toml setup.py src/fast/*.c src/fast/*.h | sha256sum | cut -c1-16)  # rebuilt when either changes
if [ ! -f "$stamp" ]; then
  .venv/bin/pip install -q --disable-pip-version-check -e '.[agent,dev]'
  rm -f .venv/.installed-* && touch "$stamp"
fi
# Bytecode for every module, as a wheel install has it: with PYTHONDONTWRITEBYTECODE set (as some CI
# shells do) each `evidence` start would otherwise compile its modules from source (~0.5 s)
.venv/bin/python -m compileall -q -j 0 evidence agent bundle policy probes >/dev/null
# Headers for BCC: `evidence doctor` explains; when the exact ones are missing, the recorder joins the
# distro headers under /var/lib/evidence and points BCC_KERNEL_SOURCE there (never /lib/modules).
echo "setup: ok (.venv/bin/evidence)" >&2
