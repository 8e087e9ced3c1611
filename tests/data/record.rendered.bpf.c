#define HAVE_GROUP_DEAD 1
// evidence recorder probes: exec, fork, exit, open, connect, chdir and dup of tracked cgroups.
//
// Rendered by probes/render.py, which replaces every UPPERCASE token below with a number
// (struct offsets come from the running kernel's BTF, never from the installed headers).
// Only tracepoint arguments, BPF helpers and BTF-derived offsets are used.
//
// Events go to one ring buffer as records that start with struct hdr. An enter record
// (EV_OPEN, EV_EXEC, ...) is followed by an EV_RET record from the same thread with the result;
// user space pairs them by thread id. A failed ring buffer reservation is counted in `lost`,
// per run slot and event kind: nothing is dropped silently.




#include <asm/unistd.h>  // syscall numbers (ABI: the same in any kernel's headers)

#define EV_EXEC 1
#define EV_EXEC_OK 2
#define EV_FORK 3
#define EV_EXIT 4
#define EV_OPEN 5
#define EV_CONNECT 6
#define EV_CHDIR 7
#define EV_FCHDIR 8
#define EV_DUP 9
#define EV_RET 10
#define EV_PATHFIX 11
#define EV_KINDS 12

#define SC_OPEN 1
#define SC_EXEC 2
#define SC_CONNECT 3
#define SC_CHDIR 4
#define SC_FCHDIR 5
#define SC_DUP 6

#define PATH_MAX_ 4096
#define ARGS_MAX_ 8192
#define MAXARG_ 128
#define MAX_RUNS_ 1024
#define CG_DEPTH_ 32
// Offsets into the exec buffer are masked with BUF_MASK so the verifier can bound them:
// filename (<= PATH_MAX_) + argv (< ARGS_MAX_) always fits below BUF_MASK.
#define BUF_MASK (4 * PATH_MAX_ - 1)
// Keeps the compiler from dropping a mask it believes redundant (the verifier needs it).
#define barrier_var(v) asm volatile("" : "+r"(v))

// flags in hdr.flags
#define F_PATH_TRUNC 0x1
#define F_ARGS_TRUNC 0x2
#define F_ARGS_FAULT 0x4
#define F_FNAME_FAULT 0x8
#define F_SEND 0x10  // EV_CONNECT: a send to an explicit address, not a connect()

struct hdr {
    u64 ts;
    u64 cgid;  // the task's own cgroup (a descendant of the run's, e.g. a container)
    u32 run;
    u32 tgid;
    u32 tid;
    u16 kind;
    u16 flags;
};

struct open_ev {
    struct hdr h;
    s32 dfd;
    u32 flags;
    u32 mode;
    u16 sc;       // which syscall: 0 openat, 1 openat2, 2 open, 3 creat
    u16 path_len; // bytes of path that follow, including the NUL
    char path[PATH_MAX_];
};

struct exec_ev {
    struct hdr h;
    s32 dfd;
    u32 at_flags;
    u32 old_tid;   // EV_EXEC_OK: the thread id before exec (de_thread)
    u16 fname_len;
    u16 args_len;  // bytes of NUL-separated argv that follow the filename
    u32 argc;      // arguments seen (may exceed the number captured)
    char buf[4 * PATH_MAX_ + ARGS_MAX_];
};

struct fork_ev {
    struct hdr h;
    u32 child_tgid;
    u32 pad;
};

struct exit_ev {
    struct hdr h;
    s32 exit_code;  // wait status layout: (code << 8) | signal
    u32 pad;
};

struct connect_ev {
    struct hdr h;
    s32 fd;
    u32 addrlen;
    u8 addr[128];
};

struct chdir_ev {
    struct hdr h;
    s32 fd;
    u16 path_len;
    u16 pad;
    char path[PATH_MAX_];
};

struct dup_ev {
    struct hdr h;
    s32 oldfd;
    s32 newfd;
};

struct ret_ev {
    struct hdr h;
    u32 sc;
    u32 pad;
    s64 ret;
};

// Every syscalls:sys_enter_* / sys_exit_* tracepoint has this layout (see its tracefs format):
// common fields, the syscall number, then each argument (or the result) in an 8-byte slot. One
// handler serves several tracepoints and switches on the number (x86_64 numbers are ABI).
struct sys_enter_ctx {
    u64 common;
    s32 nr;
    u32 pad;
    u64 args[6];
};

struct sys_exit_ctx {
    u64 common;
    s32 nr;
    u32 pad;
    s64 ret;
};

// An argument that not every tracepoint sharing a handler has: the kernel refuses to attach a
// program that reads past a tracepoint's record, so such slots are read with a helper instead.
static __always_inline u64 arg_beyond(struct sys_enter_ctx *ctx, int i) {
    u64 v = 0;
    bpf_probe_read_kernel(&v, sizeof(v), (void *)ctx + offsetof(struct sys_enter_ctx, args) + i * 8);
    return v;
}

BPF_RINGBUF_OUTPUT(events, 16384);
BPF_HASH(tracked, u64, u32, MAX_RUNS_);          // cgroup id -> run slot (set by user space)
BPF_TABLE("lru_hash", u64, u32, cgcache, 65536); // cgroup id -> run slot, 0 = not tracked
BPF_ARRAY(lost, u64, MAX_RUNS_ * EV_KINDS);
BPF_PERCPU_ARRAY(scratch_exec, struct exec_ev, 1);
BPF_PERCPU_ARRAY(scratch_path, struct open_ev, 1);
BPF_PERCPU_ARRAY(wake_ctr, u32, 1);

// Paths whose page was not resident at syscall entry (bpf_probe_read_user cannot fault it in):
// thread id -> user pointer, read again at syscall exit, after the kernel has paged it in.
BPF_HASH(refetch, u32, u64, 16384);

// The run slot of the current task: its cgroup or the nearest tracked ancestor.
static __always_inline u32 current_run(void) {
    u64 cg = bpf_get_current_cgroup_id();
    u32 *hit = cgcache.lookup(&cg);
    if (hit)
        return *hit;
    u32 run = 0;
#pragma clang loop unroll(disable)
    for (int lvl = 0; lvl < CG_DEPTH_; lvl++) {
        u64 anc = bpf_get_current_ancestor_cgroup_id(lvl);
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

static __always_inline void count_lost(u32 run, u32 kind) {
    u32 idx = run * EV_KINDS + kind;
    u64 *c = lost.lookup(&idx);
    if (c)
        __sync_fetch_and_add(c, 1);
}

static __always_inline void fill(struct hdr *h, u32 run, u16 kind) {
    u64 id = bpf_get_current_pid_tgid();
    h->ts = bpf_ktime_get_ns();
    h->cgid = bpf_get_current_cgroup_id();
    h->run = run;
    h->tgid = id >> 32;
    h->tid = (u32)id;
    h->kind = kind;
    h->flags = 0;
}

// Wake the consumer once every 64 records per CPU, not for each one; it also polls
// on a short timer, so a quiet run's last records are read within one poll interval.
static __always_inline u64 wakeup_flags(void) {
    u32 zero = 0;
    u32 *n = wake_ctr.lookup(&zero);
    if (!n)
        return 0;
    *n += 1;
    return (*n % 64) == 0 ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
}

static __always_inline int emit(void *data, u64 size, u32 run, u32 kind) {
    if (events.ringbuf_output(data, size, wakeup_flags()) != 0)
        count_lost(run, kind);
    return 0;
}

static __always_inline int emit_ret(u32 sc, s64 ret) {
    u32 run = current_run();
    if (!run)
        return 0;
    if (sc == SC_OPEN || sc == SC_CHDIR) {
        u32 tid = (u32)bpf_get_current_pid_tgid();
        u64 *ptr = refetch.lookup(&tid);
        if (ptr) {
            u64 p = *ptr;
            refetch.delete(&tid);
            u32 zero = 0;
            struct open_ev *scratch = scratch_path.lookup(&zero);
            if (scratch) {
                struct chdir_ev *f = (struct chdir_ev *)scratch;
                fill(&f->h, run, EV_PATHFIX);
                f->fd = -1;
                f->pad = 0;
                int n = bpf_probe_read_user_str(f->path, sizeof(f->path), (const char *)p);
                if (n < 0) {
                    n = 1;
                    f->path[0] = 0;
                    f->h.flags |= F_FNAME_FAULT;
                }
                f->path_len = n;
                emit(f, offsetof(struct chdir_ev, path) + (n & (PATH_MAX_ - 1)), run, EV_PATHFIX);
            }
        }
    }
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

// ---- opens -------------------------------------------------------------------------------

static __always_inline int emit_open(s32 dfd, const char *filename, u32 flags, u32 mode, u16 sc) {
    u32 run = current_run();
    if (!run)
        return 0;
    u32 zero = 0;
    struct open_ev *e = scratch_path.lookup(&zero);
    if (!e)
        return 0;
    fill(&e->h, run, EV_OPEN);
    e->dfd = dfd;
    e->flags = flags;
    e->mode = mode;
    e->sc = sc;
    int n = bpf_probe_read_user_str(e->path, sizeof(e->path), filename);
    if (n < 0) {
        n = 1;
        e->path[0] = 0;
        e->h.flags |= F_FNAME_FAULT;
        u64 ptr = (u64)filename;
        refetch.update(&e->h.tid, &ptr);
    } else if (n == sizeof(e->path)) {
        e->h.flags |= F_PATH_TRUNC;
    }
    e->path_len = n;
    u64 size = offsetof(struct open_ev, path) + (n & (PATH_MAX_ - 1));
    if (n >= PATH_MAX_)
        size = sizeof(struct open_ev);
    return emit(e, size, run, EV_OPEN);
}

int on_enter_open(struct sys_enter_ctx *ctx) {
    switch (ctx->nr) {
    // attached to openat, openat2 (4 arguments), open (3) and creat (2)
    case __NR_openat:
        return emit_open((s32)ctx->args[0], (const char *)ctx->args[1], (u32)arg_beyond(ctx, 2), (u32)arg_beyond(ctx, 3), 0);
    case __NR_openat2: {
        u64 how[2] = {};
        bpf_probe_read_user(how, sizeof(how), (void *)arg_beyond(ctx, 2));
        return emit_open((s32)ctx->args[0], (const char *)ctx->args[1], (u32)how[0], (u32)how[1], 1);
    }
#ifdef __NR_open
    case __NR_open:
        return emit_open(-100, (const char *)ctx->args[0], (u32)ctx->args[1], (u32)arg_beyond(ctx, 2), 2);
#endif
#ifdef __NR_creat
    case __NR_creat:
        // creat(path, mode) == open(path, O_CREAT|O_WRONLY|O_TRUNC, mode)
        return emit_open(-100, (const char *)ctx->args[0], 01 | 0100 | 01000, (u32)ctx->args[1], 3);
#endif
    }
    return 0;
}

// ---- exec --------------------------------------------------------------------------------

// Appends the NUL-separated argv at buf[off..]: returns the number of bytes written.
static __always_inline u32 read_argv(struct exec_ev *e, u32 off, const char *const *argv) {
    u32 start = off;
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
        u32 room = start + ARGS_MAX_ - 1 - off;
        if (room <= 1 || off >= PATH_MAX_ + ARGS_MAX_) {
            e->h.flags |= F_ARGS_TRUNC;
            break;
        }
        if (room > ARGS_MAX_ - 1)
            room = ARGS_MAX_ - 1;
        u32 pos = off;
        barrier_var(pos);
        pos &= BUF_MASK;
        barrier_var(room);
        room &= ARGS_MAX_ - 1;
        int n = bpf_probe_read_user_str(&e->buf[pos], room, arg);
        if (n < 0) {
            e->h.flags |= F_ARGS_FAULT;
            break;
        }
        if ((u32)n >= room) {
            e->h.flags |= F_ARGS_TRUNC;
            off += n;
            break;
        }
        off += n;
        if (i == MAXARG_ - 1) {
            // check whether more arguments were given than we read
            const char *more = NULL;
            bpf_probe_read_user(&more, sizeof(more), &argv[i + 1]);
            if (more)
                e->h.flags |= F_ARGS_TRUNC;
        }
    }
    return off - start;
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
    int n = bpf_probe_read_user_str(e->buf, PATH_MAX_, filename);
    if (n < 0) {
        n = 1;
        e->buf[0] = 0;
        e->h.flags |= F_FNAME_FAULT;
    } else if (n == PATH_MAX_) {
        e->h.flags |= F_PATH_TRUNC;
    }
    e->fname_len = n;
    u32 alen = read_argv(e, n & (PATH_MAX_ - 1), argv);
    e->args_len = alen;
    u64 size = offsetof(struct exec_ev, buf) + ((n + alen) & BUF_MASK);
    return emit(e, size, run, EV_EXEC);
}

int on_enter_exec(struct sys_enter_ctx *ctx) {
    // attached to execve (3 arguments) and execveat (5)
    if (ctx->nr == __NR_execveat)
        return emit_exec((s32)ctx->args[0], (const char *)ctx->args[1], (const char *const *)ctx->args[2], (u32)arg_beyond(ctx, 4));
    return emit_exec(-100, (const char *)ctx->args[0], (const char *const *)ctx->args[1], 0);
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
    bpf_probe_read_kernel(&mm, sizeof(mm), (void *)task + 1136);
    if (mm) {
        bpf_probe_read_kernel(&start, sizeof(start), mm + 480);
        bpf_probe_read_kernel(&end, sizeof(end), mm + 488);
    }
    u64 len = end > start ? end - start : 0;
    if (len >= ARGS_MAX_) {
        len = ARGS_MAX_ - 1;
        e->h.flags |= F_ARGS_TRUNC;
    }
    u32 off = n & (PATH_MAX_ - 1);
    len &= (ARGS_MAX_ - 1);
    if (len > 0 && bpf_probe_read_user(&e->buf[off & BUF_MASK], len, (void *)start) != 0) {
        len = 0;
        e->h.flags |= F_ARGS_FAULT;
    }
    e->args_len = len;
    u64 size = offsetof(struct exec_ev, buf) + ((off + len) & BUF_MASK);
    return emit(e, size, run, EV_EXEC_OK);
}

// ---- process lifetime --------------------------------------------------------------------

RAW_TRACEPOINT_PROBE(sched_process_fork) {
    u32 run = current_run();
    if (!run)
        return 0;
    void *child = (void *)ctx->args[1];
    s32 pid = 0, tgid = 0;
    bpf_probe_read_kernel(&pid, sizeof(pid), child + 1264);
    bpf_probe_read_kernel(&tgid, sizeof(tgid), child + 1268);
    if (pid != tgid)
        return 0;  // a new thread, not a new process
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
#ifdef HAVE_GROUP_DEAD
    if (!args->group_dead)
        return 0;
#else
    u64 id = bpf_get_current_pid_tgid();
    if ((u32)id != (id >> 32))
        return 0;
#endif
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
    bpf_probe_read_kernel(&code, sizeof(code), (void *)task + 1164);
    e->exit_code = code;
    e->pad = 0;
    // exits are rare and end a run's last process: always wake the consumer
    events.ringbuf_submit(e, BPF_RB_FORCE_WAKEUP);
    return 0;
}

// ---- network -----------------------------------------------------------------------------

// A connect record for socket fd and the sockaddr at addr (of len bytes): 1 when recorded.
static __always_inline int emit_sockaddr(u32 run, u16 flags, s32 fd, const void *addr, u32 len) {
    struct connect_ev *e = events.ringbuf_reserve(sizeof(struct connect_ev));
    if (!e) {
        count_lost(run, EV_CONNECT);
        return 0;
    }
    fill(&e->h, run, EV_CONNECT);
    e->h.flags |= flags;
    e->fd = fd;
    e->addrlen = len;
    // 127 bytes at most: more than any sockaddr we decode (sockaddr_un: 110)
    u32 n = len > sizeof(e->addr) - 1 ? sizeof(e->addr) - 1 : len;
    barrier_var(n);  // the verifier needs the bound on the value passed
    n &= 0x7F;
    __builtin_memset(e->addr, 0, sizeof(e->addr));
    if (n > 0 && bpf_probe_read_user(e->addr, n, addr) != 0)
        e->h.flags |= F_FNAME_FAULT;
    events.ringbuf_submit(e, wakeup_flags());
    return 1;
}

// Data sent to an explicit address without connect(): UDP sendto/sendmsg/sendmmsg, TCP Fast Open
// (sendto with MSG_FASTOPEN). Recorded as a connect to that address (the same record, with F_SEND);
// a send on a connected socket (no address) is not. Sends are frequent, so the result is emitted
// only for a send recorded here: `sending` marks the thread in between.
BPF_TABLE("lru_hash", u32, u8, sending, 16384);

static __always_inline int emit_send(s32 fd, const void *addr, u32 len) {
    if (!addr || len == 0)
        return 0;
    u32 run = current_run();
    if (!run)
        return 0;
    if (emit_sockaddr(run, F_SEND, fd, addr, len)) {
        u32 tid = (u32)bpf_get_current_pid_tgid();
        u8 one = 1;
        sending.update(&tid, &one);
    }
    return 0;
}

int on_enter_send(struct sys_enter_ctx *ctx) {
    // attached to sendto (6 arguments), sendmsg (3) and sendmmsg (4)
    if (ctx->nr == __NR_sendto)
        return emit_send((s32)ctx->args[0], (const void *)arg_beyond(ctx, 4), (u32)arg_beyond(ctx, 5));
    if (ctx->nr == __NR_sendmmsg && (u32)arg_beyond(ctx, 2) == 0)
        return 0;  // no message: nothing is sent
    // struct user_msghdr (and struct mmsghdr, which starts with one): void *msg_name; int msg_namelen
    struct {
        u64 name;
        u32 namelen;
        u32 pad;
    } h = {};
    if (bpf_probe_read_user(&h, sizeof(h), (void *)ctx->args[1]) != 0) {
        u32 run = current_run();
        if (run)
            count_lost(run, EV_CONNECT);  // a message header not in memory yet: counted, not guessed
        return 0;
    }
    return emit_send((s32)ctx->args[0], (const void *)h.name, h.namelen);
}

int on_enter_connect(struct sys_enter_ctx *ctx) {
    u32 run = current_run();
    if (run)
        emit_sockaddr(run, 0, (s32)ctx->args[0], (const void *)ctx->args[1], (u32)ctx->args[2]);
    return 0;
}

// ---- cwd and descriptors (for resolving relative paths and dirfds) -----------------------

int on_enter_chdir(struct sys_enter_ctx *ctx) {
    u32 run = current_run();
    if (!run)
        return 0;
    u32 zero = 0;
    struct open_ev *scratch = scratch_path.lookup(&zero);
    if (!scratch)
        return 0;
    struct chdir_ev *e = (struct chdir_ev *)scratch;
    fill(&e->h, run, EV_CHDIR);
    e->fd = -100;
    e->pad = 0;
    const char *filename = (const char *)ctx->args[0];
    int n = bpf_probe_read_user_str(e->path, sizeof(e->path), filename);
    if (n < 0) {
        n = 1;
        e->path[0] = 0;
        e->h.flags |= F_FNAME_FAULT;
        u64 ptr = (u64)filename;
        refetch.update(&e->h.tid, &ptr);
    }
    e->path_len = n;
    u64 size = offsetof(struct chdir_ev, path) + (n & (PATH_MAX_ - 1));
    return emit(e, size, run, EV_CHDIR);
}

int on_enter_fchdir(struct sys_enter_ctx *ctx) {
    u32 run = current_run();
    if (!run)
        return 0;
    struct chdir_ev *e = events.ringbuf_reserve(offsetof(struct chdir_ev, path));
    if (!e) {
        count_lost(run, EV_FCHDIR);
        return 0;
    }
    fill(&e->h, run, EV_FCHDIR);
    e->fd = (s32)ctx->args[0];
    e->path_len = 0;
    e->pad = 0;
    events.ringbuf_submit(e, wakeup_flags());
    return 0;
}

static __always_inline int emit_dup(s32 oldfd, s32 newfd) {
    u32 run = current_run();
    if (!run)
        return 0;
    struct dup_ev *e = events.ringbuf_reserve(sizeof(struct dup_ev));
    if (!e) {
        count_lost(run, EV_DUP);
        return 0;
    }
    fill(&e->h, run, EV_DUP);
    e->oldfd = oldfd;
    e->newfd = newfd;
    events.ringbuf_submit(e, wakeup_flags());
    return 0;
}
int on_enter_dup(struct sys_enter_ctx *ctx) {
    // attached to dup (1 argument), dup2 (2) and dup3 (3)
    if (ctx->nr == __NR_dup)
        return emit_dup((s32)ctx->args[0], -1);
    return emit_dup((s32)ctx->args[0], (s32)arg_beyond(ctx, 1));
}

// ---- results -----------------------------------------------------------------------------

int on_exit(struct sys_exit_ctx *ctx) {
    u32 sc;
    switch (ctx->nr) {
    case __NR_openat:
    case __NR_openat2:
#ifdef __NR_open
    case __NR_open:
#endif
#ifdef __NR_creat
    case __NR_creat:
#endif
        sc = SC_OPEN;
        break;
    case __NR_execve:
    case __NR_execveat:
        sc = SC_EXEC;
        break;
    case __NR_connect:
        sc = SC_CONNECT;
        break;
    case __NR_sendto:
    case __NR_sendmsg:
    case __NR_sendmmsg: {
        u32 tid = (u32)bpf_get_current_pid_tgid();
        if (!sending.lookup(&tid))
            return 0;  // a send not recorded (no address): no result either
        sending.delete(&tid);
        sc = SC_CONNECT;
        break;
    }
    case __NR_chdir:
        sc = SC_CHDIR;
        break;
    case __NR_fchdir:
        sc = SC_FCHDIR;
        break;
    case __NR_dup:
    case __NR_dup2:
    case __NR_dup3:
        sc = SC_DUP;
        break;
    default:
        return 0;
    }
    return emit_ret(sc, ctx->ret);
}
