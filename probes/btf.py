"""A small reader of kernel BTF (/sys/kernel/btf/vmlinux): struct member offsets at start-up.

The installed kernel headers do not match the running kernel, so the probes never take a struct layout
from them. The few offsets they need (task_struct.tgid, task_struct.exit_code, ...) come from here and
are filled into the BPF C as numbers by probes/render.py, in place of UPPERCASE tokens.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path

from evidence.files import write_atomic

VMLINUX = Path("/sys/kernel/btf/vmlinux")

_KIND_STRUCT, _KIND_UNION = 4, 5
# Bytes that follow a btf_type, by kind: (fixed, per vlen item)
_EXTRA = {
    1: (4, 0),  # INT
    2: (0, 0),  # PTR
    3: (12, 0),  # ARRAY
    4: (0, 12),  # STRUCT
    5: (0, 12),  # UNION
    6: (0, 8),  # ENUM
    7: (0, 0),  # FWD
    8: (0, 0),  # TYPEDEF
    9: (0, 0),  # VOLATILE
    10: (0, 0),  # CONST
    11: (0, 0),  # RESTRICT
    12: (0, 0),  # FUNC
    13: (0, 8),  # FUNC_PROTO
    14: (4, 0),  # VAR
    15: (0, 12),  # DATASEC
    16: (0, 0),  # FLOAT
    17: (4, 0),  # DECL_TAG
    18: (0, 0),  # TYPE_TAG
    19: (0, 12),  # ENUM64
}


class BTFError(Exception):
    pass


class BTF:
    def __init__(self, data: bytes) -> None:
        if len(data) < 24:
            raise BTFError("BTF blob too short")
        magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from(
            "<HBBIIIII", data, 0
        )
        if magic != 0xEB9F:
            raise BTFError("not a BTF blob (bad magic)")
        self._types = data[hdr_len + type_off : hdr_len + type_off + type_len]
        self._strings = data[hdr_len + str_off : hdr_len + str_off + str_len]
        self._index: list[int] = [0]  # type id -> offset in _types; id 0 is void
        off = 0
        n = len(self._types)
        while off < n:
            self._index.append(off)
            info = struct.unpack_from("<I", self._types, off + 4)[0]
            kind = (info >> 24) & 0x1F
            vlen = info & 0xFFFF
            if kind not in _EXTRA:
                raise BTFError(f"unknown BTF kind {kind}")
            fixed, per = _EXTRA[kind]
            off += 12 + fixed + per * vlen

    @classmethod
    def load(cls, path: Path = VMLINUX) -> BTF:
        return cls(path.read_bytes())

    def _name(self, off: int) -> str:
        end = self._strings.index(b"\0", off)
        return self._strings[off:end].decode()

    def _find_struct(self, name: str) -> int:
        key = b"\0" + name.encode() + b"\0"
        pos = self._strings.find(key)
        name_offs = set()
        while pos != -1:
            name_offs.add(pos + 1)
            pos = self._strings.find(key, pos + 1)
        for tid in range(1, len(self._index)):
            off = self._index[tid]
            name_off, info = struct.unpack_from("<II", self._types, off)
            if name_off in name_offs and (info >> 24) & 0x1F == _KIND_STRUCT and info & 0xFFFF:
                return tid
        raise BTFError(f"struct {name} not found in BTF")

    def _members(self, tid: int) -> Iterable[tuple[str, int, int]]:
        off = self._index[tid]
        info = struct.unpack_from("<I", self._types, off + 4)[0]
        kflag = info >> 31
        for i in range(info & 0xFFFF):
            name_off, mtype, moff = struct.unpack_from("<III", self._types, off + 12 + 12 * i)
            bits = moff & 0xFFFFFF if kflag else moff
            yield self._name(name_off), mtype, bits

    def _resolve(self, tid: int) -> tuple[int, int]:
        """Follow typedefs/modifiers: (type id, kind)."""
        while True:
            off = self._index[tid]
            info, ref = struct.unpack_from("<II", self._types, off + 4)
            kind = (info >> 24) & 0x1F
            if kind in (8, 9, 10, 11, 18):
                tid = ref
                continue
            return tid, kind

    def member_offset(self, struct_name: str, member: str) -> int:
        """Byte offset of `member` in `struct struct_name`, looking through anonymous structs/unions."""
        found = self._search(self._find_struct(struct_name), member, 0)
        if found is None:
            raise BTFError(f"struct {struct_name} has no member {member}")
        if found % 8:
            raise BTFError(f"{struct_name}.{member} is a bitfield")
        return found // 8

    def _search(self, tid: int, member: str, base_bits: int) -> int | None:
        for name, mtype, bits in self._members(tid):
            if name == member:
                return base_bits + bits
            if not name:
                rt, kind = self._resolve(mtype)
                if kind in (_KIND_STRUCT, _KIND_UNION):
                    hit = self._search(rt, member, base_bits + bits)
                    if hit is not None:
                        return hit
        return None


# The offsets the recorder's probes need.
NEEDED = {
    "TASK_PID_OFF": ("task_struct", "pid"),
    "TASK_TGID_OFF": ("task_struct", "tgid"),
    "TASK_EXIT_CODE_OFF": ("task_struct", "exit_code"),
    "TASK_MM_OFF": ("task_struct", "mm"),
    "MM_ARG_START_OFF": ("mm_struct", "arg_start"),
    "MM_ARG_END_OFF": ("mm_struct", "arg_end"),
    # the file an exec mapped (mm->exe_file->f_inode): device, inode, size and ctime, so a program
    # gone before it could be hashed through /proc is hashed by path only if the path still names it
    "MM_EXE_FILE_OFF": ("mm_struct", "exe_file"),
    "FILE_INODE_OFF": ("file", "f_inode"),
    # what a descriptor names now (task->files->fdt->fd[n]->f_inode), for the identity checks of
    # records resolved against a descriptor (bpf/lib/task.h fd_inode)
    "TASK_FILES_OFF": ("task_struct", "files"),
    "FILES_FDT_OFF": ("files_struct", "fdt"),
    "FDT_MAX_FDS_OFF": ("fdtable", "max_fds"),
    "FDT_FD_OFF": ("fdtable", "fd"),
    # the current task's cgroup id, loaded as bpf_get_current_cgroup_id reads it
    "TASK_CGROUPS_OFF": ("task_struct", "cgroups"),
    "CSS_SET_DFL_CGRP_OFF": ("css_set", "dfl_cgrp"),
    "CGROUP_KN_OFF": ("cgroup", "kn"),
    "KERNFS_NODE_ID_OFF": ("kernfs_node", "id"),
    # the working directory (task->fs->pwd.dentry->d_inode), for the same checks of relative names
    "TASK_FS_OFF": ("task_struct", "fs"),
    "FS_PWD_OFF": ("fs_struct", "pwd"),
    "PATH_DENTRY_OFF": ("path", "dentry"),
    "DENTRY_INODE_OFF": ("dentry", "d_inode"),
    # the kernel's name of a file or cwd (bpf/names.bpf.c kernel_name): the dentry chain up to the
    # process's root (task->fs->root), across mounts (struct mount around its vfsmount)
    "FILE_PATH_OFF": ("file", "f_path"),
    "PATH_MNT_OFF": ("path", "mnt"),
    "FS_ROOT_OFF": ("fs_struct", "root"),
    "DENTRY_PARENT_OFF": ("dentry", "d_parent"),
    "DENTRY_NAME_OFF": ("dentry", "d_name"),
    "QSTR_LEN_OFF": ("qstr", "len"),
    "QSTR_NAME_OFF": ("qstr", "name"),
    "VFSMOUNT_ROOT_OFF": ("vfsmount", "mnt_root"),
    "MOUNT_MNT_OFF": ("mount", "mnt"),
    "MOUNT_PARENT_OFF": ("mount", "mnt_parent"),
    "MOUNT_MOUNTPOINT_OFF": ("mount", "mnt_mountpoint"),
    # a write's file's link count (bpf/lib/emit.h inode_nlink): i_nlink, and i_mode to leave out
    # directories (and, for ---- dns, to tell a socket's inode)
    "INODE_NLINK_OFF": ("inode", "i_nlink"),
    "INODE_MODE_OFF": ("inode", "i_mode"),
    "INODE_INO_OFF": ("inode", "i_ino"),
    "INODE_SB_OFF": ("inode", "i_sb"),
    "INODE_SIZE_OFF": ("inode", "i_size"),
    "SB_DEV_OFF": ("super_block", "s_dev"),
    "INODE_CTIME_SEC_OFF": ("inode", "i_ctime_sec"),
    "INODE_CTIME_NSEC_OFF": ("inode", "i_ctime_nsec"),
    # ---- dns: the cookie of the socket a DNS message was received on (file->private_data, a
    # struct socket, ->sk->sk_cookie: struct sock starts with its sock_common), to tell which of the
    # datagrams the kernel delivered to the run's sockets it was (i_mode, above, says the inode is a socket's)
    "FILE_PRIVATE_DATA_OFF": ("file", "private_data"),
    "SOCKET_SK_OFF": ("socket", "sk"),
    "SOCK_COOKIE_OFF": ("sock_common", "skc_cookie"),
}
# older kernels: ctime as a struct timespec64 (tv_sec, then tv_nsec 8 bytes on): 6.6-6.10, then before
_CTIME_TIMESPEC = ("__i_ctime", "i_ctime")


def probe_offsets(btf: BTF | None = None, cache_dir: Path | None = Path("/run/evidence")) -> dict[str, int]:
    """The offsets the probes need. Parsing the kernel's BTF takes about 0.1 s, so the result is
    kept in cache_dir (a root-owned tmpfs directory: it lives as long as the boot), keyed by the
    kernel release and the BTF file's size and mtime."""
    if btf is not None:
        return _offsets(btf)
    cache = None
    if cache_dir is not None:
        st = VMLINUX.stat()
        key = f"{os.uname().release}-{st.st_size}-{st.st_mtime_ns}"
        cache = cache_dir / f"btf-offsets-{key}.json"
        try:
            cached = json.loads(cache.read_text())
            if set(cached) == set(NEEDED) and all(type(v) is int for v in cached.values()):
                return {k: int(v) for k, v in cached.items()}
        except (OSError, ValueError):
            pass
    offsets = _offsets(BTF.load())
    if cache is not None:
        try:
            cache.parent.mkdir(mode=0o755, exist_ok=True)
            write_atomic(cache, json.dumps(offsets).encode(), fsync=False)
        except OSError:
            pass
    return offsets


def _offsets(btf: BTF) -> dict[str, int]:
    out = {}
    for macro, (s, m) in NEEDED.items():
        if macro.startswith("INODE_CTIME_"):
            continue
        out[macro] = btf.member_offset(s, m)
    try:
        out["INODE_CTIME_SEC_OFF"] = btf.member_offset("inode", "i_ctime_sec")
        out["INODE_CTIME_NSEC_OFF"] = btf.member_offset("inode", "i_ctime_nsec")
    except BTFError:
        for name in _CTIME_TIMESPEC:
            try:
                sec = btf.member_offset("inode", name)
            except BTFError:
                continue
            out["INODE_CTIME_SEC_OFF"], out["INODE_CTIME_NSEC_OFF"] = sec, sec + 8
            break
        else:
            raise
    return out
