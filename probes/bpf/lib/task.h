// ---- BTF task loads: what a descriptor, the cwd and a dirfd name, the task's ids, their tokens

static __always_inline u64 fd_key(u32 tgid, s32 fd) {
    return ((u64)tgid << 32) | (u32)fd;
}

// What descriptor fd of the current process names now: the address of its file's struct inode
// (task->files->fdt->fd[fd]->f_inode, offsets from BTF), 0 when fd is not open. Stable while the
// inode lives, equal for every open of the same file, different for another file: the identity
// that tells a descriptor the tables know from one put at its number unseen (F_DUPFD, SCM_RIGHTS,
// pidfd_getfd, a table shared by CLONE_FILES: close is not a record). It costs an open's exit two
// helper calls: the task, its files and its fdtable are BTF pointers (bpf_get_current_task_btf),
// loaded directly (the verifier checks each load against the kernel's BTF at that offset, and a
// NULL pointer reads as 0); the array's slot and the file's f_inode are read with the helper.
static __always_inline u64 task_fd_file(char *task, s32 fd) {
    if (fd < 0)
        return 0;
    char *files = *(char **)(task + TASK_FILES_OFF);
    if (!files)
        return 0;
    char *fdt = *(char **)(files + FILES_FDT_OFF);
    if (!fdt)
        return 0;
    u32 max = *(u32 *)(fdt + FDT_MAX_FDS_OFF);
    u64 arr = *(u64 *)(fdt + FDT_FD_OFF);
    if ((u32)fd >= max || !arr)
        return 0;
    u64 file = 0;
    bpf_probe_read_kernel(&file, sizeof(file), (void *)(arr + (u64)(u32)fd * 8));
    return file;
}

static __always_inline u64 task_fd_inode(char *task, s32 fd) {
    u64 file = task_fd_file(task, fd), inode = 0;
    if (!file)
        return 0;
    bpf_probe_read_kernel(&inode, sizeof(inode), (void *)(file + FILE_INODE_OFF));
    return inode;
}

static __always_inline u64 fd_file(s32 fd) {
    return task_fd_file((char *)bpf_get_current_task_btf(), fd);
}

static __always_inline u64 fd_inode(s32 fd) {
    return task_fd_inode((char *)bpf_get_current_task_btf(), fd);
}

// The same walks read with the helper, for the calls that are not an open's (changes, namespace
// calls, execs, connects, DNS). Each direct load of a pointer from the task (a trusted BTF pointer)
// makes the verifier look its type up by name in the kernel's BTF, four times, a linear search:
// about 0.5 ms a load for each state that reaches it, a tenth of a second of every start for the
// cold programs. Read with bpf_probe_read_kernel, they cost three or four helper calls more at run
// time (about 30 ns each here), paid by rare calls only.
// A NULL on the way reads as 0 (the helper fails on the first page, leaving 0): no branch for it.
static __always_inline u64 read_ptr(u64 addr) {
    u64 v = 0;
    bpf_probe_read_kernel(&v, sizeof(v), (void *)addr);
    return v;
}

static __always_inline u64 read_fd_file(s32 fd) {
    u64 fdt = read_ptr(read_ptr(bpf_get_current_task() + TASK_FILES_OFF) + FILES_FDT_OFF);
    u32 max = 0;
    bpf_probe_read_kernel(&max, sizeof(max), (void *)(fdt + FDT_MAX_FDS_OFF));
    if ((u32)fd >= max)  // a negative fd too
        return 0;
    return read_ptr(read_ptr(fdt + FDT_FD_OFF) + (u64)(u32)fd * 8);
}

static __always_inline u64 read_fd_inode(s32 fd) {
    return read_ptr(read_fd_file(fd) + FILE_INODE_OFF);
}

static __always_inline u64 read_cwd_inode(void) {
    u64 fs = read_ptr(bpf_get_current_task() + TASK_FS_OFF);
    return read_ptr(read_ptr(fs + FS_PWD_OFF + PATH_DENTRY_OFF) + DENTRY_INODE_OFF);
}

static __always_inline u64 read_dir_inode(s32 dfd) {
    return dfd == -100 ? read_cwd_inode() : read_fd_inode(dfd);
}

// What bpf_get_current_pid_tgid and bpf_get_current_cgroup_id return, loaded from the current
// task (bpf_get_current_task_btf: a BTF pointer, offsets from BTF) instead: on this kernel a
// helper call costs about 30 ns whatever it does, and openat's programs need the task anyway.
// The cgroup is the task's on the default (v2) hierarchy: task->cgroups->dfl_cgrp->kn->id, as
// the helper reads it (under the RCU read lock a tracepoint program runs in). None of the
// pointers is NULL for a live task (the verifier treats them as RCU-trusted); the checks only
// keep a 0 from being read as an address.
static __always_inline u64 task_pid_tgid(char *task) {
    return ((u64)*(u32 *)(task + TASK_TGID_OFF) << 32) | *(u32 *)(task + TASK_PID_OFF);
}

static __always_inline u64 task_cgroup_id(char *task) {
    char *cset = *(char **)(task + TASK_CGROUPS_OFF);
    if (!cset)
        return 0;
    char *cgrp = *(char **)(cset + CSS_SET_DFL_CGRP_OFF);
    if (!cgrp)
        return 0;
    char *kn = *(char **)(cgrp + CGROUP_KN_OFF);
    if (!kn)
        return 0;
    return *(u64 *)(kn + KERNFS_NODE_ID_OFF);
}

// The current thread's working directory: the address of its struct inode
// (task->fs->pwd.dentry->d_inode, offsets from BTF), 0 when not known. A cwd is per thread and
// can change without a chdir of this process being seen: one shared by clone(CLONE_FS) follows
// the other process's chdir, a thread's unshare(CLONE_FS) makes it its own, and another thread's
// chdir can land while a call is in flight. Relative names carry it (dino, read at entry) like a
// dirfd's identity, and the cwd's token is used only while it stands for that directory.
static __always_inline u64 task_cwd_inode(char *task) {
    char *fs = *(char **)(task + TASK_FS_OFF);
    if (!fs)
        return 0;
    char *dentry = *(char **)(fs + FS_PWD_OFF + PATH_DENTRY_OFF);
    if (!dentry)
        return 0;
    return *(u64 *)(dentry + DENTRY_INODE_OFF);  // a BTF pointer too: loaded directly
}

static __always_inline u64 cwd_inode(void) {
    return task_cwd_inode((char *)bpf_get_current_task_btf());
}

// What a name given relative to dfd is resolved against, now: the cwd (AT_FDCWD) or the dirfd.
static __always_inline u64 task_dir_inode(char *task, s32 dfd) {
    return dfd == -100 ? task_cwd_inode(task) : task_fd_inode(task, dfd);
}

static __always_inline u64 dir_inode(s32 dfd) {
    return task_dir_inode((char *)bpf_get_current_task_btf(), dfd);
}

// The token of what descriptor fd names, 0 when unknown: the kernel set one, and fd names now
// (ino, from fd_inode) what it named then.
static __always_inline u64 fd_token(struct pctx *p, u32 tgid, s32 fd, u64 ino) {
    u64 k = fd_key(tgid, fd);
    struct fdtok *t = fds.lookup(&k);
    if (!t || t->gen != p->gen || ino == 0 || t->ino != ino)
        return 0;
    return t->tok;
}

static __always_inline void set_fd_token(struct pctx *p, u32 tgid, s32 fd, u64 tok, u64 ino) {
    u64 k = fd_key(tgid, fd);
    if (tok == 0) {
        fds.delete(&k);
        return;
    }
    struct fdtok t = {.gen = p->gen, .tok = tok, .ino = ino};
    fds.update(&k, &t);
}

// The cwd's token for a name resolved against the directory `ino` (cwd_inode at the call's entry),
// 0 when the kernel cannot name it. A process's first relative name ties its token to the
// directory; a cwd changed unseen (CLONE_FS, unshare) gets a new token for its new directory, once
// it holds still; one that changed while the call was in flight leaves the call unknown.
static __always_inline u64 cwd_base(struct pctx *p, u64 ino) {
    if (ino == 0 || ino == p->cwd_ino)
        return p->cwd;
    if (p->cwd_ino == 0) {
        p->cwd_ino = ino;
        return p->cwd;
    }
    if (cwd_inode() != ino)
        return 0;
    p->cwd = random_token();
    p->cwd_ino = ino;
    return p->cwd;
}

// What the path of an open/chdir record is resolved against: 0 for an absolute path, the cwd's or
// the dirfd's token, or 0 with *unknown = 1 when the kernel cannot name it (user space resolves it
// from its own tables). An unreadable path gets base 1 and no bytes: one fixed token. The
// process's tokens are looked up for a relative name only (*unknown = 2 when they cannot be had).
static __always_inline u64 path_base(struct open_ev *e, u32 *len, int *unknown) {
    if (e->h.flags & F_FNAME_FAULT) {
        *len = 0;
        return 1;
    }
    *len = e->path_len > 0 ? e->path_len - 1 : 0;  // without the NUL
    if (e->path[0] == '/' && !(e->h.flags & F_IN_ROOT))
        return 0;
    struct pctx *p = proc_ctx(e->h.tgid);
    if (!p) {
        *unknown = 2;
        return 0;
    }
    u64 base = e->dfd == -100 ? cwd_base(p, e->dino) : fd_token(p, e->h.tgid, e->dfd, e->dino);
    if (base == 0)
        *unknown = 1;
    return base;
}
