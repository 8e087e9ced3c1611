// ---- common: limits, record flags, the records' layouts, the syscall tracepoints' context


#include <asm/unistd.h>  // syscall numbers (ABI: the same in any kernel's headers)

RECORD_KINDS

#define SC_EXEC 2  // ret_ev.sc: exec is the only call whose result is a record of its own

#define PATH_MAX_ 4096
#define DNS_MAX_ 1024  // bytes of a DNS message kept (a power of two)
#define DNS_SENT 0
#define DNS_RECEIVED 1
#define DNS_DELIVERED 2  // a datagram or segment the kernel delivered to a socket of a run (on_dns_ingress)
#define HASH_MAX_ 1024  // longer names are not aggregated (see name_token)
// the result of a call that never returned while recorded (not a kernel code: -1,000,000)
#define NO_RESULT_ (-1000000)
#define ARGS_MAX_ ARGS_BYTES
#define MAXARG_ MAX_ARGS
#define MAX_RUNS_ MAX_RUNS
#define CG_DEPTH_ CGROUP_DEPTH
#define INFLIGHT_RUN_ INFLIGHT_RUN  // entries of `inflight` one run may hold
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
