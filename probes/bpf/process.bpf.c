static __always_inline void ns_fork(u32 run, u32 child);  // ---- namespaces and mounts

// ---- process lifetime --------------------------------------------------------------------

RAW_TRACEPOINT_PROBE(sched_process_fork) {
    u32 run = current_run();
    if (!run)
        return 0;
    void *child = (void *)ctx->args[1];
    s32 pid = 0, tgid = 0;
    bpf_probe_read_kernel(&pid, sizeof(pid), child + TASK_PID_OFF);
    bpf_probe_read_kernel(&tgid, sizeof(tgid), child + TASK_TGID_OFF);
    if (pid != tgid)
        return 0;  // a new thread, not a new process
    ns_fork(run, tgid);
    struct pctx *pp = proc_ctx(bpf_get_current_pid_tgid() >> 32);
    if (pp) {  // the child runs the same program in the same cwd; its descriptors are its own
        struct pctx child = {.gen = random_token(), .exe = pp->exe, .cwd = pp->cwd, .cwd_ino = pp->cwd_ino};
        u32 ct = tgid;
        procs.update(&ct, &child);
    }
    struct fork_ev *e = events.ringbuf_reserve(sizeof(struct fork_ev));
    if (!e) {
        count_lost(run, EV_FORK);
        return 0;
    }
    fill(&e->h, run, EV_FORK);
    e->child_tgid = tgid;
    e->pad = 0;
    events.ringbuf_submit(e, wakeup_flags());
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct call *c = inflight.lookup(&tid);
    if (c) {
        if (c->ev.h.kind != 0)
            emit_call(c);  // a call that never returned: recorded with NO_RESULT, not dropped
        u32 owner = c->owner;
        u32 *held = inflight_n.lookup(&owner);
        if (held && *held > 0)  // (0: the slot was given to a new run since)
            __sync_fetch_and_add(held, -1);
        inflight.delete(&tid);
    }
    exec_unpin(tid);  // ---- exec check: a pin of an exec that never came
#ifdef HAVE_GROUP_DEAD
    if (!args->group_dead)
        return 0;
#else
    u64 id = bpf_get_current_pid_tgid();
    if ((u32)id != (id >> 32))
        return 0;
#endif
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    procs.delete(&tgid);
    if (nsmark.delete(&tgid) == 0) {
        u32 zero = 0;
        u64 *marks = nslive.lookup(&zero);
        if (marks)
            __sync_fetch_and_add(marks, -1);
    }
    u32 run = current_run();
    if (!run)
        return 0;
    struct exit_ev *e = events.ringbuf_reserve(sizeof(struct exit_ev));
    if (!e) {
        count_lost(run, EV_EXIT);
        return 0;
    }
    fill(&e->h, run, EV_EXIT);
    void *task = (void *)bpf_get_current_task();
    s32 code = 0;
    bpf_probe_read_kernel(&code, sizeof(code), (void *)task + TASK_EXIT_CODE_OFF);
    e->exit_code = code;
    e->pad = 0;
    // exits are rare and end a run's last process: always wake the consumer
    events.ringbuf_submit(e, BPF_RB_FORCE_WAKEUP);
    return 0;
}
