"""probes/ is the bottom of the recorder: it imports no package above it (agent, policy, bundle); what
it needs of them is passed in as typed data (probes/guard.py's GuardRules)."""

from __future__ import annotations

import ast
from pathlib import Path

PROBES = Path(__file__).resolve().parents[2] / "probes"


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_probes_import_nothing_above_them() -> None:
    modules = sorted(PROBES.glob("*.py"))
    assert len(modules) > 5
    for path in modules:
        above = {
            m
            for m in _imports(path)
            if m.split(".")[:2] in (["evidence", "agent"], ["evidence", "policy"], ["evidence", "bundle"])
        }
        assert not above, f"{path.name} imports {sorted(above)}"
