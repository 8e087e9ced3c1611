"""evidence show --format markdown: rendered by GitHub's own cmark-gfm (cmarkgfm), hostile names
stay text: no element, link or table cell of theirs."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import cmarkgfm
import pytest
from cmarkgfm.cmark import Options

from evidence.bundle import show_markdown
from evidence.cli import main
from tests.unit import hostile_names
from tests.unit.conftest_bundles import records, write

ALLOWED = {"h3", "p", "details", "summary", "pre", "code", "strong", "ul", "li", "table", "thead",
           "tbody", "tr", "th", "td", "blockquote", "em"}  # fmt: skip


class Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []
        self.code: list[str] = []  # the text of each code element
        self.rows: list[int] = []  # cells per table row
        self._in_code = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attrs += [a for a in attrs if a != ("open", None) and a[0] != "lang" and a[0] != "align"]
        if tag == "code":
            self._in_code += 1
            self.code.append("")
        elif tag == "tr":
            self.rows.append(0)
        elif tag in ("td", "th"):
            self.rows[-1] += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "code":
            self._in_code -= 1

    def handle_data(self, data: str) -> None:
        if self._in_code:
            self.code[-1] += data


def gfm(text: str) -> Page:
    # UNSAFE: raw HTML passes through (GitHub sanitises it later; ours must not need that)
    html = cmarkgfm.github_flavored_markdown_to_html(text, options=Options.CMARK_OPT_UNSAFE)
    page = Page()
    page.feed(html)
    page.close()
    return page


def test_code_span() -> None:
    for name in ["a", "`", "``x`", " a ", "a|b", "x\ny"]:
        page = gfm(show_markdown.code(name) + "\n")
        assert page.code == [name.replace("\n", "\\n")], name
    assert gfm("| " + show_markdown.code("a|b\\|c", cell=True) + " |\n|---|\n").code[-1] == "a|b\\|c"


def test_markdown_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "a.tar.gz", lost={"ringbuf": 4})
    assert main(["show", "--format", "markdown", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("### evidence: `make test` · exit 0 · 5.000 s\n")
    assert "lost: 4 events (`ringbuf` 4)" in out and "> **Warning:**" in out
    page = gfm(out)
    assert set(page.tags) <= ALLOWED and page.tags.count("details") == 5
    tree = next(c for c in page.code if c.startswith("  101"))
    assert tree.startswith("  101 make test\n  `- 102 sh -c 'cc -o app app.c'\n")  # the tree
    assert "/home/ci/work/Makefile" in page.code


def test_markdown_hostile_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = hostile_names.bundle(tmp_path / "h.tar.gz")
    assert main(["show", "--format", "markdown", "--limit", "0", str(path)]) == 0
    out = capsys.readouterr().out
    page = gfm(out)
    assert set(page.tags) <= ALLOWED, set(page.tags) - ALLOWED  # no a, img, script, extra details
    assert page.attrs == []
    assert page.tags.count("details") == 5
    assert set(page.rows) <= {2, 3, 4} and len(set(page.rows)) == 3  # each table keeps its columns
    for name in hostile_names.NAMES:
        assert name.replace("\n", "\\n").replace("\u202e", "\\u202e") in page.code, name
    assert (
        f"{hostile_names.IMG}={hostile_names.SCRIPT}" in page.code and "job=<b>x</b>" in page.code
    )  # labels
    assert any(hostile_names.PIPES in c for c in page.code if c.startswith("denied"))


def test_markdown_bounded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.unit.conftest_bundles import exec_, open_

    long = "/w/" + "\x01" * 4000
    recs = [*records(), *(open_(9000 + i, long + str(i), ["read"]) for i in range(200))]
    recs += [exec_(9500 + i, 200 + i, 101, long, [f"x{i}"]) for i in range(100)]
    path = write(tmp_path / "big.tar.gz", recs)
    assert main(["show", "--format", "markdown", str(path)]) == 0
    out = capsys.readouterr().out
    assert len(out) < 200_000 and "… 152 more (`evidence show --limit 0` lists all)" in out


def test_markdown_on_two_cpus_says_what_one_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """show's and lint's folds go through the reader's helper process together."""
    from evidence.bundle import container, fastpath, verify
    from tests.unit.conftest_bundles import connect, open_

    recs = [*records()]
    for i in range(40):
        recs.append(open_(9005 + i * 10, f"/etc/f{i % 11}", ["write"]))
        recs.append(connect(9006 + i * 10, f"203.0.113.{i % 7}"))
    path = write(tmp_path / "a.tar.gz", recs, lost={"ringbuf": 3})
    outs = []
    for fmt_ in ("markdown", "html"):
        with monkeypatch.context() as m:
            m.setattr(fastpath.Helper, "usable", staticmethod(lambda: False))
            assert main(["show", "--format", fmt_, str(path)]) == 0
            one = capsys.readouterr().out
        with monkeypatch.context() as m:
            m.setattr(container, "CHUNK", 700)
            m.setattr(verify, "PARALLEL_MIN", 0)
            m.setattr(fastpath.Helper, "usable", staticmethod(lambda: True))
            assert main(["show", "--format", fmt_, str(path)]) == 0
            outs.append((capsys.readouterr().out, one))
    for two, one in outs:
        assert two == one and "EV004" in one and "EV005" in one


def test_markdown_dns_section_with_a_hostile_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.unit.conftest_bundles import connect, dns

    name = "a|b`<img src=x>.example"
    path = write(tmp_path / "d.tar.gz", [*records(), dns(9000, name, ["192.0.2.7"]),
                                         dict(connect(9100, "192.0.2.7"), names=[name])])  # fmt: skip
    assert main(["show", "--format", "markdown", str(path)]) == 0
    page = gfm(capsys.readouterr().out)
    assert set(page.tags) <= ALLOWED and page.attrs == [] and page.tags.count("details") == 6
    assert f"{name} A -> 192.0.2.7 via 127.0.0.53" in page.code
    assert f"192.0.2.7:443 [{name}]" in page.code
