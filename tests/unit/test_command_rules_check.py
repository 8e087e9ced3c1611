"""Where the exec check cannot name programs (agent/recorder/command_rules.py
`unpinnable_programs`): / or /usr on btrfs turns the check off (a degradation), not every exec
killed."""

from __future__ import annotations

from evidence.agent.recorder.command_rules import unpinnable_programs

EXT4_ROOT = "27 1 254:1 / / rw,relatime - ext4 /dev/vda1 rw\n22 27 0:21 / /proc rw - proc proc rw\n"


def test_an_ext4_root_is_pinnable() -> None:
    assert unpinnable_programs(EXT4_ROOT) is None


def test_a_btrfs_root_is_not() -> None:
    why = unpinnable_programs("27 1 0:31 /@ / rw - btrfs /dev/vda2 rw,subvol=/@\n")
    assert why is not None and why.startswith("/ is btrfs")


def test_a_btrfs_usr_over_an_ext4_root_is_not() -> None:
    why = unpinnable_programs(EXT4_ROOT + "30 27 0:40 /@usr /usr rw - btrfs /dev/vda3 rw\n")
    assert why is not None and why.startswith("/usr is btrfs")


def test_an_ext4_usr_over_a_btrfs_root_is_still_not() -> None:
    why = unpinnable_programs(
        "27 1 0:31 /@ / rw - btrfs /dev/vda2 rw\n30 27 254:1 / /usr rw - ext4 /dev/vda1 rw\n"
    )
    assert why is not None and why.startswith("/ is btrfs")


def _rules(pins: object, degraded: list[object], *, dry_run: bool = False) -> object:
    from evidence.agent.recorder.approvals import ApprovalBroker
    from evidence.agent.recorder.command_rules import CommandRules
    from evidence.policy.model import parse_policy

    policy = parse_policy(
        "version: 1\ncommands:\n  default: allow\n",
        name="p.yaml",
        variables={"WORKSPACE": "/ws"},
        resolve=None,
    )
    return CommandRules(
        "run-1",
        policy,
        add_records=lambda _recs: None,
        broker=ApprovalBroker(record=lambda _rec: None),
        owner_uid=0,
        dry_run=dry_run,
        pins=pins,  # type: ignore[arg-type]
        slot=3,
        degrade=degraded.append,
    )


def test_the_check_is_enforced_on_the_runs_slot_moved_with_its_key_and_released() -> None:
    from evidence.agent.recorder.command_rules import CommandRules
    from evidence.agent.recorder.exec_check import MemoryPublisher

    pins = MemoryPublisher(bytes(16))
    degraded: list[object] = []
    rules = _rules(pins, degraded)
    assert isinstance(rules, CommandRules)
    check = rules._enforce()
    assert check is not None and pins.enforced == {3} and degraded == []
    rules.moved(5)  # a window cut to a new slot: the same key there, not in the old slot
    assert pins.enforced == {5} and rules.check is not None and rules.check.key == check.key
    rules.close()
    assert pins.enforced == set() and rules.check is None


def test_a_dry_run_enforces_no_check() -> None:
    from evidence.agent.recorder.command_rules import CommandRules
    from evidence.agent.recorder.exec_check import MemoryPublisher

    pins = MemoryPublisher(bytes(16))
    rules = _rules(pins, [], dry_run=True)
    assert isinstance(rules, CommandRules) and rules._enforce() is None and pins.enforced == set()
