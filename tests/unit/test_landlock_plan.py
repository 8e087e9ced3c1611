"""The Landlock planner: rules per ABI, deny-in-allow sibling expansion and its stated costs,
degradations that cannot be expressed. Pure: reads a temporary tree, never calls Landlock."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from evidence.policy import landlock as ll
from evidence.policy.model import parse_policy


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    for d in ("a", ".ssh", ".config/gcloud", ".config/other", "ws/src"):
        (home / d).mkdir(parents=True)
    for f in ("a/x", ".ssh/id_rsa", ".config/gcloud/token", ".config/other/y", "notes", "ws/src/m.py"):
        (home / f).write_text("x")
    (home / "link-to-ssh").symlink_to(home / ".ssh")
    return tmp_path


def _policy(tree: Path, fs: str):  # noqa: ANN202
    return parse_policy(
        "version: 1\nfs:\n" + fs,
        name="p.yaml",
        variables={"HOME": str(tree / "home"), "WORKSPACE": str(tree / "home" / "ws")},
    )


def _rules(plan: ll.LandlockPlan) -> dict[str, int]:
    return {r.path: r.access for r in plan.rules}


def test_handled_rights_per_abi() -> None:
    assert ll.handled_fs(0) == 0
    assert ll.handled_fs(1) == (1 << 13) - 1
    assert ll.handled_fs(2) & ll.REFER and not ll.handled_fs(2) & ll.TRUNCATE
    assert ll.handled_fs(3) & ll.TRUNCATE and not ll.handled_fs(4) & ll.IOCTL_DEV
    assert ll.handled_fs(5) & ll.IOCTL_DEV and ll.handled_fs(7) == ll.handled_fs(5)
    assert ll.scopes(5) == 0 and ll.scopes(6) == ll.SCOPE_ABSTRACT_UNIX_SOCKET | ll.SCOPE_SIGNAL
    assert ll.group_rights("read", 1) == ll.READ_FILE | ll.READ_DIR
    assert ll.group_rights("exec", 7) & ll.EXECUTE and ll.group_rights("exec", 7) & ll.READ_FILE
    w = ll.group_rights("write", 7)
    assert w & ll.MAKE_REG and w & ll.TRUNCATE and w & ll.REFER and w & ll.READ_FILE
    assert not w & (ll.MAKE_CHAR | ll.MAKE_BLOCK | ll.EXECUTE)
    assert not ll.group_rights("write", 1) & (ll.REFER | ll.TRUNCATE)


def test_simple_allow_is_one_rule_per_root(tree: Path) -> None:
    plan = ll.plan(_policy(tree, '  read: ["${HOME}/a"]\n  write: ["${WORKSPACE}"]\n'), 7)
    assert _rules(plan) == {
        str(tree / "home" / "a"): ll.group_rights("read", 7),
        str(tree / "home" / "ws"): ll.group_rights("write", 7),
    }
    assert plan.costs == () and plan.degradations == () and plan.intermediates == {}
    assert plan.summary()["abi"] == 7 and plan.summary()["rules"] == 2


def test_deny_inside_allow_expands_siblings_along_the_path(tree: Path) -> None:
    home = tree / "home"
    plan = ll.plan(
        _policy(tree, '  read: ["${HOME}"]\n  deny: ["${HOME}/.ssh", "${HOME}/.config/gcloud"]\n'), 7
    )
    rules = _rules(plan)
    # the denied paths and the intermediate directories get no rule
    for p in (home, home / ".ssh", home / ".config", home / ".config" / "gcloud"):
        assert str(p) not in rules
    # every sibling along the denied paths does
    for p in (home / "a", home / "notes", home / "ws", home / ".config" / "other"):
        assert str(p) in rules
    # a file sibling only gets file rights
    assert rules[str(home / "notes")] == ll.READ_FILE | ll.IOCTL_DEV
    # a symlink sibling is not a rule (a rule on it would not follow it; its target is denied)
    assert str(home / "link-to-ssh") not in rules
    assert set(plan.intermediates) == {str(home), str(home / ".config")}
    assert any(
        c.startswith(f"{home}: read granted entry by entry because .config/gcloud, .ssh is denied")
        for c in plan.costs
    )
    assert plan.degradations == ()


def test_write_expansion_states_what_it_costs(tree: Path) -> None:
    home = tree / "home"
    plan = ll.plan(_policy(tree, '  write: ["${HOME}"]\n  deny: ["${HOME}/.ssh"]\n'), 7)
    cost = next(c for c in plan.costs if c.startswith(str(home)))
    assert "nothing can be created, renamed or removed directly in it" in cost
    assert plan.explain(str(home / "new-file"), "create") is not None
    assert plan.explain(str(home / "a" / "new-file"), "create") is None
    assert "cannot be listed" in (plan.explain(str(home), "read") or "")


def test_allow_inside_deny(tree: Path) -> None:
    home = tree / "home"
    plan = ll.plan(_policy(tree, '  write: ["${WORKSPACE}"]\n  deny: ["${HOME}"]\n'), 7)
    assert _rules(plan) == {str(home / "ws"): ll.group_rights("write", 7)}
    assert plan.intermediates == {}


def test_same_path_denied_and_allowed_is_denied(tree: Path) -> None:
    plan = ll.plan(_policy(tree, '  read: ["${HOME}/a"]\n  deny: ["${HOME}/a"]\n'), 7)
    assert plan.rules == ()


def test_missing_allow_paths_are_a_cost_not_a_rule(tree: Path) -> None:
    plan = ll.plan(_policy(tree, '  read: ["${HOME}/nope", "${HOME}/a"]\n'), 7)
    assert list(_rules(plan)) == [str(tree / "home" / "a")]
    assert any(
        c.startswith("not granted because they do not exist at start: ") and "nope" in c for c in plan.costs
    )


def test_rights_merge_per_path(tree: Path) -> None:
    plan = ll.plan(_policy(tree, '  read: ["${HOME}/a"]\n  exec: ["${HOME}/a"]\n'), 7)
    rule = plan.rules[0]
    assert rule.access == ll.group_rights("read", 7) | ll.group_rights("exec", 7)
    assert rule.groups == ("exec", "read") and rule.is_dir


def test_degradations(tree: Path) -> None:
    home = tree / "home"
    # no Landlock at all
    plan = ll.plan(_policy(tree, '  read: ["${HOME}"]\n'), 0)
    assert not plan.enforced and plan.degradations[0]["reason"].startswith("Landlock is not available")
    # truncate cannot be controlled below ABI 3
    plan = ll.plan(_policy(tree, '  write: ["${WORKSPACE}"]\n'), 2)
    assert any("truncate" in d["reason"] for d in plan.degradations)
    assert not any(
        "truncate" in d["reason"]
        for d in ll.plan(_policy(tree, '  write: ["${WORKSPACE}"]\n'), 3).degradations
    )
    # a deny glob in a writable tree cannot cover files created later
    plan = ll.plan(_policy(tree, '  write: ["${HOME}"]\n  deny: ["${HOME}/**/*.pem"]\n'), 7)
    assert any("glob" in d["reason"] for d in plan.degradations)
    # ... in a read-only tree it is only a cost
    plan = ll.plan(_policy(tree, '  read: ["${HOME}"]\n  deny: ["${HOME}/a/*"]\n'), 7)
    assert plan.degradations == () and any("glob" in c for c in plan.costs)
    assert str(home / "a" / "x") not in _rules(plan)
    # a denied file with another hard link
    os.link(home / ".ssh" / "id_rsa", home / "a" / "copy")
    plan = ll.plan(_policy(tree, '  read: ["${HOME}"]\n  deny: ["${HOME}/.ssh"]\n'), 7)
    assert [d["reason"] for d in plan.degradations] == [f"denied file {home}/.ssh/id_rsa has 2 hard links"]


def test_abi_1_and_4_costs(tree: Path) -> None:
    plan = ll.plan(_policy(tree, '  read: ["${HOME}/a"]\n'), 1)
    assert any("renaming or linking" in c for c in plan.costs)
    assert any("ioctl" in c for c in ll.plan(_policy(tree, '  read: ["${HOME}/a"]\n'), 4).costs)


def test_no_fs_section_is_an_empty_plan() -> None:
    plan = ll.plan(parse_policy("version: 1\n", name="p", variables={}), 7)
    assert plan.rules == () and not plan.enforced and plan.summary()["degradations"] == []


def test_apply_without_enforcement_is_a_no_op() -> None:
    ll.apply(ll.plan(None, 7))  # nothing to enforce: returns without touching the process
