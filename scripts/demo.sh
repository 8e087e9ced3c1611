#!/usr/bin/env bash
# `make demo`: record a small real "build" (a shell that runs python, reads files, writes an output,
# connects to a loopback listener and fails to open a missing file), signed with a fresh key, then
# show, lint and verify the bundle.
set -euo pipefail
cd "$(dirname "$0")/.."
out=demo-out
rm -rf "$out" && mkdir -p "$out/workspace"
cat > "$out/workspace/build.sh" <<'SH'
#!/bin/sh
set -e
echo "building..."
/usr/bin/python3 - <<'PY'
import socket, os
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
c = socket.create_connection(srv.getsockname()); c.close(); srv.close()
try:
    open("/etc/nonexistent.conf")
except FileNotFoundError:
    pass
PY
cat /etc/os-release > build-info.txt
ls -la > /dev/null
echo "done"
SH
chmod +x "$out/workspace/build.sh"
.venv/bin/evidence keygen --out "$out/evidence-key" >/dev/null
cd "$out/workspace"
../../.venv/bin/evidence run --sign-key ../evidence-key --bundle ../run.tar.gz -- ./build.sh
cd ../..
echo
.venv/bin/evidence show "$out/run.tar.gz" || true
echo
.venv/bin/evidence lint "$out/run.tar.gz" --fail-on none || true
echo
.venv/bin/evidence verify "$out/run.tar.gz" --key "$out/evidence-key.pub" || true
