"""Regenerate tests/data/raw_records.json: real ring-buffer records captured from the probes
(run as root: `.venv/bin/python tests/data/capture_raw.py`). The unit tests decode the saved bytes and
compare with the decoded JSON saved beside them, which a person checked once by eye."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from evidence.agent.recorder.cgroups import RunCgroup
from evidence.agent.recorder.decode import decode
from evidence.agent.recorder.kernel import mount_tracefs
from evidence.probes.headers import ensure_headers
from evidence.probes.loader import RecorderProbes

SCRIPT = r"""
import os, socket
os.chdir('/etc')
open('hostname').close()
try:
    open('/nonexistent/file')
except OSError:
    pass
d = os.open('/etc', os.O_RDONLY | os.O_DIRECTORY)
os.close(os.open('passwd', os.O_RDONLY, dir_fd=d))
os.dup2(d, 50)
os.fchdir(50)
s = socket.socket(); s.settimeout(1)
try:
    s.connect(('127.0.0.1', 9))
except OSError:
    pass
s6 = socket.socket(socket.AF_INET6)
try:
    s6.connect(('::ffff:127.0.0.1', 9))
except OSError:
    pass
u = socket.socket(socket.AF_UNIX)
try:
    u.connect('/nonexistent.sock')
except OSError:
    pass
# file changes that are not opens (one record each, paired in the kernel)
a, b, c = '/tmp/evidence-capture-a', '/tmp/evidence-capture-b', '/tmp/evidence-capture-c'
for p in (a, b, c, b + '.d'):
    for rm in (os.unlink, os.rmdir):
        try:
            rm(p)
        except OSError:
            pass
os.close(os.open(a, os.O_WRONLY | os.O_CREAT, 0o644))
os.link(a, b)
os.rename(b, c)
os.truncate(a, 0)
os.chmod(a, 0o600)
os.chown(a, -1, os.getgid())
fd = os.open(a, os.O_RDONLY)
os.fchmod(fd, 0o640)
os.symlink('evidence-capture-a', b)
os.unlink(b)
os.mkdir(b + '.d', 0o700)
os.rmdir(b + '.d')
os.unlink(c)
os.unlink(a)
# a DNS query and its answer on a socket connected to port 53 (the "server" is this script)
srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); srv.bind(('127.3.5.3', 53))
cli = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); cli.connect(('127.3.5.3', 53))
cli.send(b'\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03org\x00\x00\x01\x00\x01')
q, peer = srv.recvfrom(512)
srv.sendto(q[:2] + b'\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00' + q[12:] + b'\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x3c\x00\x04\xc0\x00\x02\x07', peer)
cli.recv(512)
# the same query sent to port 53 from a socket that is not connected, and an answer to it from a
# port of the script's own (shaped as DNS: QR set, one question), delivered before the server's
un = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
un.sendto(q, ('127.3.5.3', 53))
srv.recvfrom(512)
forger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); forger.bind(('127.3.5.3', 0))
forger.sendto(q[:2] + b'\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00' + q[12:] + b'\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x3c\x00\x04\x7f\x00\x00\x4d', un.getsockname())
un.recvfrom(512)
cli.close(); srv.close(); forger.close(); un.close()
# namespace calls: a mount namespace of its own (a private mount there reaches nothing outside),
# then an open marked F_OTHER_NS, and a ptrace attach and a memory write to a pid that does not exist
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.unshare(0x00020000)  # CLONE_NEWNS
libc.mount(b'none', b'/', None, 0x40000 | 0x4000, None)  # MS_PRIVATE | MS_REC
open('/etc/hostname').close()
libc.ptrace(16, 0x3FFFFFFF, None, None)  # PTRACE_ATTACH: ESRCH
libc.process_vm_writev(0x3FFFFFFF, None, 0, None, 0, 0)
os.execv('/bin/sh', ['sh', '-c', 'exit 7'])
"""


def jsonable(decoded: dict[str, Any]) -> dict[str, Any]:
    """A decoded record as JSON holds it: bytes (a DNS record's payload) as hex."""
    return {k: v.hex() if isinstance(v, bytes) else v for k, v in decoded.items()}


def main() -> None:
    mount_tracefs()
    ensure_headers()
    probes = RecorderProbes()
    ring = probes.ring()
    cg = RunCgroup.create(f"capture-{os.getpid()}")
    probes.attach_ingress(cg.id, cg.path)  # ---- dns: what the kernel delivers to the run's sockets
    probes.track(cg.id, 1)
    # a shell joins the cgroup and execs the script: no preexec_fn, whose Python code between fork
    # and exec can deadlock beside BCC's threads. A child of the shell (tee) writes the shell's pid,
    # so the shell does nothing recorded once it is in the cgroup but exec (a redirection of its own
    # would restore its stdout there: a dup record before the script's)
    join = 'echo $$ | tee "$1" > /dev/null && shift && exec "$@"'
    subprocess.run(
        ["/bin/sh", "-c", join, "sh", str(cg.procs_file()), "/usr/bin/python3", "-S", "-c", SCRIPT],
        check=False,
    )
    time.sleep(0.2)
    raw = ring.read()
    probes.untrack(cg.id)
    cg.wait_empty()
    cg.remove()
    wanted = [{"hex": r.hex(), "decoded": jsonable(decode(r))} for r in raw]
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("raw_records.json")
    out.write_text(json.dumps(wanted, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(wanted)} records to {out}")
    os._exit(0)


if __name__ == "__main__":
    main()
