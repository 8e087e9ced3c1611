"""Imports point down. bundle/ and policy/ are what a reviewer's laptop installs: they import nothing
of agent/ or probes/ (no BCC, no root), at module level or inside a function. Inside agent/, the
recorder is below the daemon and the daemon below the commands."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, absolute, anywhere in the file (relative imports resolved)."""
    package = ["evidence", *path.relative_to(ROOT).parent.parts]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                out.add(".".join([*base, node.module] if node.module else base))
            elif node.module:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("bundle", ("evidence.agent", "evidence.probes")),
        ("policy", ("evidence.agent", "evidence.probes")),
        ("probes", ("evidence.agent", "evidence.policy", "evidence.bundle")),
        ("agent/recorder", ("evidence.agent.daemon", "evidence.agent.commands", "evidence.cli")),
        ("agent/daemon", ("evidence.agent.commands", "evidence.cli")),
    ],
)
def test_imports_point_down(folder: str, forbidden: tuple[str, ...]) -> None:
    modules = sorted((ROOT / folder).rglob("*.py"))
    assert modules
    for path in modules:
        up = sorted(m for m in _imports(path) if _under(m, *forbidden))
        assert not up, f"{path.relative_to(ROOT)} imports {up}"
