// ---- the kernel's names ------------------------------------------------------------------
//
// A name is resolved by user space lexically against its base, which is wrong for a name with '..'
// after a component (that component may be a symlink or a /proc magic link: `/tmp/l/../passwd`
// with l -> /etc/ssh opens /etc/passwd, not /tmp/passwd), names a symlink's path rather than the
// file reached, and the probe reads the name from the job's memory before the kernel does
// (another thread can change it in between). So a successful open that becomes a record, and
// every chdir and fchdir (a cwd is always the kernel's name of it, and a relative name's leading
// '..' its real parent), carry the kernel's own name of what they reached (F_KNAME): the dentry
// chain of the file (or the new cwd) up to the process's root, across mounts, as d_path walks
// it. In summary an open's key has the inode it opened, so the repeats counted under a key are
// the same file and are not walked: only a key's first open is (settle); an open whose base
// the kernel cannot name is walked each time and aggregated by the kernel's name.

#define KNAME_MAX_ 2048  // bytes of a kernel name (with its NUL); a longer one is not given
#define KNAME_DEPTH_ 64  // dentries and mounts walked up; a deeper name is not given

// Writes the kernel's name of the file an open returned (ret) or of the new cwd (chdir, fchdir)
// after the record's path, with its NUL, and sets F_KNAME; nothing when the name cannot be had
// (not below the process's root, deeper than KNAME_DEPTH_, longer than KNAME_MAX_). The name is
// built backward in the call's record past open_ev.path (the union is as large as change_ev),
// then moved to just after the path. Reads race a concurrent rename as d_path's do without
// rename_lock: a name the file had, or its new one.
static __always_inline void kernel_name(struct call *c, s64 ret) {
    struct open_ev *e = &c->ev.open;
    u32 plen = e->path_len;
    if (plen > PATH_MAX_ - 1)
        return;
    char *task = (char *)bpf_get_current_task_btf();
    u64 fs = 0, vfsmnt = 0, dentry = 0, root_mnt = 0, root_dentry = 0;
    bpf_probe_read_kernel(&fs, sizeof(fs), task + TASK_FS_OFF);
    if (!fs)
        return;
    bpf_probe_read_kernel(&root_mnt, 8, (void *)(fs + FS_ROOT_OFF + PATH_MNT_OFF));
    bpf_probe_read_kernel(&root_dentry, 8, (void *)(fs + FS_ROOT_OFF + PATH_DENTRY_OFF));
    if (c->ev.h.kind == EV_OPEN) {
        u64 file = fd_file((s32)ret);
        if (!file)
            return;
        bpf_probe_read_kernel(&vfsmnt, 8, (void *)(file + FILE_PATH_OFF + PATH_MNT_OFF));
        bpf_probe_read_kernel(&dentry, 8, (void *)(file + FILE_PATH_OFF + PATH_DENTRY_OFF));
    } else {
        bpf_probe_read_kernel(&vfsmnt, 8, (void *)(fs + FS_PWD_OFF + PATH_MNT_OFF));
        bpf_probe_read_kernel(&dentry, 8, (void *)(fs + FS_PWD_OFF + PATH_DENTRY_OFF));
    }
    if (!vfsmnt || !dentry)
        return;
    char *area = (char *)&c->ev + offsetof(struct open_ev, path) + PATH_MAX_;
    area[KNAME_MAX_ - 1] = 0;
    // the offset goes through the map value on each turn: the verifier then sees an unknown number
    // (each use is masked) and not a range per turn and way through it, which it cannot prune
    c->koff = KNAME_MAX_ - 1;
    u64 mnt = vfsmnt - MOUNT_MNT_OFF;
    int named = 0;
#pragma clang loop unroll(disable)
    for (int i = 0; i < KNAME_DEPTH_; i++) {
        if (dentry == root_dentry && vfsmnt == root_mnt) {
            named = 1;
            break;
        }
        u64 mnt_root = 0, parent = 0;
        bpf_probe_read_kernel(&mnt_root, 8, (void *)(vfsmnt + VFSMOUNT_ROOT_OFF));
        bpf_probe_read_kernel(&parent, 8, (void *)(dentry + DENTRY_PARENT_OFF));
        if (dentry == mnt_root) {  // up to where the mount is mounted
            u64 up = 0;
            bpf_probe_read_kernel(&up, 8, (void *)(mnt + MOUNT_PARENT_OFF));
            if (!up || up == mnt)
                break;  // the top of its mount tree, and the process's root was not met: no name
            bpf_probe_read_kernel(&dentry, 8, (void *)(mnt + MOUNT_MOUNTPOINT_OFF));
            mnt = up;
            vfsmnt = mnt + MOUNT_MNT_OFF;
            continue;
        }
        if (dentry == parent || !parent)
            break;  // a root that is not its mount's root
        u32 off = *(volatile u32 *)&c->koff;
        u32 qlen = 0;
        u64 qname = 0;
        bpf_probe_read_kernel(&qlen, 4, (void *)(dentry + DENTRY_NAME_OFF + QSTR_LEN_OFF));
        bpf_probe_read_kernel(&qname, 8, (void *)(dentry + DENTRY_NAME_OFF + QSTR_NAME_OFF));
        if (qlen == 0 || qlen > 255 || qlen + 1 > off)
            break;
        off -= qlen;
        u32 at = off & (KNAME_MAX_ - 1);
        barrier_var(at);
        u32 size = qlen & 255;
        barrier_var(size);
        bpf_probe_read_kernel(area + at, size, (void *)qname);
        off -= 1;
        area[off & (KNAME_MAX_ - 1)] = '/';
        *(volatile u32 *)&c->koff = off;
        dentry = parent;
    }
    if (!named)
        return;
    u32 off = *(volatile u32 *)&c->koff;
    if (off == KNAME_MAX_ - 1) {  // the root itself
        off -= 1;
        area[off & (KNAME_MAX_ - 1)] = '/';
    }
    u32 klen = KNAME_MAX_ - off;  // with the NUL
    char *dst = (char *)&c->ev + offsetof(struct open_ev, path) + (plen & (PATH_MAX_ - 1));
    klen &= 2 * KNAME_MAX_ - 1;
    barrier_var(klen);
    bpf_probe_read_kernel(dst, klen, area + (off & (KNAME_MAX_ - 1)));
    c->size = offsetof(struct open_ev, path) + plen + klen;
    e->h.flags |= F_KNAME;
    // an open whose name as given was not hashed (a '..', a magic link, an unknown base) or that
    // writes is aggregated by the kernel's name, which is what user space names it by: the same
    // name is the same record whatever the name as given was (a read's name as given, hashed
    // already, keeps its token: its key has the inode, see settle)
    u32 run = e->h.run;
    u32 *lim = limits.lookup(&run);
    if (c->ev.h.kind == EV_OPEN && lim && *lim != 0 && klen > 1 && c->hskip != 3) {
        c->hbase = 0x6b6e616d65ULL;  // "kname": apart from the names as given
        c->hlen = klen - 1;
        c->hoff = plen;
        c->hskip = 0;
    }
}

// The kernel's name of what a call reached, then on_exit_hash (which hashes the name only if
// prepare_hash said to, and settles the call): a program of its own, so that the verifier walks
// neither the walk's loop once per path through the rest nor the rest once per way out of the loop.
int on_exit_name(struct sys_exit_ctx *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct call *c = inflight.lookup(&tid);
    if (!c || c->ev.h.kind == 0)
        return 0;
    c->walked = 1;
    kernel_name(c, c->ev.open.ret);
    exit_tail.call(ctx, 0);
    emit_call(c);  // only if on_exit_hash is not in exit_tail (the loader puts it there first)
    return 0;
}
