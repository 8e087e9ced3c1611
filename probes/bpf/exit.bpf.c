// ---- a paired call's exit and the results

static __always_inline void ns_exit(struct call *c);  // ---- namespaces and mounts
static __always_inline void exec_unpin(u32 tid);     // ---- exec check

// An open's or chdir's path that was not resident at entry, read again now the kernel paged it in.
static __always_inline void refetch_path(struct call *c) {
    struct open_ev *e = &c->ev.open;
    int n = bpf_probe_read_user_str(e->path, sizeof(e->path), (const char *)c->refetch);
    c->refetch = 0;
    if (n > 0) {
        e->h.flags &= ~F_FNAME_FAULT;
        if (n == sizeof(e->path))
            e->h.flags |= F_PATH_TRUNC;
        set_path_len(c, n);
    } else {
        e->path[0] = 0;
    }
}

// At exit: the result goes into the record, a path not resident at entry is read again, and the
// one record is emitted (or, for a key counted in `agg`, not).
static __always_inline int finish_call(struct sys_exit_ctx *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct call *c = inflight.lookup(&tid);
    if (!c || c->ev.h.kind == 0 || c->nr != ctx->nr)
        return 0;
    c->ev.open.ret = ctx->ret;
    if (ctx->ret >= 0) {  // a new descriptor: what it names, for the identity checks
        if (c->ev.h.kind == EV_OPEN)
            c->ev.open.rino = read_fd_inode((s32)ctx->ret);
        else if (c->ev.h.kind == EV_DUP)
            c->ev.dup.rino = read_fd_inode((s32)ctx->ret);
        else if (c->ev.h.kind == EV_CHDIR || c->ev.h.kind == EV_FCHDIR)
            c->ev.open.rino = read_cwd_inode();  // the directory it changed to
    }
    if (c->ev.h.kind == EV_NS)
        ns_exit(c);
    if (c->ev.h.kind == EV_CHANGE || c->ev.h.kind == EV_NS) {
        struct change_ev *ce = &c->ev.change;
        if (ce->h.flags & (F_FNAME_FAULT | F_PATH2_FAULT)) {  // not resident at entry: read again
            ce->h.flags &= ~(F_FNAME_FAULT | F_PATH2_FAULT | F_PATH_TRUNC | F_PATH2_TRUNC);
            read_change_paths(c, (const char *)c->refetch, (const char *)c->refetch2);
            c->mfd = -1;  // the names read now (either may differ from entry's) have no identity
            c->mfd2 = -1;
        }
        c->refetch = 0;
        c->refetch2 = 0;
        // a magic link's descriptor that names another file at exit than at entry: the change
        // may have reached either, so neither is named
        if (c->ev.h.kind == EV_CHANGE) {
            if (ce->mino && (c->mfd < 0 || read_fd_inode(c->mfd) != ce->mino))
                ce->mino = 0;
            if (ce->mino2 && (c->mfd2 < 0 || read_fd_inode(c->mfd2) != ce->mino2))
                ce->mino2 = 0;
            // the file a descriptor names: fchmod's, fchown's, or path 1's magic link (a directory,
            // one with a name below it, has none)
            ce->nlink = inode_nlink(ce->mino ? ce->mino : ce->len1 == 0 ? ce->dino : 0);
        }
    } else if (c->refetch) {
        refetch_path(c);
    }
    prepare_hash(c);
    u32 kind = c->ev.h.kind;
    u32 run = c->ev.h.run;
    u32 *lim = limits.lookup(&run);
    int full = !lim || *lim == 0;  // --detail full: every open is a record, named by the kernel
    // (hskip 2: a base the kernel cannot name: no token of the name as given, a record each time,
    // named by the kernel and aggregated by that name; else settle walks a key's first open)
    if (ctx->ret >= 0 && ((kind == EV_OPEN && (full || c->hskip == 2)) || kind == EV_CHDIR || kind == EV_FCHDIR))
        exit_tail.call(ctx, 1);  // on_exit_name: the kernel's name, then the hash and the record
    if (c->hskip == 0)
        exit_tail.call(ctx, 0);
    // no hash needed, or the tail call failed: without a token, a plain record
    c->htok = 0;
    return settle_and_emit(ctx, c);
}

// openat's exit, the one nearly every open takes: finish_call's way for an open, with the name's
// hash here rather than in on_exit_hash (a tail call, and the thread's call looked up again, saved
// on every open: this program has no other kind of call to verify the hash loop after). Anything
// else goes to on_exit (exit_tail 2).
int on_exit_openat(struct sys_exit_ctx *ctx) {
    char *task = (char *)bpf_get_current_task_btf();
    u32 tid = (u32)task_pid_tgid(task);
    struct call *c = inflight.lookup(&tid);
    if (!c || c->ev.h.kind == 0 || c->nr != ctx->nr)
        return 0;
    if (c->ev.h.kind != EV_OPEN) {
        exit_tail.call(ctx, 2);
        return 0;
    }
    c->ev.open.ret = ctx->ret;
    if (ctx->ret >= 0)  // the new descriptor: what it names, for the identity checks
        c->ev.open.rino = task_fd_inode(task, (s32)ctx->ret);
    if (c->refetch)
        refetch_path(c);
    prepare_hash(c);
    u32 run = c->ev.h.run;
    u32 *lim = limits.lookup(&run);
    if (ctx->ret >= 0 && (!lim || *lim == 0 || c->hskip == 2))
        exit_tail.call(ctx, 1);  // on_exit_name (as finish_call)
    hash_name(c);
    return settle_and_emit(ctx, c);
}

// ---- results -----------------------------------------------------------------------------

int on_exit(struct sys_exit_ctx *ctx) {
    switch (ctx->nr) {
    case __NR_execve:
    case __NR_execveat:
        // an exec that returns failed (or ran: its pin is taken already): its pin goes
        exec_unpin((u32)bpf_get_current_pid_tgid());
        return emit_ret(SC_EXEC, ctx->ret);
    }
    return finish_call(ctx);
}
