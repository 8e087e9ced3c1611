// The floor under a loop of opens (bench/floor.py): what syscall tracepoints on openat cost with
// programs that do nothing (EMPTY), and with the least a recorder of a cgroup's opens must do in
// summary mode. Not evidence's probes, and not loaded by it: a yardstick for bench/bench.py.
//
// The minimal recorder: at entry, the run's filter (the cgroup id, one hash lookup), the thread's
// call slot (one lookup), the time and the name (one user string read); at exit, the slot again,
// a hash of the name's first 32 bytes with the result (cheaper than any real key) and one count
// (a lookup and an atomic add). What evidence adds to this on every open: the process's tokens
// (its executable, its descriptors' generation), the opened file's inode (the name-flip defence),
// the descriptor's token check, the keyed hash of the whole name, the namespace mark, and a key
// with all of these in it.

struct slot {
    u64 ts;
    s64 len;
    char path[256];
};

BPF_HASH(floor_run, u64, u32, 64);          // cgroup id -> 1: the cgroup measured
BPF_HASH(floor_slot, u32, struct slot, 16384);  // thread id -> its open in flight
BPF_HASH(floor_count, u64, u64, 65536);     // the name's hash and the result -> how many
BPF_ARRAY(floor_zero, struct slot, 1);

TRACEPOINT_PROBE(syscalls, sys_enter_openat) {
#ifndef EMPTY
    u64 cg = bpf_get_current_cgroup_id();
    if (!floor_run.lookup(&cg))
        return 0;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct slot *s = floor_slot.lookup(&tid);
    if (!s) {
        u32 zero = 0;
        struct slot *z = floor_zero.lookup(&zero);
        if (!z)
            return 0;
        floor_slot.update(&tid, z);
        s = floor_slot.lookup(&tid);
        if (!s)
            return 0;
    }
    s->ts = bpf_ktime_get_ns();
    s->len = bpf_probe_read_user_str(s->path, sizeof(s->path), args->filename);
#endif
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat) {
#ifndef EMPTY
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct slot *s = floor_slot.lookup(&tid);
    if (!s || s->len <= 0)
        return 0;
    u64 h = 14695981039346656037ULL;  // FNV-1a over 8-byte words
#pragma unroll
    for (int i = 0; i < 4; i++)
        h = (h ^ *(u64 *)&s->path[i * 8]) * 1099511628211ULL;
    h ^= (u64)args->ret;
    u64 *n = floor_count.lookup(&h);
    if (n) {
        __sync_fetch_and_add(n, 1);
    } else {
        u64 one = 1;
        floor_count.update(&h, &one);
    }
    s->len = 0;
#endif
    return 0;
}
