// ---- common: limits and the syscall tracepoints' context (the records' kinds, flags and layouts
// are the ABI's: probes/abi.py, included after this file)

#include <asm/unistd.h>  // syscall numbers (ABI: the same in any kernel's headers)

#define HASH_MAX_ 1024  // longer names are not aggregated (see name_token)
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

#define RESOLVE_IN_ROOT_ 0x10  // openat2 how.resolve

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
