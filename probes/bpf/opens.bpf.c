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
    // attached to openat2 (4 arguments), open (3) and creat (2); the call's operands, then one
    // enter_open (written once: the verifier walks it once)
    s32 dfd = -100;
    const char *filename = (const char *)ctx->args[0];
    u32 flags, mode;
    u16 sc;
    u64 resolve = 0;
    switch (ctx->nr) {
    case __NR_openat2: {
        u64 how[3] = {};  // struct open_how: flags, mode, resolve
        bpf_probe_read_user(how, sizeof(how), (void *)arg_beyond(ctx, 2));
        dfd = (s32)ctx->args[0];
        filename = (const char *)ctx->args[1];
        flags = (u32)how[0];
        mode = (u32)how[1];
        resolve = how[2];
        sc = 1;
        break;
    }
#ifdef __NR_open
    case __NR_open:
        flags = (u32)ctx->args[1];
        mode = (u32)arg_beyond(ctx, 2);
        sc = 2;
        break;
#endif
#ifdef __NR_creat
    case __NR_creat:
        // creat(path, mode) == open(path, O_CREAT|O_WRONLY|O_TRUNC, mode)
        flags = 01 | 0100 | 01000;
        mode = (u32)ctx->args[1];
        sc = 3;
        break;
#endif
    default:
        return 0;
    }
    return enter_open(ctx->nr, dfd, filename, flags, mode, sc, resolve);
}
