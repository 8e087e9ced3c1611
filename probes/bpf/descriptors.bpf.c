// ---- cwd and descriptors (for resolving relative paths and dirfds) -----------------------

int on_enter_chdir(struct sys_enter_ctx *ctx) {
    u32 run = current_run();
    if (!run)
        return 0;
    struct call *c = begin_call(run, EV_CHDIR, ctx->nr);
    if (!c)
        return 0;
    struct open_ev *e = &c->ev.open;
    e->dfd = -100;
    e->flags = 0;
    e->mode = 0;
    e->nlink = 0;
    e->sc = 0;
    e->rino = 0;
    read_path(c, (const char *)ctx->args[0]);
    e->dino = e->path[0] == '/' ? 0 : cwd_inode();  // what a relative path is resolved against
    return 0;
}

int on_enter_fchdir(struct sys_enter_ctx *ctx) {
    u32 run = current_run();
    if (!run)
        return 0;
    struct call *c = begin_call(run, EV_FCHDIR, ctx->nr);
    if (!c)
        return 0;
    struct open_ev *e = &c->ev.open;
    e->dfd = (s32)ctx->args[0];
    e->flags = 0;
    e->mode = 0;
    e->nlink = 0;
    e->sc = 0;
    e->dino = fd_inode(e->dfd);  // the directory it changes to (checked like a dirfd)
    e->rino = 0;
    e->path_len = 0;
    c->size = offsetof(struct open_ev, path);
    return 0;
}

static __always_inline int enter_dup(s32 nr, s32 oldfd, s32 newfd) {
    u32 run = current_run();
    if (!run)
        return 0;
    struct call *c = begin_call(run, EV_DUP, nr);
    if (!c)
        return 0;
    c->ev.dup.oldfd = oldfd;
    c->ev.dup.newfd = newfd;
    c->ev.dup.rino = 0;
    c->size = sizeof(struct dup_ev);
    return 0;
}

int on_enter_dup(struct sys_enter_ctx *ctx) {
    // attached to dup (1 argument), dup2 (2) and dup3 (3)
    if (ctx->nr == __NR_dup)
        return enter_dup(ctx->nr, (s32)ctx->args[0], -1);
    return enter_dup(ctx->nr, (s32)ctx->args[0], (s32)arg_beyond(ctx, 1));
}
