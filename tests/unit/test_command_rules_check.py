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
