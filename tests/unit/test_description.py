"""A run's description (agent/recorder/description.py) round-trips whole through its run record,
names that are not UTF-8 included; a record that is not one is a one-line DescriptionError."""

from __future__ import annotations

import pytest

from evidence.agent.recorder.description import DescriptionError, RunDescription


def test_a_description_round_trips_whole_with_names_that_are_not_utf8() -> None:
    d = RunDescription(
        session_id="s1",
        cgroup="/sys/fs/cgroup/evidence/s1",
        command=["make", "t\udcffest"],
        claimed=True,
        cwd="/w/\udcff",
        pid=42,
        started_ns=7,
        attached_late=False,
        detail="full",
        labels={"job": "1"},
        policy={"name": "default", "workspace": "/w/\udcff"},
        network="none",
        resolvers=["127.0.0.53"],
        roots={"${WORKSPACE}": "/w/\udcff"},
        capabilities={"isolation": "no_new_privs", "32bit_syscalls": "refused"},
        degradations=[{"component": "isolation", "reason": "r", "impact": "i"}],
        bundle_path="/w/run.tar.gz",
        exit_code=3,
        finished_ns=9,
    )
    assert RunDescription.from_json(d.to_json(), "s1") == d
    assert d.to_json().isascii()


def test_an_older_record_is_read_and_unknown_fields_are_ignored() -> None:
    old = b'{"session_id": "s2", "command": ["true"], "pid": 0, "labels": {}, "future": 1}'
    d = RunDescription.from_json(old, "s2")
    assert d.command == ["true"] and d.policy is None and d.degradations == [] and not d.ended


@pytest.mark.parametrize("raw", [b"{", b"[]", b'{"session_id": 5, "pid": "x"}', b"\xff"])
def test_a_record_that_is_not_one_is_one_error(raw: bytes) -> None:
    with pytest.raises(DescriptionError, match="^run record of s3: "):
        RunDescription.from_json(raw, "s3")
