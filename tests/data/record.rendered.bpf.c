#define HAVE_GROUP_DEAD 1
// evidence recorder probes: exec, fork, exit, open, file changes, connect, chdir, dup, and namespace, mount and ptrace calls of tracked cgroups.
//
// Rendered by probes/render.py, which replaces every UPPERCASE token below with a number
// (struct offsets come from the running kernel's BTF, never from the installed headers), and
// the line of record kinds with their #defines (EV_*, K_*: defined once, in probes/kinds.py).
// Only tracepoint arguments, BPF helpers and BTF-derived offsets are used.
//
// The programs are in files by concern, joined into one text by render.py in the order of the
// `#include "..."` lines below (each file once; BCC compiles one text, and every program shares the
// maps and the inline helpers declared before it): shared helpers in bpf/lib/*.h, the programs of
// each concern in bpf/*.bpf.c (Tetragon's bpf/lib plus per-concern program files).
//
// Events go to one ring buffer as records that start with struct hdr. Opens, file changes,
// connects, sends, chdir, fchdir and dup are paired in the kernel: the enter handler keeps the call's arguments
// (and the path or address, read at entry) in `inflight`, per thread, and the exit handler emits
// ONE record with the result. exec keeps three records: the attempt with its argv (EV_EXEC), the
// success (EV_EXEC_OK, sched_process_exec) and the result (EV_RET), paired in user space. A failed
// ring buffer reservation is counted in `lost`, per run slot and event kind: nothing is dropped
// silently.

// ---- common: limits, record flags, the records' layouts, the syscall tracepoints' context


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
// lost[] kinds that are not records: what a run did past its cap on distinct summary keys (not
// kept, counted), and operations recorded one by one because the aggregation map was full
#define K_OPEN_PAST_CAP 11
#define K_CONNECT_PAST_CAP 12
#define K_AGG_MAP_FULL 13
#define EV_CHANGE 14  // a file change that is not an open: rename, unlink, link, chmod, ... (op)
#define EV_NS 15  // a namespace, mount, chroot or ptrace call (op; see ---- namespaces and mounts)
#define EV_DNS 16  // a DNS message sent or received (see ---- dns)
#define EV_SIGSYS 17  // a 32-bit system call refused (see ---- refused system calls)
#define EV_KINDS 18

#define SC_EXEC 2  // ret_ev.sc: exec is the only call whose result is a record of its own

#define PATH_MAX_ 4096
#define DNS_MAX_ 1024  // bytes of a DNS message kept (a power of two)
#define DNS_SENT 0
#define DNS_RECEIVED 1
#define DNS_DELIVERED 2  // a datagram or segment the kernel delivered to a socket of a run (on_dns_ingress)
#define HASH_MAX_ 1024  // longer names are not aggregated (see name_token)
// the result of a call that never returned while recorded (not a kernel code: -1,000,000)
#define NO_RESULT_ (-1000000)
#define ARGS_MAX_ 8192
#define MAXARG_ 128
#define MAX_RUNS_ 1024
#define CG_DEPTH_ 32
#define INFLIGHT_RUN_ 4096  // entries of `inflight` one run may hold
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
#define F_FIRST 0x20 // the first occurrence of an aggregated key: its count is in `agg`
#define F_STATE 0x40 // already counted in `agg` (or past the cap): only for the cwd/fd tables
#define F_PATH2_FAULT 0x80  // EV_CHANGE: the second path could not be read
#define F_PATH2_TRUNC 0x100 // EV_CHANGE: the second path is truncated
#define F_OTHER_NS 0x200    // by a process that left the run's mount or user namespace, mounted or chrooted
#define F_IN_ROOT 0x400     // EV_OPEN: openat2 with RESOLVE_IN_ROOT: the path, even absolute, is below dfd
#define F_KNAME 0x800       // EV_OPEN, EV_CHDIR, EV_FCHDIR: the kernel's name of the file (the new cwd) follows the path
#define RESOLVE_IN_ROOT_ 0x10

struct hdr {
    u64 ts;
    u64 cgid;  // the task's own cgroup (a descendant of the run's, e.g. a container)
    u32 run;
    u32 tgid;
    u32 tid;
    u16 kind;
    u16 flags;
};

// A paired call's record: the header, the result, then what the call was given. Opens, chdir and
// fchdir share this layout (the path is at the same offset).
struct open_ev {
    struct hdr h;
    s64 ret;      // the result (NO_RESULT: the call never returned while recorded)
    u64 exe;      // F_FIRST: the aggregation key's program token ...
    u64 tok;      // ... and path token (see `agg`)
    s32 dfd;      // openat's dirfd; chdir: AT_FDCWD; fchdir: the descriptor
    u32 flags;
    u16 mode;     // the mode given (the kernel uses its low 12 bits: S_IALLUGO)
    u16 nlink;    // a write open's record: the file's link count (inode_nlink), else 0
    u16 sc;       // which syscall: 0 openat, 1 openat2, 2 open, 3 creat
    u16 path_len; // bytes of path that follow, including the NUL
    u64 dino;     // what dfd names at entry (its struct inode's address, fd_inode), 0: not read
    u64 rino;     // what the descriptor returned names (read at exit), 0: none
    char path[PATH_MAX_];
};

// A file change that is not an open (rename, unlink, rmdir, link, symlink, truncate, chmod, chown,
// mkdir, mknod), paired in the kernel like an open: the same first fields (ret, exe, tok), then
// what the call was given and up to two paths, one after the other (len1 and len2 bytes with their
// NUL; len1 = 0: no path, the call names a descriptor: dfd).
struct change_ev {
    struct hdr h;
    s64 ret;
    u64 mino;     // path 1 through a magic link of the process's descriptors (magic_fd): what
    u64 mino2;    // that descriptor named at entry and still at exit (fd_inode), else 0; path 2's
    s32 dfd;      // what path 1 is resolved against (AT_FDCWD, a dirfd, or fchmod/fchown's fd)
    s32 dfd2;     // the same for path 2 (rename, link, symlink's link path)
    u64 dino;     // what dfd names at entry (fd_inode), 0: not read (AT_FDCWD)
    u64 dino2;    // the same for dfd2
    u16 mode;     // chmod, mkdir, mknod (S_IFMT and S_IALLUGO: 16 bits)
    u16 nlink;    // the link count of the file changed when a descriptor names it (inode_nlink), else 0
    u32 uid;      // chown
    u32 gid;      // chown
    u32 at_flags; // renameat2's, linkat's, unlinkat's, fchownat's or fchmodat2's flags
    u16 op;       // CH_*
    u16 len1;
    u16 len2;
    u16 pad;
    char buf[2 * PATH_MAX_];
};

#define CH_RENAME 1
#define CH_UNLINK 2
#define CH_RMDIR 3
#define CH_LINK 4
#define CH_SYMLINK 5
#define CH_TRUNCATE 6
#define CH_CHMOD 7
#define CH_CHOWN 8
#define CH_MKDIR 9
#define CH_MKNOD 10

// A namespace, mount, chroot or ptrace call (EV_NS), paired like a change and laid out like one
// up to its paths (read_change_paths fills both): ret, then what the call was given.
struct ns_ev {
    struct hdr h;
    s64 ret;
    u64 flags;       // clone/unshare: CLONE_*; setns: nstype; mount, move_mount, open_tree, fsmount: flags; ptrace: request
    u64 target;      // ptrace, process_vm_writev: the target pid; setns: the fd; fsmount: the fs fd
    s32 dfd;         // move_mount's from_dfd, open_tree's dfd
    s32 dfd2;        // move_mount's to_dfd
    u64 dino;        // what dfd names at entry (fd_inode), 0: not read
    u64 dino2;       // the same for dfd2
    char fstype[16]; // mount: the filesystem type (at most 15 bytes)
    u16 op;          // NS_*
    u16 len1;
    u16 len2;
    u16 pad;
    char buf[2 * PATH_MAX_];
};

struct exec_ev {
    struct hdr h;
    s32 dfd;
    u32 at_flags;
    u32 old_tid;   // EV_EXEC_OK: the thread id before exec (de_thread)
    u16 fname_len;
    u16 args_len;  // bytes of NUL-separated argv that follow the filename
    u32 argc;      // arguments seen (may exceed the number captured)
    // EV_EXEC_OK: the file the new image was mapped from (mm->exe_file; for a #! script, its
    // interpreter): s_dev (kernel encoding), inode number, size and ctime. ino 0: not read.
    u32 dev;
    u64 ino;
    u64 size;
    s64 ctime_sec;
    u32 ctime_nsec;
    u32 pad;
    u64 dino;      // EV_EXEC: what dfd names at entry (fd_inode), 0: not read
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
    s64 ret;
    u64 exe;
    u64 tok;
    s32 fd;
    u32 addrlen;
    u64 pad;      // the address at the offset of open_ev.path: one hash for both
    u64 dino;     // an AF_UNIX path that is relative: the cwd at entry (cwd_inode), else 0
    u64 pad2;
    u8 addr[128];
};

struct dup_ev {
    struct hdr h;
    s64 ret;
    s32 oldfd;
    s32 newfd;
    u64 rino;     // what the descriptor returned names (read at exit), 0: none
};

// A call between its enter and its exit, one per thread. `refetch` is the user pointer of a path
// whose page was not resident at entry (bpf_probe_read_user cannot fault it in): it is read again
// at exit, after the kernel has paged it in.
struct call {
    u64 refetch;   // EV_CHANGE: path 1's pointer (0: none), kept for a second read at exit
    u64 refetch2;  // EV_CHANGE: path 2's pointer (0: none)
    u32 size;  // bytes of the record to emit
    s32 nr;    // the syscall it waits for
    u64 hbase; // at exit: the token the name is resolved against, ...
    u32 hlen;  // ... the name's length (path or address, at the same offset) ...
    u32 hskip; // ... and whether there is nothing to hash (1) or no known base (2)
    u64 htok;  // the name's token, 0 when none
    u32 koff;   // kernel_name: where the name built backward starts (kept here, not in a register)
    u32 hoff;   // where in the path buffer the hashed name starts: 0, or past the path (a kernel name)
    u32 owner;  // the run slot the entry is counted in (inflight_n) since its thread's first call
    u32 walked; // on_exit_name ran for the call (the kernel's name, if it could be had, is in it)
    s32 mfd;    // EV_CHANGE: the descriptor path 1 names through a magic link (magic_fd), -1: none
    s32 mfd2;   // the same for path 2
    union {
        struct hdr h;  // h.kind == 0: no call in flight
        struct open_ev open;
        struct change_ev change;
        struct ns_ev ns;
        struct connect_ev conn;
        struct dup_ev dup;
    } ev;
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

// ---- maps every program shares: the ring buffer, tracked cgroups, loss counts, calls in flight

BPF_RINGBUF_OUTPUT(events, 16384);
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
BPF_F_TABLE("hash", u32, struct call, inflight, 16384, BPF_F_NO_PREALLOC);
BPF_ARRAY(inflight_n, u32, MAX_RUNS_);  // per run slot: entries of `inflight` it holds

// ---- in-kernel aggregation (--detail summary) ---------------------------------------------
//
// An open or connect is counted in `agg` under a key that determines exactly what user space
// makes of it: the run, the cgroup, the program, the path or address as the process named it
// together with what it was resolved against, the access class and the result. Only a key's first
// occurrence is a record (F_FIRST); the counts are read from the map when the run finishes.
//
// Tokens stand for the resolution state user space keeps per process. A token is either a keyed
// hash (SipHash-1-3, with a secret key user space draws at load time, so a job cannot make two
// paths collide) of a base token and the name as given, or a random number for a state the kernel
// cannot name (a process first seen mid-life, a relative exec, an unreadable chdir path): equal
// tokens mean equal resolved names. Every process has {gen, exe, cwd} (fork copies exe and cwd);
// every descriptor an open or dup returned has {gen, tok} (valid while gen is its process's gen).
// A descriptor the kernel does not know makes an openat through it a plain record, resolved by
// user space, whose tables stay exact because every change to them reaches it: chdir, fchdir and
// dup always, and an aggregated open whenever it changes what its descriptor number names
// (F_STATE when its count is already kept).

struct pctx {
    u64 gen;
    u64 exe;
    u64 cwd;
    u64 cwd_ino;  // the directory `cwd` stands for (cwd_inode), 0 until known
};

struct fdtok {
    u64 gen;
    u64 tok;
    u64 ino;  // what the descriptor named when its token was set (fd_inode)
};

struct akey {
    u64 exe;
    u64 tok;
    u64 cgid;
    u32 run;
    u32 access;  // open: the flag bits that decide the access class; connect: F_SEND, F_FNAME_FAULT
    s32 result;  // 0 or -errno
    u16 kind;
    u16 pad;
    u64 ino;     // open: what it opened (its inode's address, rino), 0 when it failed; connect: 0
};

struct aval {
    u64 count;
    u64 first;
    u64 last;
};

BPF_ARRAY(hkey, u64, 2);                  // SipHash key (user space writes it once, at load)
BPF_ARRAY(limits, u32, MAX_RUNS_);        // per run: distinct keys kept (0: no aggregation)
BPF_ARRAY(distinct, u32, MAX_RUNS_);      // per run: distinct keys in `agg`
BPF_F_TABLE("hash", u32, struct pctx, procs, 65536, BPF_F_NO_PREALLOC);
BPF_TABLE("lru_hash", u64, struct fdtok, fds, 65536);
BPF_F_TABLE("hash", struct akey, struct aval, agg, 262144, BPF_F_NO_PREALLOC);

#define ROTL(x, b) (u64)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                \
    do {                                                                        \
        v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32);               \
        v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                                  \
        v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                                  \
        v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32);               \
    } while (0)

struct sip {
    u64 v0, v1, v2, v3;
};

static __always_inline int sip_init(struct sip *s, u64 base) {
    u32 i0 = 0, i1 = 1;
    u64 *k0 = hkey.lookup(&i0);
    u64 *k1 = hkey.lookup(&i1);
    if (!k0 || !k1)
        return -1;
    u64 v0 = *k0 ^ 0x736f6d6570736575ULL, v1 = *k1 ^ 0x646f72616e646f6dULL;
    u64 v2 = *k0 ^ 0x6c7967656e657261ULL, v3 = *k1 ^ 0x7465646279746573ULL;
    // the base token is the first word
    v3 ^= base;
    SIPROUND;
    v0 ^= base;
    s->v0 = v0; s->v1 = v1; s->v2 = v2; s->v3 = v3;
    return 0;
}

static __always_inline void sip_word(struct sip *s, u64 m) {
    u64 v0 = s->v0, v1 = s->v1, v2 = s->v2, v3 = s->v3;
    v3 ^= m;
    SIPROUND;
    v0 ^= m;
    s->v0 = v0; s->v1 = v1; s->v2 = v2; s->v3 = v3;
}

static __always_inline u64 sip_final(struct sip *s, u64 len) {
    sip_word(s, len << 56);
    u64 v0 = s->v0, v1 = s->v1, v2 = s->v2, v3 = s->v3;
    v2 ^= 0xff;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

// The token of `base` and the first `len` bytes at buf (in the thread's call: a map value, read
// directly, 8 bytes a load; buf + HASH_MAX_ + 8 stays inside the value), 0 when no key is set or
// the name is longer than HASH_MAX_ bytes (then the call is a plain record: correct, only not
// aggregated; the verifier walks this loop once per iteration and state, so it is kept short).
static __always_inline u64 name_token(u64 base, const char *buf, u32 len) {
    struct sip s;
    if (len > HASH_MAX_)
        return 0;
    if (sip_init(&s, base) != 0)
        return 0;
    u32 words = len / 8;
    u64 m;
#pragma clang loop unroll(disable)
    for (u32 i = 0; i < HASH_MAX_ / 8; i++) {
        if (i >= words)
            break;
        sip_word(&s, *(const u64 *)(buf + i * 8));
    }
    u32 rem = len & 7;
    m = 0;
    if (rem)  // the last bytes; past len is whatever an earlier read left: masked off
        m = *(const u64 *)(buf + (len & ~7)) & ((1ULL << (rem * 8)) - 1);
    sip_word(&s, m);
    return sip_final(&s, len);
}

static __always_inline u64 random_token(void) {
    return ((u64)bpf_get_prandom_u32() << 32) | bpf_get_prandom_u32();
}

// The current process's tokens, made on first sight (a process the kernel has not seen forked).
static __always_inline struct pctx *proc_ctx(u32 tgid) {
    struct pctx *p = procs.lookup(&tgid);
    if (p)
        return p;
    struct pctx fresh = {.gen = random_token(), .exe = random_token(), .cwd = random_token()};
    procs.update(&tgid, &fresh);
    return procs.lookup(&tgid);
}

// ---- BTF task loads: what a descriptor, the cwd and a dirfd name, the task's ids, their tokens

static __always_inline u64 fd_key(u32 tgid, s32 fd) {
    return ((u64)tgid << 32) | (u32)fd;
}

// What descriptor fd of the current process names now: the address of its file's struct inode
// (task->files->fdt->fd[fd]->f_inode, offsets from BTF), 0 when fd is not open. Stable while the
// inode lives, equal for every open of the same file, different for another file: the identity
// that tells a descriptor the tables know from one put at its number unseen (F_DUPFD, SCM_RIGHTS,
// pidfd_getfd, a table shared by CLONE_FILES: close is not a record). It costs an open's exit two
// helper calls: the task, its files and its fdtable are BTF pointers (bpf_get_current_task_btf),
// loaded directly (the verifier checks each load against the kernel's BTF at that offset, and a
// NULL pointer reads as 0); the array's slot and the file's f_inode are read with the helper.
static __always_inline u64 task_fd_file(char *task, s32 fd) {
    if (fd < 0)
        return 0;
    char *files = *(char **)(task + 1824);
    if (!files)
        return 0;
    char *fdt = *(char **)(files + 32);
    if (!fdt)
        return 0;
    u32 max = *(u32 *)(fdt + 0);
    u64 arr = *(u64 *)(fdt + 8);
    if ((u32)fd >= max || !arr)
        return 0;
    u64 file = 0;
    bpf_probe_read_kernel(&file, sizeof(file), (void *)(arr + (u64)(u32)fd * 8));
    return file;
}

static __always_inline u64 task_fd_inode(char *task, s32 fd) {
    u64 file = task_fd_file(task, fd), inode = 0;
    if (!file)
        return 0;
    bpf_probe_read_kernel(&inode, sizeof(inode), (void *)(file + 32));
    return inode;
}

static __always_inline u64 fd_file(s32 fd) {
    return task_fd_file((char *)bpf_get_current_task_btf(), fd);
}

static __always_inline u64 fd_inode(s32 fd) {
    return task_fd_inode((char *)bpf_get_current_task_btf(), fd);
}

// What bpf_get_current_pid_tgid and bpf_get_current_cgroup_id return, loaded from the current
// task (bpf_get_current_task_btf: a BTF pointer, offsets from BTF) instead: on this kernel a
// helper call costs about 30 ns whatever it does, and openat's programs need the task anyway.
// The cgroup is the task's on the default (v2) hierarchy: task->cgroups->dfl_cgrp->kn->id, as
// the helper reads it (under the RCU read lock a tracepoint program runs in). None of the
// pointers is NULL for a live task (the verifier treats them as RCU-trusted); the checks only
// keep a 0 from being read as an address.
static __always_inline u64 task_pid_tgid(char *task) {
    return ((u64)*(u32 *)(task + 1268) << 32) | *(u32 *)(task + 1264);
}

static __always_inline u64 task_cgroup_id(char *task) {
    char *cset = *(char **)(task + 2376);
    if (!cset)
        return 0;
    char *cgrp = *(char **)(cset + 112);
    if (!cgrp)
        return 0;
    char *kn = *(char **)(cgrp + 256);
    if (!kn)
        return 0;
    return *(u64 *)(kn + 96);
}

// The current thread's working directory: the address of its struct inode
// (task->fs->pwd.dentry->d_inode, offsets from BTF), 0 when not known. A cwd is per thread and
// can change without a chdir of this process being seen: one shared by clone(CLONE_FS) follows
// the other process's chdir, a thread's unshare(CLONE_FS) makes it its own, and another thread's
// chdir can land while a call is in flight. Relative names carry it (dino, read at entry) like a
// dirfd's identity, and the cwd's token is used only while it stands for that directory.
static __always_inline u64 task_cwd_inode(char *task) {
    char *fs = *(char **)(task + 1816);
    if (!fs)
        return 0;
    char *dentry = *(char **)(fs + 40 + 8);
    if (!dentry)
        return 0;
    return *(u64 *)(dentry + 48);  // a BTF pointer too: loaded directly
}

static __always_inline u64 cwd_inode(void) {
    return task_cwd_inode((char *)bpf_get_current_task_btf());
}

// What a name given relative to dfd is resolved against, now: the cwd (AT_FDCWD) or the dirfd.
static __always_inline u64 task_dir_inode(char *task, s32 dfd) {
    return dfd == -100 ? task_cwd_inode(task) : task_fd_inode(task, dfd);
}

static __always_inline u64 dir_inode(s32 dfd) {
    return task_dir_inode((char *)bpf_get_current_task_btf(), dfd);
}

// The token of what descriptor fd names, 0 when unknown: the kernel set one, and fd names now
// (ino, from fd_inode) what it named then.
static __always_inline u64 fd_token(struct pctx *p, u32 tgid, s32 fd, u64 ino) {
    u64 k = fd_key(tgid, fd);
    struct fdtok *t = fds.lookup(&k);
    if (!t || t->gen != p->gen || ino == 0 || t->ino != ino)
        return 0;
    return t->tok;
}

static __always_inline void set_fd_token(struct pctx *p, u32 tgid, s32 fd, u64 tok, u64 ino) {
    u64 k = fd_key(tgid, fd);
    if (tok == 0) {
        fds.delete(&k);
        return;
    }
    struct fdtok t = {.gen = p->gen, .tok = tok, .ino = ino};
    fds.update(&k, &t);
}

// The cwd's token for a name resolved against the directory `ino` (cwd_inode at the call's entry),
// 0 when the kernel cannot name it. A process's first relative name ties its token to the
// directory; a cwd changed unseen (CLONE_FS, unshare) gets a new token for its new directory, once
// it holds still; one that changed while the call was in flight leaves the call unknown.
static __always_inline u64 cwd_base(struct pctx *p, u64 ino) {
    if (ino == 0 || ino == p->cwd_ino)
        return p->cwd;
    if (p->cwd_ino == 0) {
        p->cwd_ino = ino;
        return p->cwd;
    }
    if (cwd_inode() != ino)
        return 0;
    p->cwd = random_token();
    p->cwd_ino = ino;
    return p->cwd;
}

// What the path of an open/chdir record is resolved against: 0 for an absolute path, the cwd's or
// the dirfd's token, or 0 with *unknown = 1 when the kernel cannot name it (user space resolves it
// from its own tables). An unreadable path gets base 1 and no bytes: one fixed token. The
// process's tokens are looked up for a relative name only (*unknown = 2 when they cannot be had).
static __always_inline u64 path_base(struct open_ev *e, u32 *len, int *unknown) {
    if (e->h.flags & F_FNAME_FAULT) {
        *len = 0;
        return 1;
    }
    *len = e->path_len > 0 ? e->path_len - 1 : 0;  // without the NUL
    if (e->path[0] == '/' && !(e->h.flags & F_IN_ROOT))
        return 0;
    struct pctx *p = proc_ctx(e->h.tgid);
    if (!p) {
        *unknown = 2;
        return 0;
    }
    u64 base = e->dfd == -100 ? cwd_base(p, e->dino) : fd_token(p, e->h.tgid, e->dfd, e->dino);
    if (base == 0)
        *unknown = 1;
    return base;
}

// ---- a task's run, a record's header, the ring buffer

// The run slot of a task in cgroup `cg` (the current one): its cgroup or the nearest tracked
// ancestor.
static __always_inline u32 run_of(u64 cg) {
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
    bpf_probe_read_kernel(&mode, sizeof(mode), (void *)(inode + 0));
    if ((mode & 0170000) == 0040000)
        return 0;
    bpf_probe_read_kernel(&n, sizeof(n), (void *)(inode + 72));
    return n > 0xffff ? 0xffff : n;
}

#define WRITE_BITS_ (03 | 01000)  // O_ACCMODE and O_TRUNC: an open that writes, ...
#define O_PATH_ 010000000         // ... unless O_PATH (its other flags are ignored)

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

// ---- paths read at entry (an open's, a chdir's, a change's)

// The call's open/chdir record holds a path of n bytes (with its NUL): its length and the size.
static __always_inline void set_path_len(struct call *c, int n) {
    c->ev.open.path_len = n;
    u32 size = offsetof(struct open_ev, path) + (n & (PATH_MAX_ - 1));
    if (n >= PATH_MAX_)
        size = sizeof(struct open_ev);
    c->size = size;
}

// Reads a path into the call's open/chdir record at entry; keeps the pointer when not resident.
static __always_inline void read_path(struct call *c, const char *filename) {
    struct open_ev *e = &c->ev.open;
    int n = bpf_probe_read_user_str(e->path, sizeof(e->path), filename);
    if (n < 0) {
        n = 1;
        e->path[0] = 0;
        e->h.flags |= F_FNAME_FAULT;
        c->refetch = (u64)filename;
    } else if (n == sizeof(e->path)) {
        e->h.flags |= F_PATH_TRUNC;
    }
    set_path_len(c, n);
}

// Reads a change's paths (p1, then p2 right after it; NULL: none) into its record and sets its size.
static __always_inline void read_change_paths(struct call *c, const char *p1, const char *p2) {
    struct change_ev *e = &c->ev.change;
    int n = 0;
    if (p1) {
        n = bpf_probe_read_user_str(e->buf, PATH_MAX_, p1);
        if (n < 0) {
            n = 1;
            e->buf[0] = 0;
            e->h.flags |= F_FNAME_FAULT;
        } else if (n == PATH_MAX_) {
            e->h.flags |= F_PATH_TRUNC;
        }
    }
    u32 off = n;
    barrier_var(off);
    if (off > PATH_MAX_)
        off = PATH_MAX_;
    int m = 0;
    if (p2) {
        m = bpf_probe_read_user_str(&e->buf[off], PATH_MAX_, p2);
        if (m < 0) {
            m = 1;
            e->buf[off] = 0;
            e->h.flags |= F_PATH2_FAULT;
        } else if (m == PATH_MAX_) {
            e->h.flags |= F_PATH2_TRUNC;
        }
    }
    if (m < 0 || m > PATH_MAX_)
        m = 0;
    e->len1 = off;
    e->len2 = m;
    c->refetch = (u64)p1;
    c->refetch2 = (u64)p2;
    u32 size = offsetof(struct change_ev, buf) + off + (u32)m;
    if (size > sizeof(struct change_ev))
        size = sizeof(struct change_ev);
    c->size = size;
}

// ---- a paired call's exit: its name hashed, its key counted in `agg` or its record emitted

#define ACCESS_BITS (03 | 0100 | 01000 | 010000000 | 020200000)  // ACCMODE CREAT TRUNC PATH TMPFILE

// Sets what hash_name hashes for the call: an open's or chdir's path against its base, or a
// connect's address (the bytes as given, up to 127).
static __always_inline void prepare_hash(struct call *c) {
    c->hskip = 1;
    c->htok = 0;
    c->hoff = 0;
    u32 kind = c->ev.h.kind;
    u32 run = c->ev.h.run;
    // a chdir's cwd is named by the kernel (kernel_name): its token is a random one (settle), since
    // the same name can reach another directory later and user space names the cwd by where it is
    if (kind != EV_OPEN && kind != EV_CONNECT)
        return;
    u32 *lim = limits.lookup(&run);
    if (!lim || *lim == 0)
        return;  // --detail full: every operation is a record
    if (kind == EV_CONNECT) {
        struct connect_ev *e = &c->ev.conn;
        c->hlen = e->addrlen > sizeof(e->addr) - 1 ? sizeof(e->addr) - 1 : e->addrlen;
        c->hbase = 0x636f6e6e656374ULL;  // "connect": apart from any path's
        c->hskip = 0;
        if (e->dino) {  // a relative AF_UNIX path: hashed against the cwd's token, like an open's
            struct pctx *p = proc_ctx(c->ev.h.tgid);
            u64 base = p ? cwd_base(p, e->dino) : 0;
            if (base)
                c->hbase = base;
            else
                c->hskip = 2;
        }
        return;
    }
    u32 len = 0;
    int unknown = 0;
    u64 base = path_base(&c->ev.open, &len, &unknown);
    if (unknown == 2)
        return;  // no room for the process's tokens: a plain record
    c->hbase = base;
    c->hlen = len;
    c->hskip = unknown ? 2 : 0;
}

// c->htok = the token of what prepare_hash set. The inputs are read back from the map value, so the
// verifier walks the loop with the same state from every path that leads here (else the
// program is too large to verify).
static __always_inline void hash_name(struct call *c) {
    if (*(volatile u32 *)&c->hskip != 0)
        return;
    u64 base = *(volatile u64 *)&c->hbase;
    u32 len = *(volatile u32 *)&c->hlen;
    u32 off = *(volatile u32 *)&c->hoff;
    c->htok = name_token(base, c->ev.open.path + (off & (PATH_MAX_ - 1)), len);
    c->hskip = 3;  // hashed: on_exit_name keeps this token (see settle)
}

// The aggregation key of a completed open or connect whose token is `tok`.
static __always_inline void fill_key(struct call *c, struct pctx *p, u64 tok, struct akey *k) {
    struct hdr *h = &c->ev.h;
    s64 ret = c->ev.open.ret;
    k->exe = p->exe;
    k->tok = tok;
    k->cgid = h->cgid;
    k->run = h->run;
    k->kind = h->kind;
    k->result = ret < 0 ? (s32)ret : 0;
    if (h->kind == EV_OPEN) {
        k->access = c->ev.open.flags & ACCESS_BITS;
        k->ino = ret >= 0 ? c->ev.open.rino : 0;
    } else {
        k->access = h->flags & (F_SEND | F_FNAME_FAULT);
        k->ino = 0;
    }
}

BPF_PROG_ARRAY(exit_tail, 3);  // 0: on_exit_hash, 1: on_exit_name, 2: on_exit

// What a completed call changes in the kernel's tokens, and whether it is a record: 0 when an open
// or connect was counted under a key already kept (or past the cap) and changed nothing user space
// keeps. F_FIRST marks a key's first record (then *first = 1 and *k is its key).
//
// A successful open that will be a record (its key's first, or one the kernel does not count) and
// was not named by the kernel yet goes to on_exit_name first, which comes back to on_exit_hash and
// so here again: the record names the file the kernel opened, not the name the job's memory held
// when the probe read it (another thread can change it before the kernel reads it). That is
// decided at the one lookup of the key a repeat costs, before anything is changed, so that the
// second pass decides the same; a repeat counted under a key is the same file (the key has its
// inode), so only a key's first open costs the walk.
static __always_inline int settle(struct sys_exit_ctx *ctx, struct call *c, struct akey *k, int *first) {
    struct hdr *h = &c->ev.h;
    u32 kind = h->kind;
    s64 ret = c->ev.open.ret;
    u32 tgid = h->tgid;
    u32 run = h->run;
    if (kind == EV_CHDIR || kind == EV_FCHDIR || kind == EV_DUP) {
        if (ret < 0)
            return 1;
        struct pctx *p = proc_ctx(tgid);
        if (!p)
            return 1;
        if (kind == EV_DUP) {  // the new descriptor names what oldfd names: its token if oldfd is known as that
            u64 ino = c->ev.dup.rino;
            set_fd_token(p, tgid, (s32)ret, fd_token(p, tgid, c->ev.dup.oldfd, ino), ino);
            return 1;
        }
        // the new cwd: user space names it by the kernel's name of it (kernel_name), which another
        // chdir to the same name may not have: a token of its own
        p->cwd = random_token();
        p->cwd_ino = c->ev.open.rino;  // the new cwd, read at exit
        return 1;
    }
    if (kind != EV_OPEN && kind != EV_CONNECT)
        return 1;
    u32 *lim = limits.lookup(&run);
    if (!lim || *lim == 0)
        return 1;  // --detail full: every operation is a record
    int opened = kind == EV_OPEN && ret >= 0;
    struct pctx *p = proc_ctx(tgid);
    if (!p) {
        if (opened && !c->walked)
            exit_tail.call(ctx, 1);  // a plain record: named by the kernel
        return 1;
    }
    u64 tok = c->htok;
    int fd_changes = 0;
    u64 ino = 0;
    if (opened) {
        // what user space keeps for the descriptor changes: another token, or the same name on
        // another file (a directory removed and made again: user space needs its new inode)
        ino = c->ev.open.rino;
        fd_changes = fd_token(p, tgid, (s32)ret, ino) != tok;
    }
    // tok 0: resolved against something the kernel cannot name; F_OTHER_NS: another mount
    // namespace, never merged with the run's own names: each a plain record
    int plain = tok == 0 || (h->flags & F_OTHER_NS);
    struct aval *v = NULL;
    u32 *nd = NULL;
    int walk = plain;
    if (!plain) {
        fill_key(c, p, tok, k);
        v = agg.lookup(k);
        if (!v) {  // a key's first record; past the cap, a record only when fd_changes
            nd = distinct.lookup(&run);
            walk = !nd || *nd < *lim || fd_changes;
        }
    }
    if (walk && opened && !c->walked)
        exit_tail.call(ctx, 1);  // on_exit_name, then back to on_exit_hash (if it fails: the name as given)
    // from here on, state changes
    if (opened && (fd_changes || tok == 0))  // else the entry holds this generation, token and inode already
        set_fd_token(p, tgid, (s32)ret, tok, ino);
    if (plain)
        return 1;
    c->ev.open.exe = p->exe;  // the same offsets in connect_ev
    c->ev.open.tok = tok;
    if (!v) {
        if (!nd)
            return 1;
        if (*nd >= *lim) {
            count_lost(run, kind == EV_OPEN ? K_OPEN_PAST_CAP : K_CONNECT_PAST_CAP);
            if (!fd_changes)
                return 0;
            h->flags |= F_STATE;
            return 1;
        }
        struct aval nv = {.count = 1, .first = h->ts, .last = h->ts};
        if (agg.insert(k, &nv) == 0) {
            __sync_fetch_and_add(nd, 1);
            h->flags |= F_FIRST;
            *first = 1;
            return 1;
        }
        v = agg.lookup(k);  // inserted by another CPU just now, or the map is full
        if (!v) {
            count_lost(run, K_AGG_MAP_FULL);  // not lost: recorded one by one, and counted
            return 1;
        }
    }
    __sync_fetch_and_add(&v->count, 1);
    if (h->ts > v->last)
        v->last = h->ts;
    if (h->ts < v->first)
        v->first = h->ts;
    if (!fd_changes)
        return 0;
    h->flags |= F_STATE;
    return 1;
}

// At exit: the result goes into the record, a path not resident at entry is read again, and the
// one record is emitted (or, for a key counted in `agg`, not).
// Settles a call whose token is in c->htok and emits its record if it is one.
static __always_inline int settle_and_emit(struct sys_exit_ctx *ctx, struct call *c) {
    struct akey k = {};
    int first = 0;
    if (!settle(ctx, c, &k, &first)) {
        c->ev.h.kind = 0;  // counted in `agg`, and nothing user space keeps changed
        return 0;
    }
    s64 ret = c->ev.open.ret;
    u32 tgid = c->ev.h.tgid;
    u32 kind = c->ev.h.kind;
    u32 oflags = c->ev.open.flags;
    if (kind == EV_OPEN && ret >= 0 && (oflags & WRITE_BITS_) && !(oflags & O_PATH_))
        c->ev.open.nlink = inode_nlink(c->ev.open.rino);  // a write open that is a record
    if (emit_call(c) != 0) {
        if (first) {  // the key's first record is lost (counted): its next occurrence is first
            agg.delete(&k);
            u32 *nd = distinct.lookup(&k.run);
            if (nd)
                __sync_fetch_and_add(nd, -1);
        }
        if (kind == EV_OPEN && ret >= 0) {
            struct pctx *p = procs.lookup(&tgid);
            if (p)
                set_fd_token(p, tgid, (s32)ret, 0, 0);  // user space did not see what fd names now
        }
    }
    return 0;
}

// The second half of on_exit, a program of its own (a tail call) so that the verifier walks the
// hash loop from one clean state instead of once per path through the first half. A successful
// open that is to be a record is named by the kernel first (settle).
int on_exit_hash(struct sys_exit_ctx *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct call *c = inflight.lookup(&tid);
    if (!c || c->ev.h.kind == 0)
        return 0;
    hash_name(c);
    return settle_and_emit(ctx, c);
}

// ---- the kernel's names ------------------------------------------------------------------
//
// A name is resolved by user space lexically against its base, which is wrong for a name with '..'
// after a component (that component may be a symlink or a /proc magic link: `/tmp/l/../passwd`
// with l -> /etc/ssh opens /etc/passwd, not /tmp/passwd), names a symlink's path rather than the
// file reached, and the probe reads the name from the job's memory before the kernel does
// (another thread can change it in between). So a successful open that becomes a record, and
// every chdir and fchdir (a cwd is always the kernel's name of it, and a relative name's leading
// '..' its real parent), carry the kernel's own name of what they reached (F_KNAME): the dentry
// chain of the file (or the new cwd) up to the process's root, across mounts, as d_path walks
// it. In summary an open's key has the inode it opened, so the repeats counted under a key are
// the same file and are not walked: only a key's first open is (settle); an open whose base
// the kernel cannot name is walked each time and aggregated by the kernel's name.

#define KNAME_MAX_ 2048  // bytes of a kernel name (with its NUL); a longer one is not given
#define KNAME_DEPTH_ 64  // dentries and mounts walked up; a deeper name is not given

// Writes the kernel's name of the file an open returned (ret) or of the new cwd (chdir, fchdir)
// after the record's path, with its NUL, and sets F_KNAME; nothing when the name cannot be had
// (not below the process's root, deeper than KNAME_DEPTH_, longer than KNAME_MAX_). The name is
// built backward in the call's record past open_ev.path (the union is as large as change_ev),
// then moved to just after the path. Reads race a concurrent rename as d_path's do without
// rename_lock: a name the file had, or its new one.
static __always_inline void kernel_name(struct call *c, s64 ret) {
    struct open_ev *e = &c->ev.open;
    u32 plen = e->path_len;
    if (plen > PATH_MAX_ - 1)
        return;
    char *task = (char *)bpf_get_current_task_btf();
    u64 fs = 0, vfsmnt = 0, dentry = 0, root_mnt = 0, root_dentry = 0;
    bpf_probe_read_kernel(&fs, sizeof(fs), task + 1816);
    if (!fs)
        return;
    bpf_probe_read_kernel(&root_mnt, 8, (void *)(fs + 24 + 0));
    bpf_probe_read_kernel(&root_dentry, 8, (void *)(fs + 24 + 8));
    if (c->ev.h.kind == EV_OPEN) {
        u64 file = fd_file((s32)ret);
        if (!file)
            return;
        bpf_probe_read_kernel(&vfsmnt, 8, (void *)(file + 64 + 0));
        bpf_probe_read_kernel(&dentry, 8, (void *)(file + 64 + 8));
    } else {
        bpf_probe_read_kernel(&vfsmnt, 8, (void *)(fs + 40 + 0));
        bpf_probe_read_kernel(&dentry, 8, (void *)(fs + 40 + 8));
    }
    if (!vfsmnt || !dentry)
        return;
    char *area = (char *)&c->ev + offsetof(struct open_ev, path) + PATH_MAX_;
    area[KNAME_MAX_ - 1] = 0;
    // the offset goes through the map value on each turn: the verifier then sees an unknown number
    // (each use is masked) and not a range per turn and way through it, which it cannot prune
    c->koff = KNAME_MAX_ - 1;
    u64 mnt = vfsmnt - 32;
    int named = 0;
#pragma clang loop unroll(disable)
    for (int i = 0; i < KNAME_DEPTH_; i++) {
        if (dentry == root_dentry && vfsmnt == root_mnt) {
            named = 1;
            break;
        }
        u64 mnt_root = 0, parent = 0;
        bpf_probe_read_kernel(&mnt_root, 8, (void *)(vfsmnt + 0));
        bpf_probe_read_kernel(&parent, 8, (void *)(dentry + 24));
        if (dentry == mnt_root) {  // up to where the mount is mounted
            u64 up = 0;
            bpf_probe_read_kernel(&up, 8, (void *)(mnt + 16));
            if (!up || up == mnt)
                break;  // the top of its mount tree, and the process's root was not met: no name
            bpf_probe_read_kernel(&dentry, 8, (void *)(mnt + 24));
            mnt = up;
            vfsmnt = mnt + 32;
            continue;
        }
        if (dentry == parent || !parent)
            break;  // a root that is not its mount's root
        u32 off = *(volatile u32 *)&c->koff;
        u32 qlen = 0;
        u64 qname = 0;
        bpf_probe_read_kernel(&qlen, 4, (void *)(dentry + 32 + 4));
        bpf_probe_read_kernel(&qname, 8, (void *)(dentry + 32 + 8));
        if (qlen == 0 || qlen > 255 || qlen + 1 > off)
            break;
        off -= qlen;
        u32 at = off & (KNAME_MAX_ - 1);
        barrier_var(at);
        u32 size = qlen & 255;
        barrier_var(size);
        bpf_probe_read_kernel(area + at, size, (void *)qname);
        off -= 1;
        area[off & (KNAME_MAX_ - 1)] = '/';
        *(volatile u32 *)&c->koff = off;
        dentry = parent;
    }
    if (!named)
        return;
    u32 off = *(volatile u32 *)&c->koff;
    if (off == KNAME_MAX_ - 1) {  // the root itself
        off -= 1;
        area[off & (KNAME_MAX_ - 1)] = '/';
    }
    u32 klen = KNAME_MAX_ - off;  // with the NUL
    char *dst = (char *)&c->ev + offsetof(struct open_ev, path) + (plen & (PATH_MAX_ - 1));
    klen &= 2 * KNAME_MAX_ - 1;
    barrier_var(klen);
    bpf_probe_read_kernel(dst, klen, area + (off & (KNAME_MAX_ - 1)));
    c->size = offsetof(struct open_ev, path) + plen + klen;
    e->h.flags |= F_KNAME;
    // an open whose name as given was not hashed (a '..', a magic link, an unknown base) or that
    // writes is aggregated by the kernel's name, which is what user space names it by: the same
    // name is the same record whatever the name as given was (a read's name as given, hashed
    // already, keeps its token: its key has the inode, see settle)
    u32 run = e->h.run;
    u32 *lim = limits.lookup(&run);
    if (c->ev.h.kind == EV_OPEN && lim && *lim != 0 && klen > 1 && c->hskip != 3) {
        c->hbase = 0x6b6e616d65ULL;  // "kname": apart from the names as given
        c->hlen = klen - 1;
        c->hoff = plen;
        c->hskip = 0;
    }
}

// The kernel's name of what a call reached, then on_exit_hash (which hashes the name only if
// prepare_hash said to, and settles the call): a program of its own, so that the verifier walks
// neither the walk's loop once per path through the rest nor the rest once per way out of the loop.
int on_exit_name(struct sys_exit_ctx *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct call *c = inflight.lookup(&tid);
    if (!c || c->ev.h.kind == 0)
        return 0;
    c->walked = 1;
    kernel_name(c, c->ev.open.ret);
    exit_tail.call(ctx, 0);
    emit_call(c);  // only if on_exit_hash is not in exit_tail (the loader puts it there first)
    return 0;
}

// ---- a paired call's exit and the results

static __always_inline void ns_exit(struct call *c);  // ---- namespaces and mounts

// An open's or chdir's path that was not resident at entry, read again now the kernel paged it in.
static __always_inline void refetch_path(struct call *c) {
    struct open_ev *e = &c->ev.open;
    int n = bpf_probe_read_user_str(e->path, sizeof(e->path), (const char *)c->refetch);
    c->refetch = 0;
    if (n > 0) {
        e->h.flags &= ~F_FNAME_FAULT;
        if (n == sizeof(e->path))
            e->h.flags |= F_PATH_TRUNC;
        set_path_len(c, n);
    } else {
        e->path[0] = 0;
    }
}

// At exit: the result goes into the record, a path not resident at entry is read again, and the
// one record is emitted (or, for a key counted in `agg`, not).
static __always_inline int finish_call(struct sys_exit_ctx *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct call *c = inflight.lookup(&tid);
    if (!c || c->ev.h.kind == 0 || c->nr != ctx->nr)
        return 0;
    c->ev.open.ret = ctx->ret;
    if (ctx->ret >= 0) {  // a new descriptor: what it names, for the identity checks
        if (c->ev.h.kind == EV_OPEN)
            c->ev.open.rino = fd_inode((s32)ctx->ret);
        else if (c->ev.h.kind == EV_DUP)
            c->ev.dup.rino = fd_inode((s32)ctx->ret);
        else if (c->ev.h.kind == EV_CHDIR || c->ev.h.kind == EV_FCHDIR)
            c->ev.open.rino = cwd_inode();  // the directory it changed to
    }
    if (c->ev.h.kind == EV_NS)
        ns_exit(c);
    if (c->ev.h.kind == EV_CHANGE || c->ev.h.kind == EV_NS) {
        struct change_ev *ce = &c->ev.change;
        if (ce->h.flags & (F_FNAME_FAULT | F_PATH2_FAULT)) {  // not resident at entry: read again
            ce->h.flags &= ~(F_FNAME_FAULT | F_PATH2_FAULT | F_PATH_TRUNC | F_PATH2_TRUNC);
            read_change_paths(c, (const char *)c->refetch, (const char *)c->refetch2);
            c->mfd = -1;  // the names read now (either may differ from entry's) have no identity
            c->mfd2 = -1;
        }
        c->refetch = 0;
        c->refetch2 = 0;
        // a magic link's descriptor that names another file at exit than at entry: the change
        // may have reached either, so neither is named
        if (c->ev.h.kind == EV_CHANGE) {
            if (ce->mino && (c->mfd < 0 || fd_inode(c->mfd) != ce->mino))
                ce->mino = 0;
            if (ce->mino2 && (c->mfd2 < 0 || fd_inode(c->mfd2) != ce->mino2))
                ce->mino2 = 0;
            // the file a descriptor names: fchmod's, fchown's, or path 1's magic link (a directory,
            // one with a name below it, has none)
            ce->nlink = inode_nlink(ce->mino ? ce->mino : ce->len1 == 0 ? ce->dino : 0);
        }
    } else if (c->refetch) {
        refetch_path(c);
    }
    prepare_hash(c);
    u32 kind = c->ev.h.kind;
    u32 run = c->ev.h.run;
    u32 *lim = limits.lookup(&run);
    int full = !lim || *lim == 0;  // --detail full: every open is a record, named by the kernel
    // (hskip 2: a base the kernel cannot name: no token of the name as given, a record each time,
    // named by the kernel and aggregated by that name; else settle walks a key's first open)
    if (ctx->ret >= 0 && ((kind == EV_OPEN && (full || c->hskip == 2)) || kind == EV_CHDIR || kind == EV_FCHDIR))
        exit_tail.call(ctx, 1);  // on_exit_name: the kernel's name, then the hash and the record
    if (c->hskip == 0)
        exit_tail.call(ctx, 0);
    // no hash needed, or the tail call failed: without a token, a plain record
    c->htok = 0;
    return settle_and_emit(ctx, c);
}

// openat's exit, the one nearly every open takes: finish_call's way for an open, with the name's
// hash here rather than in on_exit_hash (a tail call, and the thread's call looked up again, saved
// on every open: this program has no other kind of call to verify the hash loop after). Anything
// else goes to on_exit (exit_tail 2).
int on_exit_openat(struct sys_exit_ctx *ctx) {
    char *task = (char *)bpf_get_current_task_btf();
    u32 tid = (u32)task_pid_tgid(task);
    struct call *c = inflight.lookup(&tid);
    if (!c || c->ev.h.kind == 0 || c->nr != ctx->nr)
        return 0;
    if (c->ev.h.kind != EV_OPEN) {
        exit_tail.call(ctx, 2);
        return 0;
    }
    c->ev.open.ret = ctx->ret;
    if (ctx->ret >= 0)  // the new descriptor: what it names, for the identity checks
        c->ev.open.rino = task_fd_inode(task, (s32)ctx->ret);
    if (c->refetch)
        refetch_path(c);
    prepare_hash(c);
    u32 run = c->ev.h.run;
    u32 *lim = limits.lookup(&run);
    if (ctx->ret >= 0 && (!lim || *lim == 0 || c->hskip == 2))
        exit_tail.call(ctx, 1);  // on_exit_name (as finish_call)
    hash_name(c);
    return settle_and_emit(ctx, c);
}

// ---- results -----------------------------------------------------------------------------

int on_exit(struct sys_exit_ctx *ctx) {
    switch (ctx->nr) {
    case __NR_execve:
    case __NR_execveat:
        return emit_ret(SC_EXEC, ctx->ret);
    }
    return finish_call(ctx);
}

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
    switch (ctx->nr) {
    // attached to openat2 (4 arguments), open (3) and creat (2)
    case __NR_openat2: {
        u64 how[3] = {};  // struct open_how: flags, mode, resolve
        bpf_probe_read_user(how, sizeof(how), (void *)arg_beyond(ctx, 2));
        return enter_open(ctx->nr, (s32)ctx->args[0], (const char *)ctx->args[1], (u32)how[0], (u32)how[1], 1, how[2]);
    }
#ifdef __NR_open
    case __NR_open:
        return enter_open(ctx->nr, -100, (const char *)ctx->args[0], (u32)ctx->args[1], (u32)arg_beyond(ctx, 2), 2, 0);
#endif
#ifdef __NR_creat
    case __NR_creat:
        // creat(path, mode) == open(path, O_CREAT|O_WRONLY|O_TRUNC, mode)
        return enter_open(ctx->nr, -100, (const char *)ctx->args[0], 01 | 0100 | 01000, (u32)ctx->args[1], 3, 0);
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
    e->dino = e->buf[0] == '/' ? 0 : dir_inode(dfd);
    u32 alen = read_argv(e, n & (PATH_MAX_ - 1), argv);
    e->args_len = alen;
    u64 size = offsetof(struct exec_ev, buf) + ((n + alen) & BUF_MASK);
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
    bpf_probe_read_kernel(&mm, sizeof(mm), (void *)task + 1136);
    e->dev = 0;
    e->ino = 0;
    e->size = 0;
    e->ctime_sec = 0;
    e->ctime_nsec = 0;
    if (mm) {
        bpf_probe_read_kernel(&start, sizeof(start), mm + 480);
        bpf_probe_read_kernel(&end, sizeof(end), mm + 488);
        void *file = NULL, *inode = NULL, *sb = NULL;
        bpf_probe_read_kernel(&file, sizeof(file), mm + 1312);
        if (file)
            bpf_probe_read_kernel(&inode, sizeof(inode), file + 32);
        if (inode) {
            bpf_probe_read_kernel(&e->ino, sizeof(e->ino), inode + 64);
            bpf_probe_read_kernel(&e->size, sizeof(e->size), inode + 80);
            bpf_probe_read_kernel(&e->ctime_sec, sizeof(e->ctime_sec), inode + 104);
            bpf_probe_read_kernel(&e->ctime_nsec, sizeof(e->ctime_nsec), inode + 120);
            bpf_probe_read_kernel(&sb, sizeof(sb), inode + 40);
            if (sb)
                bpf_probe_read_kernel(&e->dev, sizeof(e->dev), sb + 16);
        }
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
    // the program's token: its name when absolute (equal names, equal programs), else random
    struct pctx *p = proc_ctx(e->h.tgid);
    if (p) {
        u64 t = 0;
        if (e->buf[0] == '/' && n > 1)
            t = name_token(0, e->buf, (n - 1) & (PATH_MAX_ - 1));
        p->exe = t ? t : random_token();
    }
    u64 size = offsetof(struct exec_ev, buf) + ((off + len) & BUF_MASK);
    return emit(e, size, run, EV_EXEC_OK);
}

static __always_inline void ns_fork(u32 run, u32 child);  // ---- namespaces and mounts

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
    bpf_probe_read_kernel(&code, sizeof(code), (void *)task + 1164);
    e->exit_code = code;
    e->pad = 0;
    // exits are rare and end a run's last process: always wake the consumer
    events.ringbuf_submit(e, BPF_RB_FORCE_WAKEUP);
    return 0;
}

// ---- refused system calls ----------------------------------------------------------------

// A system call through a 32-bit entry (i386: `int $0x80`, `sysenter`, `syscall` from 32-bit code;
// x32), which the syscalls:* tracepoints skip, is refused by the seccomp filter every command
// evidence launches gets (policy/landlock_syscalls.py compat_filter): the call is not made and the
// thread gets SIGSYS with si_code SYS_SECCOMP. Its generation is recorded here: which call of which
// architecture was refused. A signal is rare: this program costs nothing on a system call.
#define SIGSYS_ 31
#define SYS_SECCOMP_ 1
#define AUDIT_ARCH_X86_64_ 0xC000003E
#define AUDIT_ARCH_AARCH64_ 0xC00000B7
#define X32_SYSCALL_BIT_ 0x40000000

struct sigsys_ev {
    struct hdr h;
    s32 nr;      // si_syscall: the call's number in its architecture's table
    u32 arch;    // si_arch: AUDIT_ARCH_*
    u64 ip;      // si_call_addr: the address of the instruction after the call
};

// the head of a kernel_siginfo as the UAPI lays it out on 64-bit (a stable ABI): _sigsys's fields
struct siginfo_sys {
    s32 signo;
    s32 err;
    s32 code;
    s32 pad;
    u64 call_addr;
    s32 syscall;
    u32 arch;
};

RAW_TRACEPOINT_PROBE(signal_generate) {  // (int sig, struct kernel_siginfo *info, struct task_struct *task, ...)
    if ((s32)ctx->args[0] != SIGSYS_ || ctx->args[1] < 4096)  // SEND_SIG_NOINFO, SEND_SIG_PRIV: 0, 1
        return 0;
    if (ctx->args[2] != bpf_get_current_task())  // seccomp signals the calling thread itself
        return 0;
    u32 run = current_run();
    if (!run)
        return 0;
    struct siginfo_sys si = {};
    if (bpf_probe_read_kernel(&si, sizeof(si), (void *)ctx->args[1]) != 0 || si.code != SYS_SECCOMP_)
        return 0;
    // a native call refused by a filter of the job's own (a sandbox of its own traps calls too)
    if (si.arch == AUDIT_ARCH_AARCH64_ || (si.arch == AUDIT_ARCH_X86_64_ && !(si.syscall & X32_SYSCALL_BIT_)))
        return 0;
    struct sigsys_ev e = {};
    fill(&e.h, run, EV_SIGSYS);
    e.nr = si.syscall;
    e.arch = si.arch;
    e.ip = si.call_addr;
    // rare, and it may end the run's last process: always wake the consumer
    if (events.ringbuf_output(&e, sizeof(e), BPF_RB_FORCE_WAKEUP) != 0)
        count_lost(run, EV_SIGSYS);
    return 0;
}

// ---- network -----------------------------------------------------------------------------

// ---- dns: defined in its section below; connect and the sends run it first (BCC keeps one program
// per tracepoint, so the DNS work on a shared tracepoint is a call, not a program of its own)
static __always_inline int dns_enter(struct sys_enter_ctx *ctx);

// A connect record for socket fd and the sockaddr at addr (of len bytes), completed at exit.
static __always_inline int enter_sockaddr(u32 run, s32 nr, u16 flags, s32 fd, const void *addr, u32 len) {
    struct call *c = begin_call(run, EV_CONNECT, nr);
    if (!c)
        return 0;
    struct connect_ev *e = &c->ev.conn;
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
    e->pad = 0;
    e->pad2 = 0;
    // AF_UNIX (1) with a path that is not absolute (nor abstract: a NUL first): it names a file in
    // the cwd, so the cwd is part of what it names
    e->dino = n > 2 && e->addr[0] == 1 && e->addr[1] == 0 && e->addr[2] != '/' && e->addr[2] != 0 ? cwd_inode() : 0;
    c->size = sizeof(struct connect_ev);
    return 0;
}

// Data sent to an explicit address without connect(): UDP sendto/sendmsg/sendmmsg, TCP Fast Open
// (sendto with MSG_FASTOPEN). Recorded as a connect to that address (the same record, with F_SEND);
// a send on a connected socket (no address) is not, and its exit finds no call in flight.
static __always_inline int enter_send(s32 nr, s32 fd, const void *addr, u32 len) {
    if (!addr || len == 0)
        return 0;
    u32 run = current_run();
    if (!run)
        return 0;
    return enter_sockaddr(run, nr, F_SEND, fd, addr, len);
}

int on_enter_send(struct sys_enter_ctx *ctx) {
    // attached to sendto (6 arguments), sendmsg (3) and sendmmsg (4)
    dns_enter(ctx);
    if (ctx->nr == __NR_sendto)
        return enter_send(ctx->nr, (s32)ctx->args[0], (const void *)arg_beyond(ctx, 4), (u32)arg_beyond(ctx, 5));
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
    return enter_send(ctx->nr, (s32)ctx->args[0], (const void *)h.name, h.namelen);
}

int on_enter_connect(struct sys_enter_ctx *ctx) {
    dns_enter(ctx);
    u32 run = current_run();
    if (run)
        enter_sockaddr(run, ctx->nr, 0, (s32)ctx->args[0], (const void *)ctx->args[1], (u32)ctx->args[2]);
    return 0;
}

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

// ---- file changes that are not opens ------------------------------------------------------

// A change through a magic link of the process's own descriptors (`truncate /proc/self/fd/3`,
// `mkdir /proc/self/fd/3/sub` with 3 an O_PATH directory; /dev/fd/N, /proc/thread-self/fd/N,
// /proc/<pid>[/task/<tid>]/fd/N, and relative: fd/N from /proc/<pid>, N from a .../fd directory)
// changes the file descriptor N names, whatever name it was opened by. The probe does not decide
// whether a name is such a link (user space does, from the resolved name); it reads the number N
// of a name's first component of digits that is its first component or follows a component `fd`
// (within its first MAGIC_SCAN_ bytes), -1 when there is none, and records what descriptor N
// names (magic_inode), so user space names the change after its table's entry for N while N
// still names that file. names.magic_fd reads a name the same way: change both together.
#define MAGIC_SCAN_ 48
#define FD_SLASH_ 0x66642f  // "fd/", the three bytes before a candidate

// The number of the descriptor the name at e->buf[base] reaches through a magic link, -1: none.
static __always_inline s32 magic_fd(struct change_ev *e, u32 base) {
    u32 w = 0, at = 0;  // w: the four bytes before position i
    int found = 0;
#pragma clang loop unroll(disable)
    for (u32 i = 0; i < MAGIC_SCAN_; i++) {
        u8 ch = e->buf[(base + i) & (2 * PATH_MAX_ - 1)];
        if (ch == 0)
            break;
        if (ch >= '0' && ch <= '9' && (i == 0 || ((w & 0xffffff) == FD_SLASH_ && (i == 3 || (w >> 24) == '/')))) {
            at = i;
            found = 1;
            break;
        }
        w = (w << 8) | ch;
    }
    if (!found)
        return -1;
    s32 n = 0;
#pragma clang loop unroll(disable)
    for (u32 j = 0; j < 10; j++) {  // at most 9 digits, then '/' or the end of the name
        u8 ch = e->buf[(base + at + j) & (2 * PATH_MAX_ - 1)];
        if (ch == '/' || ch == 0)
            return n;
        if (ch < '0' || ch > '9' || j == 9)
            return -1;
        n = n * 10 + (ch - '0');
    }
    return -1;
}

static __always_inline int enter_change(s32 nr, u16 op, s32 dfd, const char *p1, s32 dfd2, const char *p2, u32 mode, u32 uid, u32 gid, u32 at_flags) {
    u32 run = current_run();
    if (!run)
        return 0;
    struct call *c = begin_call(run, EV_CHANGE, nr);
    if (!c)
        return 0;
    struct change_ev *e = &c->ev.change;
    e->dfd = dfd;
    e->dfd2 = dfd2;
    e->mode = mode;
    e->nlink = 0;
    e->uid = uid;
    e->gid = gid;
    e->at_flags = at_flags;
    e->op = op;
    e->pad = 0;
    read_change_paths(c, p1, p2);
    // what the dirfds, or the cwd, name now (fchmod, fchown: the descriptor itself); rare calls:
    // read for any path
    e->dino = dir_inode(dfd);
    e->dino2 = p2 ? dir_inode(dfd2) : 0;
    // a name through a magic link: what its descriptor names (checked again at exit: finish_call)
    c->mfd = e->len1 ? magic_fd(e, 0) : -1;
    c->mfd2 = e->len2 ? magic_fd(e, e->len1) : -1;
    e->mino = c->mfd >= 0 ? fd_inode(c->mfd) : 0;
    e->mino2 = c->mfd2 >= 0 ? fd_inode(c->mfd2) : 0;
    return 0;
}

#define A(i) arg_beyond(ctx, i)
#define P(i) ((const char *)arg_beyond(ctx, i))

int on_enter_change(struct sys_enter_ctx *ctx) {
    // attached to every call below; arguments past the first are read with arg_beyond, since the
    // tracepoints sharing this handler have from 1 (unlink) to 5 (renameat2, linkat) arguments
    s32 nr = ctx->nr;
    const char *a0 = (const char *)ctx->args[0];
    // the call's operands, then one enter_change (written once: the verifier walks it once)
    u16 op = 0;
    s32 dfd = -100, dfd2 = 0;
    const char *p1 = a0, *p2 = NULL;
    u32 mode = 0, uid = 0, gid = 0, fl = 0;
    switch (nr) {
#ifdef __NR_rename
    case __NR_rename:
        op = CH_RENAME; dfd2 = -100; p2 = P(1);
        break;
#endif
    case __NR_renameat:
        op = CH_RENAME; dfd = (s32)ctx->args[0]; p1 = P(1); dfd2 = (s32)A(2); p2 = P(3);
        break;
    case __NR_renameat2:
        op = CH_RENAME; dfd = (s32)ctx->args[0]; p1 = P(1); dfd2 = (s32)A(2); p2 = P(3); fl = (u32)A(4);
        break;
#ifdef __NR_unlink
    case __NR_unlink:
        op = CH_UNLINK;
        break;
#endif
    case __NR_unlinkat:
        fl = (u32)A(2);
        op = (fl & 0x200) ? CH_RMDIR : CH_UNLINK; dfd = (s32)ctx->args[0]; p1 = P(1);
        break;
#ifdef __NR_rmdir
    case __NR_rmdir:
        op = CH_RMDIR;
        break;
#endif
#ifdef __NR_link
    case __NR_link:
        op = CH_LINK; dfd2 = -100; p2 = P(1);
        break;
#endif
    case __NR_linkat:
        op = CH_LINK; dfd = (s32)ctx->args[0]; p1 = P(1); dfd2 = (s32)A(2); p2 = P(3); fl = (u32)A(4);
        break;
#ifdef __NR_symlink
    case __NR_symlink:  // path 1: the target, as given (not resolved); path 2: the link made
        op = CH_SYMLINK; dfd2 = -100; p2 = P(1);
        break;
#endif
    case __NR_symlinkat:
        op = CH_SYMLINK; dfd2 = (s32)A(1); p2 = P(2);
        break;
    case __NR_truncate:
        op = CH_TRUNCATE;
        break;
#ifdef __NR_chmod
    case __NR_chmod:
        op = CH_CHMOD; mode = (u32)A(1);
        break;
#endif
    case __NR_fchmod:
        op = CH_CHMOD; dfd = (s32)ctx->args[0]; p1 = NULL; mode = (u32)A(1);
        break;
    case __NR_fchmodat:
        op = CH_CHMOD; dfd = (s32)ctx->args[0]; p1 = P(1); mode = (u32)A(2);
        break;
#ifdef __NR_fchmodat2
    case __NR_fchmodat2:
        op = CH_CHMOD; dfd = (s32)ctx->args[0]; p1 = P(1); mode = (u32)A(2); fl = (u32)A(3);
        break;
#else
    case 452:  // fchmodat2 (x86_64), newer than these headers
        op = CH_CHMOD; dfd = (s32)ctx->args[0]; p1 = P(1); mode = (u32)A(2); fl = (u32)A(3);
        break;
#endif
#ifdef __NR_chown
    case __NR_chown:
        op = CH_CHOWN; uid = (u32)A(1); gid = (u32)A(2);
        break;
#endif
#ifdef __NR_lchown
    case __NR_lchown:  // as fchownat(AT_FDCWD, path, uid, gid, AT_SYMLINK_NOFOLLOW)
        op = CH_CHOWN; uid = (u32)A(1); gid = (u32)A(2); fl = 0x100;
        break;
#endif
    case __NR_fchown:
        op = CH_CHOWN; dfd = (s32)ctx->args[0]; p1 = NULL; uid = (u32)A(1); gid = (u32)A(2);
        break;
    case __NR_fchownat:
        op = CH_CHOWN; dfd = (s32)ctx->args[0]; p1 = P(1); uid = (u32)A(2); gid = (u32)A(3); fl = (u32)A(4);
        break;
#ifdef __NR_mkdir
    case __NR_mkdir:
        op = CH_MKDIR; mode = (u32)A(1);
        break;
#endif
    case __NR_mkdirat:
        op = CH_MKDIR; dfd = (s32)ctx->args[0]; p1 = P(1); mode = (u32)A(2);
        break;
#ifdef __NR_mknod
    case __NR_mknod:
        op = CH_MKNOD; mode = (u32)A(1);
        break;
#endif
    case __NR_mknodat:
        op = CH_MKNOD; dfd = (s32)ctx->args[0]; p1 = P(1); mode = (u32)A(2);
        break;
    default:
        return 0;
    }
    return enter_change(nr, op, dfd, p1, dfd2, p2, mode, uid, gid, fl);
}

#undef A
#undef P

// ---- namespaces and mounts -----------------------------------------------------------------
//
// unshare, setns, clone/clone3 with a namespace flag, mount, move_mount, open_tree, fsmount,
// pivot_root and chroot by a run's processes, and ptrace (attach, seize, poke) and
// process_vm_writev with their target: rare calls, each one record (EV_NS, paired like a change).
// A process whose call changes what its paths name (a new mount or user namespace, a mount, a
// chroot, setns) is marked in `nsmark` when the call succeeds, and so is the child of a clone into
// a new mount or user namespace, and every child of a marked process (fork): every later record of
// it carries F_OTHER_NS, and its opens and connects are never aggregated with the run's own.

#define NS_UNSHARE 1
#define NS_SETNS 2
#define NS_CLONE 3
#define NS_MOUNT 4
#define NS_MOVE_MOUNT 5
#define NS_OPEN_TREE 6
#define NS_FSMOUNT 7
#define NS_PIVOT_ROOT 8
#define NS_CHROOT 9
#define NS_PTRACE 10
#define NS_VM_WRITE 11

#define CLONE_NEWTIME_ 0x00000080ULL  // clone3 and unshare only (clone's low byte is the exit signal)
#define CLONE_NEWNS_ 0x00020000ULL
#define CLONE_NEWUSER_ 0x10000000ULL
#define NS_FLAGS_ (0x00020000ULL | 0x02000000ULL | 0x04000000ULL | 0x08000000ULL | 0x10000000ULL | 0x20000000ULL | 0x40000000ULL)
#define NS_PATH_FLAGS_ (CLONE_NEWNS_ | CLONE_NEWUSER_)  // the namespaces that change what a path names

static __always_inline int enter_ns(s32 nr, u16 op, u64 flags, u64 target, s32 dfd, const char *p1, s32 dfd2, const char *p2) {
    u32 run = current_run();
    if (!run)
        return 0;
    struct call *c = begin_call(run, EV_NS, nr);
    if (!c)
        return 0;
    struct ns_ev *e = &c->ev.ns;
    e->flags = flags;
    e->target = target;
    e->dfd = dfd;
    e->dfd2 = dfd2;
    __builtin_memset(e->fstype, 0, sizeof(e->fstype));
    e->op = op;
    e->pad = 0;
    read_change_paths(c, p1, p2);
    // what the dirfds, or the cwd, name now (rare calls: read for any path, like a change's)
    e->dino = p1 ? dir_inode(dfd) : 0;
    e->dino2 = p2 ? dir_inode(dfd2) : 0;
    return 0;
}

#define A(i) arg_beyond(ctx, i)
#define P(i) ((const char *)arg_beyond(ctx, i))

int on_enter_ns(struct sys_enter_ctx *ctx) {
    // attached to every call below (from 1 argument, unshare and chroot, to 6); arguments past the
    // first are read with arg_beyond
    s32 nr = ctx->nr;
    u64 a0 = ctx->args[0];
    switch (nr) {
    case __NR_unshare:
        if (!(a0 & (NS_FLAGS_ | CLONE_NEWTIME_)))
            return 0;
        return enter_ns(nr, NS_UNSHARE, a0, 0, 0, NULL, 0, NULL);
    case __NR_setns:
        return enter_ns(nr, NS_SETNS, (u32)A(1), (s32)a0, 0, NULL, 0, NULL);
    case __NR_clone:
        if (!(a0 & NS_FLAGS_))
            return 0;  // almost every clone: no record
        // without the low byte (clone's exit signal; clone3's CLONE_NEWTIME)
        return enter_ns(nr, NS_CLONE, a0 & ~0xFFULL, 0, 0, NULL, 0, NULL);
    case __NR_clone3: {
        u64 fl = 0;
        if (bpf_probe_read_user(&fl, sizeof(fl), (void *)a0) != 0 || !(fl & (NS_FLAGS_ | CLONE_NEWTIME_)))
            return 0;
        return enter_ns(nr, NS_CLONE, fl, 0, 0, NULL, 0, NULL);
    }
    case __NR_mount: {
        enter_ns(nr, NS_MOUNT, (u32)A(3), 0, -100, (const char *)a0, -100, P(1));
        u32 tid = (u32)bpf_get_current_pid_tgid();
        struct call *c = inflight.lookup(&tid);
        const char *type = P(2);
        if (c && c->ev.h.kind == EV_NS && type)
            bpf_probe_read_user_str(c->ev.ns.fstype, sizeof(c->ev.ns.fstype), type);
        return 0;
    }
    case __NR_move_mount:
        return enter_ns(nr, NS_MOVE_MOUNT, (u32)A(4), 0, (s32)a0, P(1), (s32)A(2), P(3));
    case __NR_open_tree:
        return enter_ns(nr, NS_OPEN_TREE, (u32)A(2), 0, (s32)a0, P(1), 0, NULL);
    case __NR_fsmount:
        return enter_ns(nr, NS_FSMOUNT, (u32)A(1), (s32)a0, 0, NULL, 0, NULL);
    case __NR_pivot_root:
        return enter_ns(nr, NS_PIVOT_ROOT, 0, 0, -100, (const char *)a0, -100, P(1));
    case __NR_chroot:
        return enter_ns(nr, NS_CHROOT, 0, 0, -100, (const char *)a0, 0, NULL);
    case __NR_ptrace:
        // attach, seize, and writes to the tracee's memory or user area: poketext, pokedata, pokeuser
        if (a0 != 16 && a0 != 0x4206 && a0 != 4 && a0 != 5 && a0 != 6)
            return 0;
        return enter_ns(nr, NS_PTRACE, a0, (u32)A(1), 0, NULL, 0, NULL);
    case __NR_process_vm_writev:
        return enter_ns(nr, NS_VM_WRITE, 0, (u32)a0, 0, NULL, 0, NULL);
    }
    return 0;
}

#undef A
#undef P

// Marks process tgid (counted in nslive once, however often it is marked); a mark that cannot be
// made is counted as lost, so the bundle says events may be missing a mark.
static __always_inline void ns_mark(u32 tgid, u32 run) {
    u8 one = 1;
    int err = nsmark.insert(&tgid, &one);
    if (err == 0) {
        u32 zero = 0;
        u64 *marks = nslive.lookup(&zero);
        if (marks)
            __sync_fetch_and_add(marks, 1);
    } else if (err != -17) {  // -EEXIST: marked already
        count_lost(run, EV_NS);
    }
}

// At exit, before the record is emitted: a successful call that changes what the process's paths
// name marks it (its record itself is not marked: it was filled at entry).
static __always_inline void ns_exit(struct call *c) {
    struct ns_ev *e = &c->ev.ns;
    if (e->ret < 0)
        return;
    u16 op = e->op;
    if (op == NS_PTRACE || op == NS_VM_WRITE || op == NS_CLONE)
        return;  // clone: its child is marked at fork (ns_fork)
    if (op == NS_UNSHARE && !(e->flags & NS_PATH_FLAGS_))
        return;
    if (op == NS_SETNS && e->flags != 0 && !(e->flags & NS_PATH_FLAGS_))
        return;  // setns into a namespace of another type (nstype 0: any, a pidfd's)
    ns_mark(e->h.tgid, e->h.run);
}

// At fork (in the parent): the child of a marked process is marked, and so is the child of a
// clone into a new mount or user namespace (the parent's clone is still in flight).
static __always_inline void ns_fork(u32 run, u32 child) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!nsmark.lookup(&tgid)) {
        struct call *c = inflight.lookup(&tid);
        if (!c || c->ev.h.kind != EV_NS || c->ev.ns.op != NS_CLONE || !(c->ev.ns.flags & NS_PATH_FLAGS_))
            return;
    }
    ns_mark(child, run);
}

// ---- dns ---------------------------------------------------------------------------------
//
// DNS messages of the run's processes, read from their buffers: what is sent on a socket connected
// (or sending) to port 53, and what is then received on it. `dnsfds` holds the sockets: (tgid, fd)
// -> the server and the socket's identity (fd_inode), set when a tracked process connects a socket
// to port 53 or sends to port 53 with an explicit address, cleared when it connects the socket
// elsewhere or when the descriptor is found naming another file (closed and its number reused, or
// replaced by dup2 or a received descriptor: close is not traced, which spares every close on the
// machine a tracepoint program). `dnscount` counts them per tgid bucket (tgid mod 65536, at least
// the sockets there: an entry the LRU map drops, a socket closed, or a process that exits leaves it
// high, never low), so every other read, write, send and receive costs one array element read
// (inlined by the verifier), and a process in a bucket with a DNS socket one hash lookup more (and
// one fd_inode read when the lookup finds an entry). A sent message is read at entry (the
// record's ret is the length given), a received one at exit (ret: the result). User space parses
// them (a hostile job sends what it likes to port 53: the bytes are data, never trusted).
//
// What a receive read from the job's buffer says nothing of where it came from, and another
// thread of the job can rewrite the buffer between the kernel's copy and the exit. So the kernel's
// own copy is recorded too: `on_dns_ingress`, a cgroup program attached to each run's cgroup
// (inet ingress, beside any other), sees every packet delivered to a socket of the run and records
// (DNS_DELIVERED) the UDP datagrams that come from port 53 or are shaped as a DNS answer (QR set,
// one question), and the TCP segments from port 53, with their source, the receiving socket's
// cookie and their first bytes. A received message carries its socket's cookie (read at exit
// through the descriptor, BTF offsets): user space credits it only when its bytes are ones the
// kernel delivered to that socket (agent/recorder/dns.py).

struct dns_ev {
    struct hdr h;
    s64 ret;       // sent: the length given; received: the call's result; delivered: the payload's length
    s32 fd;        // delivered: -1
    u16 dir;       // DNS_SENT, DNS_RECEIVED or DNS_DELIVERED
    u16 len;       // bytes of message that follow (at most DNS_MAX_; delivered: 2 * DNS_MAX_ - 1)
    u8 addr[28];   // sent, received: the server the socket's queries go to; delivered: the source
                   // (sockaddr_in or sockaddr_in6; family 0: not known)
    u32 seq;       // delivered over TCP: the segment's sequence number
    u64 sock;      // sent, received: the socket (the inode's address dnsfds keeps for it)
    u64 cookie;    // received: the socket's cookie (0: none yet, or not a socket); delivered: the
                   // receiving socket's
    u8 proto;      // delivered: IPPROTO_UDP or IPPROTO_TCP
    u8 tcp;        // delivered over TCP: the segment's flags (SYN: seq is the stream's start - 1)
    u16 pad;
    u32 pad2;
    u8 data[2 * DNS_MAX_];  // twice the bound, so the verifier can check a masked length
};

struct dnsfd {
    u64 gen;       // the process's generation (procs): a reused pid is another process
    u64 ino;       // what the descriptor named when it was marked (fd_inode): the socket
    u8 addr[28];
    u32 pad;
};

// A receive on a DNS socket between its enter and its exit, per thread.
struct dnsrecv {
    u64 buf;       // where the message goes (recvmsg: the first iovec's base)
    u64 cap;       // its size
    u64 vec;       // recvmmsg: the mmsghdr array (each message's length is read at exit)
    s32 fd;
    s32 nr;
};

// Shared by every run, and a closed socket's entry stays until the LRU drops it (close is not
// traced): large, so that a job churning sockets to port 53 must make 65,536 of them to push
// another's live entry out (about 7 MB of kernel memory)
BPF_TABLE("lru_hash", u64, struct dnsfd, dnsfds, 65536);
BPF_TABLE("lru_hash", u32, struct dnsrecv, dnsrecvs, 4096);
BPF_PERCPU_ARRAY(scratch_dns, struct dns_ev, 1);
// on_dns_ingress's own: it runs in softirq, which can interrupt a tracepoint program on the CPU
BPF_PERCPU_ARRAY(scratch_dns_in, struct dns_ev, 1);
BPF_ARRAY(dnscount, u32, 65536);

// Whether a process of tgid's bucket may have a DNS socket (the fast path: no hash lookup).
static __always_inline int dns_maybe(u32 tgid) {
    u32 i = tgid & 0xFFFF;
    u32 *n = dnscount.lookup(&i);
    return n && *n != 0;
}

static __always_inline void dns_count(u32 tgid, int delta) {
    u32 i = tgid & 0xFFFF;
    u32 *n = dnscount.lookup(&i);
    if (n && (delta > 0 || *n > 0))
        __sync_fetch_and_add(n, delta);
}

// Forgets fd of tgid as a DNS socket.
static __always_inline void dns_forget(u32 tgid, s32 fd) {
    if (!dns_maybe(tgid))
        return;
    u64 k = fd_key(tgid, fd);
    if (dnsfds.delete(&k) == 0)
        dns_count(tgid, -1);
}

// The socket's entry when fd of the current process is a DNS socket.
static __always_inline struct dnsfd *dns_fd(s32 fd) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!dns_maybe(tgid))
        return NULL;
    u64 k = fd_key(tgid, fd);
    struct dnsfd *d = dnsfds.lookup(&k);
    if (!d)
        return NULL;
    struct pctx *p = procs.lookup(&tgid);
    // left by an earlier process of this pid, or the number names another file now
    if (!p || p->gen != d->gen || fd_inode(fd) != d->ino) {
        dns_forget(tgid, fd);
        return NULL;
    }
    return d;
}

// Whether the sockaddr at uaddr (len bytes) is an IPv4 or IPv6 address with port 53; copied to out.
static __always_inline int dns_port(const void *uaddr, u32 len, u8 *out) {
    if (!uaddr || len < 8)
        return 0;
    u8 a[28] = {};
    u32 n = len > sizeof(a) ? sizeof(a) : len;
    barrier_var(n);
    n &= 0x1F;
    if (n > sizeof(a))
        n = sizeof(a);
    if (bpf_probe_read_user(a, n, uaddr) != 0)
        return 0;
    u16 family = a[0] | (a[1] << 8);
    if ((family != 2 && family != 10) || a[2] != 0 || a[3] != 53)
        return 0;
    __builtin_memcpy(out, a, sizeof(a));
    return 1;
}

// Marks fd as a DNS socket with server addr (or unmarks it: addr NULL); the socket's identity
// (fd_inode), 0 when unmarked or not kept.
static __always_inline u64 dns_mark(s32 fd, const u8 *addr) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!addr) {
        dns_forget(tgid, fd);
        return 0;
    }
    u64 k = fd_key(tgid, fd);
    struct pctx *p = proc_ctx(tgid);
    if (!p)
        return 0;
    struct dnsfd d = {.gen = p->gen, .ino = fd_inode(fd)};
    __builtin_memcpy(d.addr, addr, sizeof(d.addr));
    if (dnsfds.insert(&k, &d) == 0)
        dns_count(tgid, 1);  // a new entry (an existing one is updated without counting it again)
    else
        dnsfds.update(&k, &d);
    return d.ino;
}

// The cookie of the socket whose inode is at ino, which descriptor fd names (dns_fd checked it at
// this exit): file->private_data (struct socket) ->sk->sk_cookie, BTF offsets. The ingress program
// gives every socket it sees a cookie (bpf_get_socket_cookie), so a socket a message was delivered
// to has one. 0: the inode is not a socket's (a job can connect() any descriptor: the mark is made
// at entry), or the socket has no cookie yet.
static __always_inline u64 dns_cookie(u64 ino, s32 fd) {
    u16 mode = 0;
    if (!ino || bpf_probe_read_kernel(&mode, sizeof(mode), (void *)(ino + 0)) != 0)
        return 0;
    if ((mode & 0170000) != 0140000)  // S_IFSOCK
        return 0;
    u64 file = fd_file(fd), sock = 0, sk = 0, cookie = 0;
    if (!file || bpf_probe_read_kernel(&sock, sizeof(sock), (void *)(file + 24)) != 0 || !sock)
        return 0;
    if (bpf_probe_read_kernel(&sk, sizeof(sk), (void *)(sock + 24)) != 0 || !sk)
        return 0;
    bpf_probe_read_kernel(&cookie, sizeof(cookie), (void *)(sk + 88));
    return cookie;
}

// One DNS record: len bytes of the message at buf (user memory), to or from the server at addr, on
// the socket `sock` (its identity) with cookie `cookie` (a receive's; 0 for a send).
static __always_inline int dns_emit(u32 run, s32 fd, u16 dir, s64 ret, u64 buf, u64 len, const u8 *addr,
                                    u64 sock, u64 cookie) {
    u32 zero = 0;
    struct dns_ev *e = scratch_dns.lookup(&zero);
    if (!e)
        return 0;
    fill(&e->h, run, EV_DNS);
    e->ret = ret;
    e->fd = fd;
    e->dir = dir;
    e->seq = 0;
    e->sock = sock;
    e->cookie = cookie;
    e->proto = 0;
    e->tcp = 0;
    e->pad = 0;
    e->pad2 = 0;
    __builtin_memcpy(e->addr, addr, sizeof(e->addr));
    u32 n = len > DNS_MAX_ ? DNS_MAX_ : len;
    barrier_var(n);
    n &= 2 * DNS_MAX_ - 1;
    if (n > 0 && bpf_probe_read_user(e->data, n, (const void *)buf) != 0) {
        e->h.flags |= F_FNAME_FAULT;  // not in memory: recorded without its bytes
        n = 0;
    }
    e->len = n;
    u64 size = offsetof(struct dns_ev, data) + (n & (2 * DNS_MAX_ - 1));
    return emit(e, size, run, EV_DNS);
}

// The first iovec of a message (a 2-byte first iovec is a DNS-over-TCP length: the second then).
static __always_inline void dns_iov(u64 iov, u64 iovlen, u64 *buf, u64 *len) {
    struct { u64 base; u64 len; } v[2] = {};
    *buf = 0;
    *len = 0;
    if (!iov || iovlen == 0 || bpf_probe_read_user(&v[0], sizeof(v[0]), (void *)iov) != 0)
        return;
    if (v[0].len == 2 && iovlen > 1 && bpf_probe_read_user(&v[1], sizeof(v[1]), (void *)(iov + 16)) == 0) {
        *buf = v[1].base;
        *len = v[1].len;
        return;
    }
    *buf = v[0].base;
    *len = v[0].len;
}

// struct user_msghdr's first fields: name, namelen, iov, iovlen
struct dns_msghdr {
    u64 name;
    u32 namelen;
    u32 pad;
    u64 iov;
    u64 iovlen;
};

// A message sent with a msghdr at uhdr on fd (d: fd's entry, or NULL: only an address to port 53
// in the message makes it DNS).
static __always_inline void dns_send_msg(s32 fd, struct dnsfd *d, u64 uhdr) {
    struct dns_msghdr m = {};
    if (bpf_probe_read_user(&m, sizeof(m), (void *)uhdr) != 0)
        return;
    u8 addr[28] = {};
    u64 sock = 0;
    if (m.name && dns_port((const void *)m.name, m.namelen, addr)) {
        sock = dns_mark(fd, addr);
    } else if (d) {
        __builtin_memcpy(addr, d->addr, sizeof(addr));
        sock = d->ino;
    } else {
        return;
    }
    u32 run = current_run();
    if (!run)
        return;
    u64 buf, len;
    dns_iov(m.iov, m.iovlen, &buf, &len);
    dns_emit(run, fd, DNS_SENT, len, buf, len, addr, sock, 0);
}

// The DNS work of a syscall's entry: connect, read, write, writev, sendmsg, recvmsg (3), sendmmsg
// (4), recvmmsg (5), sendto and recvfrom (6).
static __always_inline int dns_enter(struct sys_enter_ctx *ctx) {
    s32 nr = ctx->nr;
    s32 fd = (s32)ctx->args[0];
    if (nr == __NR_connect) {
        if (!current_run())
            return 0;
        u8 addr[28] = {};
        if (dns_port((const void *)arg_beyond(ctx, 1), (u32)arg_beyond(ctx, 2), addr))
            dns_mark(fd, addr);
        else
            dns_mark(fd, NULL);
        return 0;
    }
    struct dnsfd *d = dns_fd(fd);
    if (nr == __NR_sendto) {
        u64 uaddr = arg_beyond(ctx, 4);
        u8 addr[28] = {};
        u64 sock = 0;
        if (!d && !uaddr)
            return 0;
        if (uaddr && current_run() && dns_port((const void *)uaddr, (u32)arg_beyond(ctx, 5), addr)) {
            sock = dns_mark(fd, addr);
        } else if (d) {
            __builtin_memcpy(addr, d->addr, sizeof(addr));
            sock = d->ino;
        } else {
            return 0;
        }
        u32 run = current_run();
        if (run)
            dns_emit(run, fd, DNS_SENT, arg_beyond(ctx, 2), arg_beyond(ctx, 1), arg_beyond(ctx, 2), addr, sock, 0);
        return 0;
    }
    if (nr == __NR_sendmsg) {
        if (d || current_run())
            dns_send_msg(fd, d, arg_beyond(ctx, 1));
        return 0;
    }
    if (nr == __NR_sendmmsg) {
        if (!d && !current_run())
            return 0;
        u64 vec = arg_beyond(ctx, 1);
        u32 vlen = (u32)arg_beyond(ctx, 2);
        // struct mmsghdr: a user_msghdr (56 bytes) and the length sent; the resolvers send a
        // query or two (A and AAAA) at a time: the first two are read
        if (vlen > 0)
            dns_send_msg(fd, d, vec);
        if (vlen > 1)
            dns_send_msg(fd, dns_fd(fd), vec + 64);
        return 0;
    }
    if (!d)
        return 0;
    u32 run = current_run();
    if (!run)
        return 0;
    if (nr == __NR_write) {
        if (arg_beyond(ctx, 2) == 2)
            return 0;  // a DNS-over-TCP length on its own
        dns_emit(run, fd, DNS_SENT, arg_beyond(ctx, 2), arg_beyond(ctx, 1), arg_beyond(ctx, 2), d->addr, d->ino, 0);
        return 0;
    }
    if (nr == __NR_writev) {
        u64 buf, len;
        dns_iov(arg_beyond(ctx, 1), arg_beyond(ctx, 2), &buf, &len);
        dns_emit(run, fd, DNS_SENT, len, buf, len, d->addr, d->ino, 0);
        return 0;
    }
    // a receive: where the message will be is kept until the exit
    struct dnsrecv r = {.fd = fd, .nr = nr};
    if (nr == __NR_read || nr == __NR_recvfrom) {
        r.buf = arg_beyond(ctx, 1);
        r.cap = arg_beyond(ctx, 2);
        if (nr == __NR_read && r.cap == 2)
            return 0;  // a DNS-over-TCP length on its own
    } else if (nr == __NR_recvmsg) {
        struct dns_msghdr m = {};
        if (bpf_probe_read_user(&m, sizeof(m), (void *)arg_beyond(ctx, 1)) != 0)
            return 0;
        dns_iov(m.iov, m.iovlen, &r.buf, &r.cap);
    } else if (nr == __NR_recvmmsg) {
        r.vec = arg_beyond(ctx, 1);
    } else {
        return 0;
    }
    u32 tid = (u32)bpf_get_current_pid_tgid();
    dnsrecvs.update(&tid, &r);
    return 0;
}

// One received message of a recvmmsg: the message at vec[i].
static __always_inline void dns_recv_mmsg(u32 run, struct dnsrecv *r, struct dnsfd *d, u32 i, u64 cookie) {
    struct dns_msghdr m = {};
    u32 got = 0;
    u64 at = r->vec + i * 64;
    if (bpf_probe_read_user(&m, sizeof(m), (void *)at) != 0 || bpf_probe_read_user(&got, sizeof(got), (void *)(at + 56)) != 0)
        return;
    u64 buf, cap;
    dns_iov(m.iov, m.iovlen, &buf, &cap);
    dns_emit(run, r->fd, DNS_RECEIVED, got, buf, got < cap ? got : cap, d->addr, d->ino, cookie);
}

int on_enter_dns(struct sys_enter_ctx *ctx) {
    // attached to read, write, writev, recvfrom, recvmsg and recvmmsg (connect and the sends
    // call dns_enter from their own handlers)
    return dns_enter(ctx);
}

int on_exit_dns(struct sys_exit_ctx *ctx) {
    // attached to the exits of read, recvfrom, recvmsg and recvmmsg
    u64 id = bpf_get_current_pid_tgid();
    if (!dns_maybe(id >> 32))
        return 0;
    u32 tid = (u32)id;
    struct dnsrecv *r = dnsrecvs.lookup(&tid);
    if (!r)
        return 0;
    struct dnsrecv rc = *r;
    dnsrecvs.delete(&tid);
    if (rc.nr != ctx->nr || ctx->ret <= 0)
        return 0;
    struct dnsfd *d = dns_fd(rc.fd);
    u32 run = current_run();
    if (!d || !run)
        return 0;
    u64 cookie = dns_cookie(d->ino, rc.fd);
    if (rc.nr == __NR_recvmmsg) {
        dns_recv_mmsg(run, &rc, d, 0, cookie);
        if (ctx->ret > 1)
            dns_recv_mmsg(run, &rc, d, 1, cookie);
        return 0;
    }
    u64 n = (u64)ctx->ret;
    dns_emit(run, rc.fd, DNS_RECEIVED, ctx->ret, rc.buf, n < rc.cap ? n : rc.cap, d->addr, d->ino, cookie);
    return 0;
}

// ---- dns: what the kernel delivered to the run's sockets (a cgroup program, not a tracepoint)

// The run of a packet's socket: the socket's cgroup (bpf_skb_cgroup_id) or its nearest tracked
// ancestor, as run_of finds a task's.
static __always_inline u32 skb_run(struct __sk_buff *skb) {
    u64 cg = bpf_skb_cgroup_id(skb);
    u32 *hit = cgcache.lookup(&cg);
    if (hit)
        return *hit;
    u32 run = 0;
#pragma clang loop unroll(disable)
    for (int lvl = 0; lvl < CG_DEPTH_; lvl++) {
        u64 anc = bpf_skb_ancestor_cgroup_id(skb, lvl);
        if (anc == 0)
            break;
        u32 *r = tracked.lookup(&anc);
        if (r) {
            run = *r;
            break;
        }
    }
    cgcache.update(&cg, &run);
    return run;
}

// Attached to each run's cgroup (BPF_CGROUP_INET_INGRESS, beside any other program: it always lets
// the packet through). skb's data starts at the IP header; the IP and transport headers are in its
// linear part (the kernel pulled them before delivering), read directly: a packet that is not
// recorded costs no helper call. A UDP datagram from port 53, or shaped as a DNS answer from any
// port (the QR bit, one question: a job answering its own query from a port of its own), and a TCP
// segment from port 53 with data or SYN is recorded: its source, its receiving socket's cookie and
// its first bytes. IPv6 with extension headers before the transport header is not read (not
// recorded: what is received from it is not credited).
int on_dns_ingress(struct __sk_buff *skb) {
    u8 *ip = (u8 *)(long)skb->data;
    u8 *end = (u8 *)(long)skb->data_end;
    if (ip + 40 > end)  // less than IPv4 + UDP + a DNS header, or a TCP SYN-ACK: nothing of DNS
        return 1;
    u8 src[16] = {};
    u8 proto;
    u16 family;
    u32 off;
    if ((ip[0] >> 4) == 4) {
        family = 2;
        off = (ip[0] & 0xF) * 4;
        proto = ip[9];
        __builtin_memcpy(src, ip + 12, 4);
    } else if ((ip[0] >> 4) == 6) {
        family = 10;
        off = 40;
        proto = ip[6];
        __builtin_memcpy(src, ip + 8, 16);
    } else {
        return 1;
    }
    if (proto != 17 && proto != 6)
        return 1;
    // UDP: its header, then the DNS header's id, flags and question count; TCP: ports, seq, ack,
    // data offset and flags
    barrier_var(off);
    off &= 0x3C;
    u8 t[14];
    u8 *l4 = ip + off;
    if (l4 + 14 <= end)
        __builtin_memcpy(t, l4, 14);
    else if (bpf_skb_load_bytes(skb, off, t, 14) != 0)  // a UDP payload not in the linear part
        return 1;
    u32 seq = 0;
    u8 tcp = 0;
    if (proto == 17) {
        if ((t[0] != 0 || t[1] != 53) && (!(t[10] & 0x80) || t[12] != 0 || t[13] != 1))
            return 1;
        off += 8;
    } else {
        if (t[0] != 0 || t[1] != 53)
            return 1;
        seq = ((u32)t[4] << 24) | ((u32)t[5] << 16) | ((u32)t[6] << 8) | t[7];
        tcp = t[13];
        off += (t[12] >> 4) * 4;
    }
    u32 total = skb->len;
    u32 plen = total > off ? total - off : 0;
    if (plen == 0 && !(proto == 6 && (tcp & 0x02)))
        return 1;  // an ACK, a FIN: nothing delivered
    u32 run = skb_run(skb);
    if (!run)
        return 1;
    u32 zero = 0;
    struct dns_ev *e = scratch_dns_in.lookup(&zero);
    if (!e)
        return 1;
    e->h.ts = bpf_ktime_get_ns();
    e->h.cgid = bpf_skb_cgroup_id(skb);
    e->h.run = run;
    e->h.tgid = 0;
    e->h.tid = 0;
    e->h.kind = EV_DNS;
    e->h.flags = 0;
    e->ret = plen;
    e->fd = -1;
    e->dir = DNS_DELIVERED;
    e->seq = seq;
    e->sock = 0;
    e->cookie = bpf_get_socket_cookie(skb);
    e->proto = proto;
    e->tcp = tcp;
    e->pad = 0;
    e->pad2 = 0;
    __builtin_memset(e->addr, 0, sizeof(e->addr));
    e->addr[0] = family;  // sockaddr_in / sockaddr_in6: the family (little-endian), the port
    e->addr[2] = t[0];
    e->addr[3] = t[1];
    if (family == 2)
        __builtin_memcpy(e->addr + 4, src, 4);
    else
        __builtin_memcpy(e->addr + 8, src, 16);
    u32 n = plen > 2 * DNS_MAX_ - 1 ? 2 * DNS_MAX_ - 1 : plen;
    barrier_var(n);
    n &= 2 * DNS_MAX_ - 1;
    if (n > 0 && bpf_skb_load_bytes(skb, off, e->data, n) != 0) {
        e->h.flags |= F_FNAME_FAULT;
        n = 0;
    }
    e->len = n;
    emit(e, offsetof(struct dns_ev, data) + (n & (2 * DNS_MAX_ - 1)), run, EV_DNS);
    return 1;
}

