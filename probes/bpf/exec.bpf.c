// ---- exec --------------------------------------------------------------------------------

// Appends the NUL-separated argv at buf[off..]: returns the number of bytes written. The offset
// goes through the record (a map value) on each turn, as kernel_name's does: the verifier then sees
// an unknown number (each use is masked), not a range per turn and per way out of the loop, and
// the ways out meet in one state it walks once.
static __always_inline u32 read_argv(struct exec_ev *e, const char *const *argv) {
    u32 start = *(volatile u16 *)&e->fname_len & (PATH_MAX_ - 1);
    *(volatile u16 *)&e->args_len = start;
#pragma clang loop unroll(disable)
    for (int i = 0; i < MAXARG_; i++) {
        const char *arg = NULL;
        if (bpf_probe_read_user(&arg, sizeof(arg), &argv[i]) != 0) {
            e->h.flags |= F_ARGS_FAULT;
            break;
        }
        if (!arg)
            break;
        e->argc = i + 1;
        u32 off = *(volatile u16 *)&e->args_len;
        // what is left of argv's ARGS_MAX_ - 1 bytes (off never precedes start: the mask only
        // bounds it for the verifier, with no branch that would make two states of each turn)
        u32 room = start + ARGS_MAX_ - 1 - off;
        barrier_var(room);
        room &= ARGS_MAX_ - 1;
        if (room <= 1 || off >= PATH_MAX_ + ARGS_MAX_) {
            e->h.flags |= F_ARGS_TRUNC;
            break;
        }
        u32 pos = off;
        barrier_var(pos);
        pos &= BUF_MASK;
        int n = bpf_probe_read_user_str(&e->buf[pos], room, arg);
        if (n < 0) {
            e->h.flags |= F_ARGS_FAULT;
            break;
        }
        *(volatile u16 *)&e->args_len = off + n;
        if ((u32)n >= room) {
            e->h.flags |= F_ARGS_TRUNC;
            break;
        }
        if (i == MAXARG_ - 1) {
            // check whether more arguments were given than we read
            const char *more = NULL;
            bpf_probe_read_user(&more, sizeof(more), &argv[i + 1]);
            if (more)
                e->h.flags |= F_ARGS_TRUNC;
        }
    }
    u32 end = *(volatile u16 *)&e->args_len;
    return end > start ? end - start : 0;
}

static __always_inline int emit_exec(s32 dfd, const char *filename, const char *const *argv, u32 at_flags) {
    u32 run = current_run();
    if (!run)
        return 0;
    u32 zero = 0;
    struct exec_ev *e = scratch_exec.lookup(&zero);
    if (!e)
        return 0;
    fill(&e->h, run, EV_EXEC);
    e->dfd = dfd;
    e->at_flags = at_flags;
    e->old_tid = 0;
    e->argc = 0;
    e->dev = 0;  // the file is known once the exec succeeded (EV_EXEC_OK)
    e->ino = 0;
    e->size = 0;
    e->ctime_sec = 0;
    e->ctime_nsec = 0;
    int n = bpf_probe_read_user_str(e->buf, PATH_MAX_, filename);
    if (n < 0) {
        n = 1;
        e->buf[0] = 0;
        e->h.flags |= F_FNAME_FAULT;
    } else if (n == PATH_MAX_) {
        e->h.flags |= F_PATH_TRUNC;
    }
    e->fname_len = n;
    e->pad = 0;
    // a relative name: what dfd (execveat), or the cwd, names now
    e->dino = e->buf[0] == '/' ? 0 : read_dir_inode(dfd);
    // from here on the name's length is read back from the record: every way here is one state
    u32 alen = read_argv(e, argv);
    e->args_len = alen;
    u64 size = offsetof(struct exec_ev, buf) + ((*(volatile u16 *)&e->fname_len + alen) & BUF_MASK);
    return emit(e, size, run, EV_EXEC);
}

int on_enter_exec(struct sys_enter_ctx *ctx) {
    // attached to execve (3 arguments) and execveat (5); emit_exec written once (not once per
    // call: the verifier walked its argv loop twice, 0.15 s of every start)
    int at = ctx->nr == __NR_execveat;
    s32 dfd = at ? (s32)ctx->args[0] : -100;
    const char *filename = (const char *)(at ? ctx->args[1] : ctx->args[0]);
    const char *const *argv = (const char *const *)(at ? ctx->args[2] : ctx->args[1]);
    u32 at_flags = at ? (u32)arg_beyond(ctx, 4) : 0;
    return emit_exec(dfd, filename, argv, at_flags);
}

// A successful exec: the new image's filename and its argv, read from the new mm's argument
// area (already in memory, so never "(fault)"), with offsets from BTF.
TRACEPOINT_PROBE(sched, sched_process_exec) {
    u32 run = current_run();
    if (!run)
        return 0;
    u32 zero = 0;
    struct exec_ev *e = scratch_exec.lookup(&zero);
    if (!e)
        return 0;
    fill(&e->h, run, EV_EXEC_OK);
    e->dfd = 0;
    e->at_flags = 0;
    e->old_tid = args->old_pid;
    e->argc = 0;
    e->pad = 0;
    e->dino = 0;
    unsigned short loc = args->data_loc_filename & 0xFFFF;
    int n = bpf_probe_read_kernel_str(e->buf, PATH_MAX_, (void *)args + loc);
    if (n < 0) {
        n = 1;
        e->buf[0] = 0;
        e->h.flags |= F_FNAME_FAULT;
    }
    e->fname_len = n;
    void *task = (void *)bpf_get_current_task();
    void *mm = NULL;
    u64 start = 0, end = 0;
    bpf_probe_read_kernel(&mm, sizeof(mm), (void *)task + TASK_MM_OFF);
    e->dev = 0;
    e->ino = 0;
    e->size = 0;
    e->ctime_sec = 0;
    e->ctime_nsec = 0;
    if (mm) {
        bpf_probe_read_kernel(&start, sizeof(start), mm + MM_ARG_START_OFF);
        bpf_probe_read_kernel(&end, sizeof(end), mm + MM_ARG_END_OFF);
        void *file = NULL, *inode = NULL, *sb = NULL;
        bpf_probe_read_kernel(&file, sizeof(file), mm + MM_EXE_FILE_OFF);
        if (file)
            bpf_probe_read_kernel(&inode, sizeof(inode), file + FILE_INODE_OFF);
        if (inode) {
            bpf_probe_read_kernel(&e->ino, sizeof(e->ino), inode + INODE_INO_OFF);
            bpf_probe_read_kernel(&e->size, sizeof(e->size), inode + INODE_SIZE_OFF);
            bpf_probe_read_kernel(&e->ctime_sec, sizeof(e->ctime_sec), inode + INODE_CTIME_SEC_OFF);
            bpf_probe_read_kernel(&e->ctime_nsec, sizeof(e->ctime_nsec), inode + INODE_CTIME_NSEC_OFF);
            bpf_probe_read_kernel(&sb, sizeof(sb), inode + INODE_SB_OFF);
            if (sb)
                bpf_probe_read_kernel(&e->dev, sizeof(e->dev), sb + SB_DEV_OFF);
        }
    }
    u64 len = end > start ? end - start : 0;
    if (len >= ARGS_MAX_) {
        len = ARGS_MAX_ - 1;
        e->h.flags |= F_ARGS_TRUNC;
    }
    // the name's length is read back from the record: every way here is one state for the verifier
    u32 off = *(volatile u16 *)&e->fname_len & (PATH_MAX_ - 1);
    len &= (ARGS_MAX_ - 1);
    if (len > 0 && bpf_probe_read_user(&e->buf[off & BUF_MASK], len, (void *)start) != 0) {
        len = 0;
        e->h.flags |= F_ARGS_FAULT;
    }
    e->args_len = len;
    // the program's token: its name when absolute (equal names, equal programs), else random
    struct pctx *p = proc_ctx(e->h.tgid);
    if (p) {
        u64 t = 0;
        u32 fl = *(volatile u16 *)&e->fname_len;
        if (e->buf[0] == '/' && fl > 1) {
            e->pad = (fl - 1) & (PATH_MAX_ - 1);  // the name's length, where name_token reads it
            t = name_token(0, e->buf, &e->pad);
            e->pad = 0;
        }
        p->exe = t ? t : random_token();
    }
    u64 size = offsetof(struct exec_ev, buf) + ((off + len) & BUF_MASK);
    return emit(e, size, run, EV_EXEC_OK);
}
