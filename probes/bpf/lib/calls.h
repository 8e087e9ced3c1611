// ---- calls paired in the kernel ----------------------------------------------------------

// Emits the thread's call record (with the result in it) and marks the slot free: 0 when sent.
static __always_inline int emit_call(struct call *c) {
    u64 size = c->size;
    u32 run = c->ev.h.run;
    u32 kind = c->ev.h.kind;
    int err = -1;
    barrier_var(size);
    if (size >= sizeof(struct hdr) && size <= sizeof(c->ev)) {
        barrier_var(size);
        err = events.ringbuf_output(&c->ev, size, wakeup_flags());
        if (err != 0)
            count_lost(run, kind);
    }
    c->ev.h.kind = 0;
    return err;
}

// The current thread's call slot, filled with a header for `kind`: NULL (counted as lost) when
// the map is full. A call still in flight there never returned (its thread was stopped by an
// exec, or the exit was not seen): it is emitted first with NO_RESULT, not dropped.
static __always_inline struct call *begin_call_as(u32 run, u16 kind, s32 nr, u64 cg, u64 id) {
    u32 tid = (u32)id;
    struct call *c = inflight.lookup(&tid);
    if (!c) {
        u32 zero = 0;
        struct call *z = call_zero.lookup(&zero);
        u32 *held = inflight_n.lookup(&run);
        if (!z || !held)
            return NULL;
        if (*held >= INFLIGHT_RUN_) {  // the run's share of the table is taken: its own loss
            count_lost(run, kind);
            return NULL;
        }
        inflight.update(&tid, z);
        c = inflight.lookup(&tid);
        if (!c) {
            count_lost(run, kind);
            return NULL;
        }
        __sync_fetch_and_add(held, 1);
        c->owner = run;
    } else if (c->ev.h.kind != 0) {
        c->ev.open.ret = NO_RESULT_;
        emit_call(c);
    }
    fill_as(&c->ev.h, run, kind, id, cg);
    c->ev.open.ret = NO_RESULT_;
    c->ev.open.exe = 0;
    c->ev.open.tok = 0;
    c->refetch = 0;
    c->refetch2 = 0;
    c->nr = nr;
    c->walked = 0;
    return c;
}

static __always_inline struct call *begin_call(u32 run, u16 kind, s32 nr) {
    return begin_call_as(run, kind, nr, bpf_get_current_cgroup_id(), bpf_get_current_pid_tgid());
}
