#!/bin/sh
# Run one CI step under the evidence agent (sidecar) and keep its bundle:
#   evidence-wrap.sh make test
# EVIDENCE_AGENT_SOCKET  the sidecar's socket (default /run/evidence/agent.sock)
# EVIDENCE_BUNDLE        where the bundle goes (default ./evidence-<job>-<step>.tar.gz)
# JOB_ID, STEP_NAME      recorded as labels
# The step's exit code is passed through; a recording failure fails the step only when
# EVIDENCE_REQUIRED=1 (otherwise it is reported on stderr and the step runs unrecorded).
set -u
sock=${EVIDENCE_AGENT_SOCKET:-/run/evidence/agent.sock}
job=${JOB_ID:-local}
step=${STEP_NAME:-step}
bundle=${EVIDENCE_BUNDLE:-./evidence-$job-$step.tar.gz}

i=0
until evidence start --help >/dev/null 2>&1 && [ -S "$sock" ]; do
  i=$((i + 1))
  if [ "$i" -ge 60 ]; then break; fi
  sleep 1
done

# The whole job container is recorded: its cgroup, found from this shell's pid (the pod shares one
# process namespace, so the sidecar sees it).
if session=$(evidence start --agent "$sock" --pid $$ --label "job=$job" --label "step=$step"); then
  :
else
  echo "evidence-wrap: recording could not start" >&2
  if [ "${EVIDENCE_REQUIRED:-0}" = 1 ]; then exit 70; fi
  session=
fi

status=0
"$@" || status=$?

if [ -n "$session" ]; then
  if ! evidence finish --agent "$sock" "$session" --bundle "$bundle" --force; then
    echo "evidence-wrap: the bundle could not be written" >&2
    if [ "${EVIDENCE_REQUIRED:-0}" = 1 ] && [ "$status" -eq 0 ]; then status=70; fi
  fi
fi
exit "$status"
