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
