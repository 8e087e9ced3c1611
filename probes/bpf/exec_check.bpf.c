// ---- exec check: what the kernel loaded against what the supervisor decided (issue 24) -------
//
// A run whose command rules are enforced has its execs decided by a supervisor (seccomp user
// notification) before they run; one it lets go on (SECCOMP_USER_NOTIF_FLAG_CONTINUE) reads the
// path and argv from the caller's memory again, and another thread of the caller may have rewritten
// them since. So the supervisor pins, for the calling thread, the file the exec must load and a
// keyed hash of the arguments it must copy (`exec_pins`, struct exec_pin: probes/abi.py exec_pin
// is the reference), and this program, at sched_process_exec, compares them with what the kernel
// did load (mm->exe_file: s_dev, i_ino) and copy (the new image's arg area, mm->arg_start ..
// arg_end, all of it up to EXEC_ARGS_MAX_). The pin of the thread that called exec (old_pid) is
// taken (one pin, one exec); none, or any difference, and the process gets SIGKILL
// (bpf_send_signal: delivered before the new image's first instruction) and a violation record.
// An exec the supervisor refused never gets here; one it never saw (a 32-bit entry is refused
// by the compat filter anyway) has no pin and is killed.
//
// A raw tracepoint, attached by the loader when a run first asks for the check: runs without
// command rules pay nothing (no program), and its recursion guard is its own, not the one
// tracepoint programs share (a tracepoint program is skipped while another runs on the CPU: this
// one must not be). The hash is exec_hash_more's, EXEC_CHUNK_ bytes per run, the next chunk in a tail
// call of itself, its state in a per-CPU map (a tracepoint runs with preemption off).

// thread id -> its decided exec (written by user space; allocated on demand: a recorder whose runs
// have no command rules holds none)
BPF_F_TABLE("hash", u32, struct exec_pin, exec_pins, EXEC_PINS_MAX_, BPF_F_NO_PREALLOC);
BPF_ARRAY(exec_guard, struct exec_guard, MAX_RUNS_);         // per run slot: checked? and the key
BPF_ARRAY(exec_guarded, u64, 1);  // run slots checked: while 0, a thread's exit has no pin to drop
BPF_PROG_ARRAY(exec_tail, 1);     // exec_hash_more

struct exec_hash {
    u64 v0, v1, v2, v3;  // SipHash-2-4's state
    u64 start;           // the arg area's address in the new image
    u32 len;             // its length
    u32 pos;             // bytes hashed
    struct exec_violation_ev ev;  // the record, should it be one
    u8 buf[EXEC_CHUNK_ + 8];      // the chunk being hashed (+ 8: the last word is read whole)
};
BPF_PERCPU_ARRAY(exec_scratch, struct exec_hash, 1);

// A thread's pin, dropped when its exec returned (it failed: the supervisor pins its next exec
// again) or it exited: pins are only ever those of execs under way, so a job cannot fill the map
// with pins of execs it made fail. Free while no run is checked.
static __always_inline void exec_unpin(u32 tid) {
    u32 zero = 0;
    u64 *guarded = exec_guarded.lookup(&zero);
    if (guarded && *guarded)
        exec_pins.delete(&tid);
}

#define SIPROUND24                                                              \
    do {                                                                        \
        v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32);               \
        v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                                  \
        v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                                  \
        v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32);               \
    } while (0)

// The exec is not what was decided: kill the process (SIGKILL to current, the exec's task: it dies
// on its way back to user space) and record why.
static __always_inline int exec_refuse(struct exec_hash *s) {
    struct exec_violation_ev *e = &s->ev;
    e->kill = bpf_send_signal(9);
    // rare, and it ends a process of the run: always wake the consumer
    if (events.ringbuf_output(e, sizeof(*e), BPF_RB_FORCE_WAKEUP) != 0)
        count_lost(e->h.run, EV_EXEC_VIOLATION);
    return 0;
}

// Hash the next chunk of the arg area; the chunk after it in a tail call, or, at the end, compare.
static __always_inline int exec_hash_step(void *ctx, struct exec_hash *s) {
    u32 n = s->len - s->pos;
    if (n > EXEC_CHUNK_)
        n = EXEC_CHUNK_;
    barrier_var(n);  // bounds the verifier can follow: masked, then compared
    n &= 2 * EXEC_CHUNK_ - 1;
    if (n > EXEC_CHUNK_)
        return exec_refuse(s);
    if (bpf_probe_read_user(s->buf, n, (void *)(s->start + s->pos)) != 0) {
        s->ev.reason |= XV_UNREAD;
        return exec_refuse(s);
    }
    u64 v0 = s->v0, v1 = s->v1, v2 = s->v2, v3 = s->v3;
    u32 words = n / 8;
#pragma clang loop unroll(disable)
    for (u32 i = 0; i < EXEC_CHUNK_ / 8; i++) {
        if (i >= words)
            break;
        u64 m = *(u64 *)(s->buf + i * 8);
        v3 ^= m;
        SIPROUND24;
        SIPROUND24;
        v0 ^= m;
    }
    s->v0 = v0; s->v1 = v1; s->v2 = v2; s->v3 = v3;
    s->pos += n;
    if (s->pos < s->len) {
        exec_tail.call(ctx, 0);
        s->ev.reason |= XV_UNREAD;  // the tail call failed: not hashed, not allowed
        return exec_refuse(s);
    }
    u32 rem = n & 7;
    u64 last = 0;
    if (rem)  // the last bytes; past n is whatever an earlier chunk left: masked off
        last = *(u64 *)(s->buf + (n & (EXEC_CHUNK_ - 8))) & ((1ULL << (rem * 8)) - 1);
    last |= (u64)s->len << 56;
    v3 ^= last;
    SIPROUND24;
    SIPROUND24;
    v0 ^= last;
    v2 ^= 0xff;
    SIPROUND24;
    SIPROUND24;
    SIPROUND24;
    SIPROUND24;
    u64 h = v0 ^ v1 ^ v2 ^ v3;
    s->ev.argv_hash = h;
    if (!(s->ev.reason & XV_NO_PIN) && h != s->ev.want_hash)
        s->ev.reason |= XV_ARGS;
    if (s->ev.reason)
        return exec_refuse(s);
    return 0;  // as decided
}

// sched_process_exec(struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm)
int exec_check(struct bpf_raw_tracepoint_args *ctx) {
    u32 run = current_run();
    if (!run)
        return 0;
    struct exec_guard *g = exec_guard.lookup(&run);
    if (!g || !g->on)
        return 0;
    u32 zero = 0;
    struct exec_hash *s = exec_scratch.lookup(&zero);
    if (!s) {  // never (a per-CPU array's one entry): still no exec past the check
        bpf_send_signal(9);
        count_lost(run, EV_EXEC_VIOLATION);
        return 0;
    }
    struct exec_violation_ev *e = &s->ev;
    fill(&e->h, run, EV_EXEC_VIOLATION);
    e->old_tid = (u32)ctx->args[1];
    e->reason = 0;
    e->ino = 0;
    e->dev = 0;
    e->argv_hash = 0;
    e->want_ino = 0;
    e->want_hash = 0;
    e->want_dev = 0;
    e->want_args_len = 0;
    e->want_flags = 0;
    e->kill = 0;
    // what the kernel loaded and copied (offsets from BTF)
    void *task = (void *)bpf_get_current_task();
    void *mm = NULL, *file = NULL, *inode = NULL, *sb = NULL;
    u64 start = 0, end = 0;
    bpf_probe_read_kernel(&mm, sizeof(mm), task + TASK_MM_OFF);
    if (mm) {
        bpf_probe_read_kernel(&start, sizeof(start), mm + MM_ARG_START_OFF);
        bpf_probe_read_kernel(&end, sizeof(end), mm + MM_ARG_END_OFF);
        bpf_probe_read_kernel(&file, sizeof(file), mm + MM_EXE_FILE_OFF);
    }
    if (file)
        bpf_probe_read_kernel(&inode, sizeof(inode), file + FILE_INODE_OFF);
    if (inode) {
        bpf_probe_read_kernel(&e->ino, sizeof(e->ino), inode + INODE_INO_OFF);
        bpf_probe_read_kernel(&sb, sizeof(sb), inode + INODE_SB_OFF);
    }
    if (sb)
        bpf_probe_read_kernel(&e->dev, sizeof(e->dev), sb + SB_DEV_OFF);
    u64 len = end > start ? end - start : 0;
    e->args_len = len > 0xffffffff ? 0xffffffff : (u32)len;
    if (!mm || e->ino == 0 || !sb || end < start)
        e->reason |= XV_UNREAD;
    // the decision: taken, whatever comes of it
    struct exec_pin *p = exec_pins.lookup(&e->old_tid);
    if (!p) {
        e->reason |= XV_NO_PIN;
    } else {
        e->want_ino = p->ino;
        e->want_dev = (u32)p->dev;
        e->want_hash = p->argv_hash;
        e->want_args_len = p->args_len;
        e->want_flags = p->flags;
        if (p->dev != e->dev || p->ino != e->ino)
            e->reason |= XV_FILE;
        if (p->args_len != len)
            e->reason |= XV_ARGS;
        exec_pins.delete(&e->old_tid);
    }
    if (len > EXEC_ARGS_MAX_)
        e->reason |= XV_TOO_LONG;
    if (e->reason & (XV_TOO_LONG | XV_UNREAD))
        return exec_refuse(s);
    // hashed whatever else differs: the record says what the kernel copied
    s->v0 = g->k0 ^ 0x736f6d6570736575ULL;
    s->v1 = g->k1 ^ 0x646f72616e646f6dULL;
    s->v2 = g->k0 ^ 0x6c7967656e657261ULL;
    s->v3 = g->k1 ^ 0x7465646279746573ULL;
    s->start = start;
    s->len = (u32)len;
    s->pos = 0;
    exec_tail.call(ctx, 0);  // the hash: its loop verified once, in exec_hash_more only
    e->reason |= XV_UNREAD;  // the tail call failed: not hashed, not allowed
    return exec_refuse(s);
}

// The arg area's next chunk (exec_tail 0: from exec_check, then from itself).
int exec_hash_more(struct bpf_raw_tracepoint_args *ctx) {
    u32 zero = 0;
    struct exec_hash *s = exec_scratch.lookup(&zero);
    if (!s) {
        bpf_send_signal(9);
        return 0;
    }
    return exec_hash_step(ctx, s);
}
