"""Issue 24's red team, on the record itself (no policy): a `#!` line whose interpreter ends in `\\r`
(`#!/w/ok\\r`, a CRLF script) runs the file `/w/ok\\r`, which the job made a link to id beside
`/w/ok`, a link to true. The bundle named `/w/ok` as the interpreter, with true's sha256: the record
said true ran when id did. The recorder reads the line as the kernel splits it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.kernel.util import as_user, evidence, of_type, read_bundle

pytestmark = pytest.mark.kernel


def test_the_interpreter_recorded_is_the_one_the_kernel_ran(place: Path) -> None:
    w = place / "w"
    script = (
        f"mkdir {w} && ln -s /usr/bin/true {w}/ok && ln -s /usr/bin/id \"{w}/ok$(printf '\\r')\" && "
        f"printf '#!{w}/ok\\r\\n' > {w}/crlf && chmod +x {w}/crlf && {w}/crlf; echo crlf=$?"
    )
    bundle = place / "run.tar.gz"
    proc = evidence("run", "--bundle", str(bundle), "--", *as_user(65534, "/bin/sh", "-c", script), cwd=place)
    assert "no such user" in proc.stdout + proc.stderr, proc  # id ran (on the script's name)
    _, events = read_bundle(bundle)
    (ran,) = [e["data"] for e in of_type(events, "process.exec") if e["data"]["filename"] == f"{w}/crlf"]
    id_sha = hashlib.sha256(Path("/usr/bin/id").read_bytes()).hexdigest()
    assert ran.get("interpreter") == f"{w}/ok\r", ran
    assert ran.get("interpreter_sha256") == id_sha, ran
