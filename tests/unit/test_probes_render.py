"""The probes' C is rendered by a pure function: every token filled, every program the loader
attaches present, the layouts' sizes the ABI module's, each concern's file joined once in the order
record.bpf.c lists them. (`evidence run --ebpf` prints the C of this machine.)"""

from __future__ import annotations

import re
import struct
from importlib import resources
from pathlib import Path

import pytest

from evidence.probes import abi, loader
from evidence.probes.btf import BTF, BTFError
from evidence.probes.render import _TOKENS, GENERATED, ProbeConfig, RenderError, join_parts, render, template

_INCLUDE = re.compile(r'^#include "([^"]+)"$', re.MULTILINE)
OFFSETS = {
    "TASK_PID_OFF": 1264,
    "TASK_TGID_OFF": 1268,
    "TASK_EXIT_CODE_OFF": 1164,
    "TASK_MM_OFF": 1136,
    "MM_ARG_START_OFF": 480,
    "MM_ARG_END_OFF": 488,
    "MM_EXE_FILE_OFF": 1312,
    "FILE_INODE_OFF": 32,
    "TASK_FILES_OFF": 1824,
    "FILES_FDT_OFF": 32,
    "FDT_MAX_FDS_OFF": 0,
    "FDT_FD_OFF": 8,
    "TASK_CGROUPS_OFF": 2376,
    "CSS_SET_DFL_CGRP_OFF": 112,
    "CGROUP_KN_OFF": 256,
    "KERNFS_NODE_ID_OFF": 96,
    "TASK_FS_OFF": 1816,
    "FS_PWD_OFF": 40,
    "PATH_DENTRY_OFF": 8,
    "DENTRY_INODE_OFF": 48,
    "FILE_PATH_OFF": 64,
    "PATH_MNT_OFF": 0,
    "FS_ROOT_OFF": 24,
    "DENTRY_PARENT_OFF": 24,
    "DENTRY_NAME_OFF": 32,
    "QSTR_LEN_OFF": 4,
    "QSTR_NAME_OFF": 8,
    "VFSMOUNT_ROOT_OFF": 0,
    "MOUNT_MNT_OFF": 32,
    "MOUNT_PARENT_OFF": 16,
    "MOUNT_MOUNTPOINT_OFF": 24,
    "INODE_NLINK_OFF": 72,
    "INODE_MODE_OFF": 0,
    "INODE_INO_OFF": 64,
    "INODE_SB_OFF": 40,
    "INODE_SIZE_OFF": 80,
    "SB_DEV_OFF": 16,
    "INODE_CTIME_SEC_OFF": 104,
    "INODE_CTIME_NSEC_OFF": 120,
    "FILE_PRIVATE_DATA_OFF": 24,
    "SOCKET_SK_OFF": 24,
    "SOCK_COOKIE_OFF": 88,
}


def _rendered() -> str:
    return render(ProbeConfig(offsets=OFFSETS))


def test_every_token_is_filled() -> None:
    text = _rendered()
    assert not re.findall(r"\b(" + "|".join(_TOKENS) + r")\b", text)
    assert not _INCLUDE.search(text)  # every part joined in: BCC is given one text
    assert "#define HAVE_GROUP_DEAD 1" in text and "+ 1268" in text  # a flag and a BTF offset
    assert "BPF_RINGBUF_OUTPUT(events, 16384);" in text and "#define MAX_RUNS_ 1024" in text


def test_every_program_the_loader_attaches_is_present_and_no_other() -> None:
    text = _rendered()
    defined = set(
        re.findall(
            r"^int (\w+)\((?:struct sys_(?:enter|exit)_ctx|struct __sk_buff|struct bpf_raw_tracepoint_args) \*\w+\) \{",
            text,
            re.M,
        )
    )
    loaded = {
        *loader.SYSCALL_HANDLERS,
        *loader.EXIT_HANDLERS.values(),
        "on_exit",
        "on_exit_hash",
        "on_exit_name",
    }
    loaded |= {"on_enter_dns", "on_exit_dns", "on_dns_ingress"}
    loaded |= {loader.EXEC_CHECK, loader.EXEC_HASH}  # attached once a run's execs are checked
    assert defined == loaded
    for probe in (
        "TRACEPOINT_PROBE(sched, sched_process_exec)",
        "TRACEPOINT_PROBE(sched, sched_process_exit)",
        "RAW_TRACEPOINT_PROBE(sched_process_fork)",
        "RAW_TRACEPOINT_PROBE(signal_generate)",
    ):
        assert text.count(probe + " {") == 1, probe


def test_the_layouts_and_their_sizes_are_the_abi_modules() -> None:
    text = _rendered()
    assert text.count(abi.render_header()) == 1
    for lay in abi.LAYOUTS:
        assert text.count(f"struct {lay.name} {{") == 1, lay.name
        assert f"struct {lay.name}" in text.split(abi.render_header())[1], lay.name  # used after it
        assert re.search(
            rf"_Static_assert\((sizeof|offsetof)\(struct {lay.name}\b[^)]*\) == {lay.size},", text
        )


def _parts() -> list[str]:
    return _INCLUDE.findall(template())


def test_each_concerns_file_is_joined_once_in_record_bpf_cs_order() -> None:
    parts = _parts()
    assert len(parts) == len(set(parts))
    assert parts[:2] == ["bpf/lib/common.h", "abi.h"]  # limits first, then the ABI every part uses
    files = resources.files("evidence.probes").joinpath("bpf")
    on_disk = {f"bpf/{f.name}" for f in files.iterdir() if f.name.endswith(".bpf.c")}
    on_disk |= {f"bpf/lib/{f.name}" for f in files.joinpath("lib").iterdir() if f.name.endswith(".h")}
    assert set(parts) - set(GENERATED) == on_disk  # every file listed, none listed that is not there
    text, at = join_parts(template()), 0  # (before the tokens are filled)
    for name in parts:  # each part's text, in the order listed
        body = GENERATED[name]() if name in GENERATED else template(name)
        found = text.find(body, at)
        assert found >= at, name
        at = found + len(body)


def test_a_part_twice_missing_or_nested_is_refused() -> None:
    root = template()
    with pytest.raises(RenderError, match="twice"):
        join_parts(root + '#include "bpf/opens.bpf.c"\n')
    with pytest.raises(RenderError, match="no part"):
        join_parts(root + '#include "bpf/nope.bpf.c"\n')
    assert not any(_INCLUDE.search(template(name)) for name in _parts() if name not in GENERATED)


def test_render_refuses_missing_and_unfilled_tokens() -> None:
    with pytest.raises(RenderError, match="TASK_MM_OFF"):
        render(ProbeConfig(offsets={k: v for k, v in OFFSETS.items() if k != "TASK_MM_OFF"}))
    with pytest.raises(RenderError, match="power of two"):
        render(ProbeConfig(offsets=OFFSETS, args_bytes=3000))


def test_render_optional_tracepoints() -> None:
    text = render(ProbeConfig(offsets=OFFSETS, have_group_dead=False))
    assert "#define HAVE_GROUP_DEAD" not in text


def _btf_blob() -> bytes:
    """struct outer { int a; union { long b; struct { int c; int d; }; }; }; with a typedef."""
    strings = b"\0int\0outer\0a\0b\0c\0d\0long\0"
    off = {
        name: strings.index(b"\0" + name.encode() + b"\0") + 1
        for name in ("int", "outer", "a", "b", "c", "d", "long")
    }
    types = b""
    types += struct.pack("<III", off["int"], 1 << 24, 4) + struct.pack("<I", 32)  # 1: int
    types += struct.pack("<III", off["long"], 1 << 24, 8) + struct.pack("<I", 64)  # 2: long
    types += struct.pack("<III", 0, (4 << 24) | 2, 8)  # 3: anon struct {int c; int d;}
    types += struct.pack("<III", off["c"], 1, 0) + struct.pack("<III", off["d"], 1, 32)
    types += struct.pack("<III", 0, (5 << 24) | 2, 8)  # 4: anon union {long b; struct 3;}
    types += struct.pack("<III", off["b"], 2, 0) + struct.pack("<III", 0, 3, 0)
    types += struct.pack("<III", off["outer"], (4 << 24) | 2, 16)  # 5: struct outer
    types += struct.pack("<III", off["a"], 1, 0) + struct.pack("<III", 0, 4, 64)
    hdr = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(strings))
    return hdr + types + strings


def test_btf_offsets_through_anonymous_members() -> None:
    btf = BTF(_btf_blob())
    assert btf.member_offset("outer", "a") == 0
    assert btf.member_offset("outer", "b") == 8
    assert btf.member_offset("outer", "d") == 12
    with pytest.raises(BTFError, match="no member"):
        btf.member_offset("outer", "zz")
    with pytest.raises(BTFError, match="not found"):
        btf.member_offset("nope", "a")
    with pytest.raises(BTFError, match="magic"):
        BTF(b"\0" * 32)


@pytest.mark.skipif(not Path("/sys/kernel/btf/vmlinux").exists(), reason="no kernel BTF on this machine")
def test_real_kernel_btf_has_the_offsets_we_need() -> None:
    from evidence.probes.btf import probe_offsets

    offs = probe_offsets()
    assert offs["TASK_TGID_OFF"] == offs["TASK_PID_OFF"] + 4  # pid_t pid; pid_t tgid; side by side
    assert offs["MM_ARG_END_OFF"] == offs["MM_ARG_START_OFF"] + 8


@pytest.mark.skipif(not Path("/sys/kernel/btf/vmlinux").exists(), reason="no kernel BTF on this machine")
def test_btf_offsets_are_cached_and_a_bad_cache_is_ignored(tmp_path: Path) -> None:
    from evidence.probes.btf import probe_offsets

    first = probe_offsets(cache_dir=tmp_path)
    (cached,) = tmp_path.glob("btf-offsets-*.json")
    assert probe_offsets(cache_dir=tmp_path) == first
    cached.write_text('{"TASK_PID_OFF": "not a number"}')
    assert probe_offsets(cache_dir=tmp_path) == first  # recomputed, not trusted
    assert probe_offsets(cache_dir=None) == first


def test_no_tracepoint_gets_two_programs() -> None:
    """BCC keeps one attachment per tracepoint name: a second program on the same tracepoint would
    orphan the first (never detached). The DNS handlers take only syscalls no other handler has."""
    from evidence.probes.loader import DNS_ENTER, DNS_EXIT, SYSCALL_HANDLERS

    handled = [name for names in SYSCALL_HANDLERS.values() for name in names]
    assert len(handled) == len(set(handled))
    assert not set(DNS_ENTER) & set(handled) and not set(DNS_EXIT) & set(handled)
