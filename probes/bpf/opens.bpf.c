// ---- opens -------------------------------------------------------------------------------

static __always_inline int enter_open(s32 nr, s32 dfd, const char *filename, u32 flags, u32 mode, u16 sc, u64 resolve) {
    char *task = (char *)bpf_get_current_task_btf();
    u64 cg = task_cgroup_id(task);
    u32 run = run_of(cg);
    if (!run)
        return 0;
    struct call *c = begin_call_as(run, EV_OPEN, nr, cg, task_pid_tgid(task));
    if (!c)
        return 0;
    struct open_ev *e = &c->ev.open;
    e->dfd = dfd;
    e->flags = flags;
    e->mode = mode;
    e->nlink = 0;
    e->sc = sc;
    e->rino = 0;
    read_path(c, filename);
    if (resolve & RESOLVE_IN_ROOT_)
        e->h.flags |= F_IN_ROOT;  // absolute names too are resolved below dfd (or the cwd)
    // a relative path (or one not read yet): what the dirfd, or the cwd, names now
    e->dino = e->path[0] == '/' && !(resolve & RESOLVE_IN_ROOT_) ? 0 : task_dir_inode(task, dfd);
    return 0;
}

// openat, the open almost every program makes, has a program of its own: its four arguments are
// read from the tracepoint's record directly, not through a helper each (arg_beyond)
int on_enter_openat(struct sys_enter_ctx *ctx) {
    return enter_open(ctx->nr, (s32)ctx->args[0], (const char *)ctx->args[1], (u32)ctx->args[2], (u32)ctx->args[3], 0, 0);
}

int on_enter_open(struct sys_enter_ctx *ctx) {
    switch (ctx->nr) {
    // attached to openat2 (4 arguments), open (3) and creat (2)
    case __NR_openat2: {
        u64 how[3] = {};  // struct open_how: flags, mode, resolve
        bpf_probe_read_user(how, sizeof(how), (void *)arg_beyond(ctx, 2));
        return enter_open(ctx->nr, (s32)ctx->args[0], (const char *)ctx->args[1], (u32)how[0], (u32)how[1], 1, how[2]);
    }
#ifdef __NR_open
    case __NR_open:
        return enter_open(ctx->nr, -100, (const char *)ctx->args[0], (u32)ctx->args[1], (u32)arg_beyond(ctx, 2), 2, 0);
#endif
#ifdef __NR_creat
    case __NR_creat:
        // creat(path, mode) == open(path, O_CREAT|O_WRONLY|O_TRUNC, mode)
        return enter_open(ctx->nr, -100, (const char *)ctx->args[0], 01 | 0100 | 01000, (u32)ctx->args[1], 3, 0);
#endif
    }
    return 0;
}
