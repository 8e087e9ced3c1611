"""What a policy says about recorded operations (agent/recorder/enforce.py): the denials made of
refused execs whose name the exec rules allow (no root: files in tmp_path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evidence.agent.recorder.enforce import Enforcement, exec_chain
from evidence.policy.model import load_policy


def _world(tmp_path: Path) -> tuple[Path, Path]:
    """allowed/ (exec allowed) with a symlink and #! scripts into denied/ (not allowed)."""
    allowed, denied = tmp_path / "allowed", tmp_path / "denied"
    allowed.mkdir()
    denied.mkdir()
    (denied / "prog").write_bytes(b"\x7fELF")
    (allowed / "link").symlink_to(denied / "prog")
    (allowed / "script").write_text(f"#!{denied}/prog -x\n")
    (allowed / "nested").write_text(f"#!{allowed}/plain\n")
    (allowed / "plain").write_text(f"#! {allowed}/link\n")
    (allowed / "relative").write_text("#!../denied/prog\n")
    (allowed / "fine").write_text("#!/bin/sh\n")
    return allowed, denied


def test_exec_chain_follows_symlinks_and_interpreters(tmp_path: Path) -> None:
    allowed, denied = _world(tmp_path)
    prog = str(denied / "prog")
    assert exec_chain(str(allowed / "link"), "/") == [prog]
    assert exec_chain(str(allowed / "script"), "/") == [prog]
    assert exec_chain(str(allowed / "nested"), "/") == [f"{allowed}/plain", f"{allowed}/link", prog]
    assert exec_chain(str(allowed / "relative"), str(allowed)) == [prog]
    assert exec_chain(str(allowed / "relative"), None) == []
    assert exec_chain(str(denied / "prog"), "/") == []
    assert exec_chain(str(tmp_path / "nonexistent"), "/") == []


def _exec(filename: str, result: Any, cwd: str = "/") -> dict[str, Any]:
    return {
        "k": "exec",
        "t": 1,
        "pid": 7,
        "ppid": 1,
        "depth": 0,
        "filename": filename,
        "argv": [filename],
    } | {
        "argv_truncated": False,
        "cwd": cwd,
        "result": result,
    }


def test_a_refused_exec_of_an_allowed_name_is_a_denial_of_the_file_it_reached(tmp_path: Path) -> None:
    """The exec rules allow allowed/, Landlock refused the file the name reached (a symlink's
    target, a script's interpreter): the denial names that file, its rule, and the command. A
    refusal nothing explains (the file is allowed: no x bit, say) is no denial; nor is one by a
    process whose paths name other files (mntns other)."""
    allowed, denied = _world(tmp_path)
    policy_file = tmp_path / "p.yaml"
    policy_file.write_text(f"version: 1\nfs:\n  read: [/]\n  exec: [{allowed}, /bin, /usr]\n")
    policy = load_policy(policy_file, workspace=str(tmp_path), tmpdir=str(tmp_path))
    enforcement = Enforcement(
        policy, workspace=str(tmp_path), tmpdir=str(tmp_path), dry_run=False, fail_closed=False
    )
    recs: list[Any] = [
        _exec(str(allowed / "link"), "EACCES"),
        _exec(str(allowed / "nested"), "EACCES"),
        _exec(str(allowed / "relative"), "EACCES", cwd=str(allowed)),
        _exec(str(denied / "prog"), "EACCES"),
        _exec(str(allowed / "fine"), "EACCES"),
        _exec(str(allowed / "link"), 0),
        _exec(str(allowed / "link"), "EACCES") | {"mntns": "other"},
    ]
    got = [(d["target"], d["rule"], d["exe"], d["enforced"]) for d in enforcement.observe(recs)]
    prog, rule = str(denied / "prog"), "fs.exec: not allowed"
    assert got == [
        (prog, rule, str(allowed / "link"), True),
        (prog, rule, str(allowed / "nested"), True),
        (prog, rule, str(allowed / "relative"), True),
        (prog, rule, prog, True),
    ]


def _sections_policy(tmp_path: Path) -> Path:
    p = tmp_path / "policy.yaml"
    p.write_text(
        "version: 1\n"
        "commands:\n  default: allow\n  rules:\n"
        "    - {name: no-curl, program: [curl], decision: deny}\n"
        "limits:\n  memory: 64MiB\n  wall: 5s\n"
    )
    return p


def test_a_section_the_run_does_not_apply_is_a_degradation_and_fail_closed_refuses(tmp_path: Path) -> None:
    """commands and limits a run does not put in force are degradations (the manifest's policy
    summary names them: it must not read as a claim); --fail-closed refuses to start; a section the
    caller applies is no degradation."""
    import pytest

    from evidence.errors import EXIT_ERROR, PolicyError

    policy = load_policy(str(_sections_policy(tmp_path)), workspace=str(tmp_path), tmpdir=str(tmp_path))

    def enforcement(**kw: Any) -> Enforcement:
        return Enforcement(policy, workspace=str(tmp_path), tmpdir=str(tmp_path), dry_run=False, **kw)

    none = enforcement(fail_closed=False)
    said = {d.component: d for d in none.degradations}
    assert set(said) == {"commands", "limits"}
    assert "not in force" in said["commands"].impact and "not in force" in said["limits"].impact
    with pytest.raises(PolicyError) as e:
        enforcement(fail_closed=True).load_programs()
    assert e.value.exit_code == EXIT_ERROR and "commands" in e.value.message
    assert [d.component for d in enforcement(fail_closed=False, applies=("limits",)).degradations] == [
        "commands"
    ]
    assert enforcement(fail_closed=True, applies=("limits", "commands")).degradations == []
