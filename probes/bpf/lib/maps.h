// ---- maps every program shares: the ring buffer, tracked cgroups, loss counts, calls in flight

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_HASH(tracked, u64, u32, MAX_RUNS_);          // cgroup id -> run slot (set by user space)
BPF_TABLE("lru_hash", u64, u32, cgcache, 65536); // cgroup id -> run slot, 0 = not tracked
BPF_ARRAY(lost, u64, MAX_RUNS_ * EV_KINDS);
BPF_PERCPU_ARRAY(scratch_exec, struct exec_ev, 1);
BPF_PERCPU_ARRAY(wake_ctr, u32, 1);
BPF_PERCPU_ARRAY(call_zero, struct call, 1);  // never written: the first value of a thread's call
// tgid -> 1: a process of a run that left the run's mount or user namespace, mounted, or chrooted
// (or a child of one); its records carry F_OTHER_NS (see ---- namespaces and mounts)
BPF_HASH(nsmark, u32, u8, 65536);
BPF_ARRAY(nslive, u64, 1);  // entries in nsmark: while there are none, a record needs no lookup there

// thread id -> its call in flight. Allocated on demand (only tracked threads have one), kept while
// the thread lives (removed at its exit), so a call costs no allocation and no 4 KiB copy. A run
// holds at most INFLIGHT_RUN_ entries (inflight_n): a job with more live threads than that loses
// their calls, counted in its own run, and cannot take the table from the machine's other runs.
BPF_F_TABLE("hash", u32, struct call, inflight, INFLIGHT_MAX, BPF_F_NO_PREALLOC);
BPF_ARRAY(inflight_n, u32, MAX_RUNS_);  // per run slot: entries of `inflight` it holds
