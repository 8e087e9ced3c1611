// ---- a task's run, a record's header, the ring buffer

// The run slot of cgroup `cg`: its cached answer, else its outermost tracked ancestor's (0: none),
// cached. One walk for both kinds of program: skb NULL (a constant in a tracepoint program, whose
// inlined copy keeps that branch only) walks the current task's ancestors; a packet's walks its
// socket's (cgroup skb programs, where skb, the context, is never NULL and the verifier follows
// only that branch).
static __always_inline u32 cgroup_run(u64 cg, struct __sk_buff *skb) {
    u32 *hit = cgcache.lookup(&cg);
    if (hit)
        return *hit;
    u32 run = 0;
#pragma clang loop unroll(disable)
    for (int lvl = 0; lvl < CG_DEPTH_; lvl++) {
        u64 anc = skb ? bpf_skb_ancestor_cgroup_id(skb, lvl) : bpf_get_current_ancestor_cgroup_id(lvl);
        if (anc == 0)
            break;
        u32 *r = tracked.lookup(&anc);
        if (r) {
            run = *r;  // outermost tracked ancestor wins: a nested run cannot hide from its parent
            break;
        }
    }
    cgcache.update(&cg, &run);
    return run;
}

// The run slot of a task in cgroup `cg` (the current one).
static __always_inline u32 run_of(u64 cg) {
    return cgroup_run(cg, NULL);
}

static __always_inline u32 current_run(void) {
    return run_of(bpf_get_current_cgroup_id());
}

static __always_inline void count_lost(u32 run, u32 kind) {
    u32 idx = run * EV_KINDS + kind;
    u64 *c = lost.lookup(&idx);
    if (c)
        __sync_fetch_and_add(c, 1);
}

// The header of a record of the current thread (id: bpf_get_current_pid_tgid, cg: its cgroup id).
static __always_inline void fill_as(struct hdr *h, u32 run, u16 kind, u64 id, u64 cg) {
    h->ts = bpf_ktime_get_ns();
    h->cgid = cg;
    h->run = run;
    h->tgid = id >> 32;
    h->tid = (u32)id;
    h->kind = kind;
    u32 tgid = id >> 32;
    u32 zero = 0;
    u64 *marks = nslive.lookup(&zero);
    h->flags = marks && *marks && nsmark.lookup(&tgid) ? F_OTHER_NS : 0;
}

static __always_inline void fill(struct hdr *h, u32 run, u16 kind) {
    fill_as(h, run, kind, bpf_get_current_pid_tgid(), bpf_get_current_cgroup_id());
}

// Wake the consumer once every WAKEUP_EVERY records per CPU, not for each one; it also polls
// on a short timer, so a quiet run's last records are read within one poll interval.
static __always_inline u64 wakeup_flags(void) {
    u32 zero = 0;
    u32 *n = wake_ctr.lookup(&zero);
    if (!n)
        return 0;
    *n += 1;
    return (*n % WAKEUP_EVERY) == 0 ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
}

static __always_inline int emit(void *data, u64 size, u32 run, u32 kind) {
    if (events.ringbuf_output(data, size, wakeup_flags()) != 0)
        count_lost(run, kind);
    return 0;
}

// exec's result (its enter record and sched_process_exec's are separate; user space pairs them).
static __always_inline int emit_ret(u32 sc, s64 ret) {
    u32 run = current_run();
    if (!run)
        return 0;
    struct ret_ev *e = events.ringbuf_reserve(sizeof(struct ret_ev));
    if (!e) {
        count_lost(run, EV_RET);
        return 0;
    }
    fill(&e->h, run, EV_RET);
    e->sc = sc;
    e->pad = 0;
    e->ret = ret;
    events.ringbuf_submit(e, wakeup_flags());
    return 0;
}

// The link count of the inode at `inode` (an address, as fd_inode reads it), 0 for none or a
// directory (whose count is its subdirectories'): a write to a file with other names writes what
// they name too (a hard link made in an earlier run, in /tmp, to a file outside the workspace), so
// write opens and changes that name a file by a descriptor carry it (lint EV004). Two helper calls:
// only for records, never for a repeat counted in `agg`, nor for a read.
static __always_inline u16 inode_nlink(u64 inode) {
    u16 mode = 0;
    u32 n = 0;
    if (!inode)
        return 0;
    bpf_probe_read_kernel(&mode, sizeof(mode), (void *)(inode + INODE_MODE_OFF));
    if ((mode & 0170000) == 0040000)
        return 0;
    bpf_probe_read_kernel(&n, sizeof(n), (void *)(inode + INODE_NLINK_OFF));
    return n > 0xffff ? 0xffff : n;
}

#define WRITE_BITS_ (03 | 01000)  // O_ACCMODE and O_TRUNC: an open that writes, ...
#define O_PATH_ 010000000         // ... unless O_PATH (its other flags are ignored)
