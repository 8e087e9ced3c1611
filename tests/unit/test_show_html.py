"""evidence show --format html: one self-contained page (no script, nothing loaded), parsed here with
html.parser: the tree is there, and hostile names are text, never markup. Rendered in headless
Chromium too when one is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from evidence.bundle import show_html
from evidence.cli import main
from tests.unit import hostile_names
from tests.unit.conftest_bundles import exec_, records, write

VOID = {"meta", "br", "hr", "img", "input", "link"}


class Page(HTMLParser):
    """Elements, attributes and text; checks that every element is closed where it is opened."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str, str | None]] = []
        self.stack: list[str] = []
        self.text: list[str] = []
        self.code: list[str] = []
        self.max_depth = 0
        self.errors: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attrs += [(tag, k, v) for k, v in attrs]
        if tag not in VOID:
            self.stack.append(tag)
            self.max_depth = max(self.max_depth, self.stack.count("ul"))
        if tag == "code":
            self.code.append("")

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
        else:
            self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self.stack and self.stack[-1] == "code":
            self.code[-1] += data


def parse(html: str) -> Page:
    page = Page()
    page.feed(html)
    page.close()
    assert not page.errors and not page.stack, (page.errors, page.stack)
    return page


ALLOWED_ATTRS = {
    ("html", "lang"), ("meta", "charset"), ("meta", "http-equiv"), ("meta", "content"), ("meta", "name"),
    ("ul", "class"), ("span", "class"), ("p", "class"), ("details", "open"), ("li", "class"),
}  # fmt: skip


def _self_contained(page: Page) -> None:
    assert "script" not in page.tags and "img" not in page.tags and "a" not in page.tags
    assert "link" not in page.tags and "iframe" not in page.tags
    assert {(t, k) for t, k, _ in page.attrs} <= ALLOWED_ATTRS
    csp = [v for t, k, v in page.attrs if t == "meta" and k == "content" and v and "default-src" in v]
    assert csp == [show_html.CSP]


def test_html_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs = [*records(), exec_(9100, 104, 101, "/usr/bin/ld", ["ld", "-o", "app"], depth=1)]
    path = write(tmp_path / "a.tar.gz", recs, labels={"job": "42"}, lost={"ringbuf": 2})
    assert main(["show", "--format", "html", str(path)]) == 0
    out = capsys.readouterr().out
    page = parse(out)
    _self_contained(page)
    assert "http" not in out.replace('http-equiv="', "")  # no URL anywhere
    text = "".join(page.text)
    assert "Verified" in text and "Labels" in text and "job" in page.code and "42" in page.code
    for section in ("Processes (4 execs)", "Files (", "Network (1 destinations)", "Denials (0)", "Loss",
                    "Lint findings (1)"):  # fmt: skip
        assert section in text
    # the tree: make > sh > cc, and make > ld, as nested lists
    i = out.index("101 <code>make test</code>")
    j = out.index("102 <code>sh -c")
    k = out.index("103 <code>cc -o app app.c</code>")
    m = out.index("104 <code>ld -o app</code>")
    assert i < j < k < m and out[k:m].count("</ul>") == 1
    assert page.max_depth == 3
    assert "events-lost" in text


def test_html_hostile_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = hostile_names.bundle(tmp_path / "h.tar.gz")
    assert main(["show", "--format", "html", "--limit", "0", str(path)]) == 0
    out = capsys.readouterr().out
    page = parse(out)
    _self_contained(page)
    assert page.tags.count("details") == 2 + 3  # two parents in the tree, three file classes
    for name in hostile_names.NAMES:
        shown = name.replace("\n", "\\n").replace("\u202e", "\\u202e")
        assert shown in page.code, name
    assert hostile_names.SCRIPT in page.code and hostile_names.IMG in page.code  # labels: text
    text = "".join(page.text)
    assert f"killed by {hostile_names.SCRIPT}" in text and hostile_names.IMG in text  # signal, loss kind


def test_html_deep_tree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chain = [exec_(1000 + i, 1000 + i, 999 + i, "/bin/sh", ["sh", str(i)], depth=i) for i in range(3000)]
    path = write(tmp_path / "deep.tar.gz", chain)
    assert main(["show", "--format", "html", "--limit", "0", str(path)]) == 0
    page = parse(capsys.readouterr().out)
    assert page.max_depth == show_html.MAX_NEST + 1
    assert "sh 2999" in page.code


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="no chromium installed (apt-get install chromium)")
def test_html_renders_in_chromium(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Headless Chromium loads the page (file://, no network) and its DOM holds the hostile names
    as text: no element of theirs, nothing run."""
    path = hostile_names.bundle(tmp_path / "h.tar.gz")
    assert main(["show", "--format", "html", "--limit", "0", str(path)]) == 0
    report = tmp_path / "report.html"
    report.write_text(capsys.readouterr().out, encoding="utf-8")
    args = [str(_chromium()), "--headless", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", report.as_uri()]  # fmt: skip
    proc = subprocess.run(
        args, capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    page = parse(proc.stdout)
    assert "script" not in page.tags and "img" not in page.tags and "a" not in page.tags
    assert hostile_names.SCRIPT in page.code and hostile_names.IMG in page.code
    assert "Processes (" in "".join(page.text)


@pytest.mark.parametrize("fmt", ["markdown", "html"])
def test_report_of_a_bad_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00 not a bundle")
    assert main(["show", "--format", fmt, str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("evidence: ")


def test_reports_say_whether_signed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from evidence.bundle import signing
    from evidence.bundle.writer import write_bundle
    from tests.unit.conftest_bundles import meta

    private, _, keyid = signing.generate(tmp_path / "key")
    path = tmp_path / "signed.tar.gz"
    write_bundle(path, meta(), lambda: iter(records()), signer=signing.load_signer(private))
    assert main(["show", "--format", "html", str(path)]) == 0
    text = "".join(parse(capsys.readouterr().out).text)
    assert f"Signed by keyid {keyid}: the signature is not checked here" in text
    assert main(["show", "--format", "markdown", str(path)]) == 0
    assert f"signed by keyid `{keyid}` (not checked here)" in capsys.readouterr().out
    assert main(["lint", "--format", "github", str(path)]) == 0
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .endswith(f"; note: signed by keyid {keyid} (signature not checked: give --key KEY.pub)")
    )
    unsigned = write(tmp_path / "unsigned.tar.gz")
    assert main(["show", "--format", "html", str(unsigned)]) == 0
    assert "Not signed: verification proves the bundle whole, not who wrote it." in "".join(
        parse(capsys.readouterr().out).text
    )


def test_html_dns_section_with_a_hostile_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.unit.conftest_bundles import dns

    name = "<script>x</script>.example"
    path = write(tmp_path / "d.tar.gz", [*records(), dns(9000, name, ["192.0.2.7"])])
    assert main(["show", "--format", "html", str(path)]) == 0
    out = capsys.readouterr().out
    page = parse(out)
    _self_contained(page)
    assert "DNS (1 queries)" in "".join(page.text)
    assert f"{name} A -> 192.0.2.7 via 127.0.0.53" in page.code and "<script>" not in out
