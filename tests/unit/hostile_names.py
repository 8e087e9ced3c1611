"""Names a job can give its files and programs to forge a report: markup, links, table breaks."""

from __future__ import annotations

from pathlib import Path

from tests.unit.conftest_bundles import denial, exec_, open_, records, write

SCRIPT = "/w/<script>alert(1)</script>"
IMG = '/w/"><img src=x onerror=alert(1)>'
PIPES = "/w/a|b|c"
NAMES = [
    SCRIPT,
    IMG,
    PIPES,
    "/w/``x``",
    "/w/`",
    "/w/[link](https://evil.example/x)",
    "www.evil.example",
    "/w/https://evil.example/y",
    "/w/mail@evil.example",
    "/w/line\n- forged item\n</details>",
    "/w/&amp;&lt;b&gt;",
    "/w/</details></summary><details open>",
    "/w/\u202eevil",
    "/w/**bold** _em_ ~~x~~ \\|",
]


def bundle(path: Path) -> Path:
    recs = [*records()]
    recs += [open_(9000 + i, name, ["read"]) for i, name in enumerate(NAMES)]
    recs += [exec_(9500, 110, 101, SCRIPT, [IMG, "x|y"])]
    recs += [denial(9600, PIPES), denial(9700, IMG)]
    return write(
        path,
        recs,
        lost={"ringbuf": 3, IMG: 1},
        labels={"job": "<b>x</b>", IMG: SCRIPT},
        exit_code=None,
        signal=SCRIPT,
    )
