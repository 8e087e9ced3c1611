// ---- namespaces and mounts -----------------------------------------------------------------
//
// unshare, setns, clone/clone3 with a namespace flag, mount, move_mount, open_tree, fsmount,
// pivot_root and chroot by a run's processes, and ptrace (attach, seize, poke) and
// process_vm_writev with their target: rare calls, each one record (EV_NS, paired like a change).
// A process whose call changes what its paths name (a new mount or user namespace, a mount, a
// chroot, setns) is marked in `nsmark` when the call succeeds, and so is the child of a clone into
// a new mount or user namespace, and every child of a marked process (fork): every later record of
// it carries F_OTHER_NS, and its opens and connects are never aggregated with the run's own.

#define CLONE_NEWTIME_ 0x00000080ULL  // clone3 and unshare only (clone's low byte is the exit signal)
#define CLONE_NEWNS_ 0x00020000ULL
#define CLONE_NEWUSER_ 0x10000000ULL
#define NS_FLAGS_ (0x00020000ULL | 0x02000000ULL | 0x04000000ULL | 0x08000000ULL | 0x10000000ULL | 0x20000000ULL | 0x40000000ULL)
#define NS_PATH_FLAGS_ (CLONE_NEWNS_ | CLONE_NEWUSER_)  // the namespaces that change what a path names

static __always_inline int enter_ns(u32 run, s32 nr, u16 op, u64 flags, u64 target, s32 dfd, const char *p1, s32 dfd2, const char *p2) {
    struct call *c = begin_call(run, EV_NS, nr);
    if (!c)
        return 0;
    struct ns_ev *e = &c->ev.ns;
    e->flags = flags;
    e->target = target;
    __builtin_memset(e->fstype, 0, sizeof(e->fstype));
    e->op = op;
    e->pad = 0;
    e->dfd = dfd;
    e->dfd2 = dfd2;
    read_change_paths(c, p1, p2);
    // what the dirfds, or the cwd, name now (rare calls: read for any path, like a change's)
    e->dino = p1 ? read_dir_inode(dfd) : 0;
    e->dino2 = p2 ? read_dir_inode(dfd2) : 0;
    return 0;
}

#define A(i) arg_beyond(ctx, i)
#define P(i) ((const char *)arg_beyond(ctx, i))

int on_enter_ns(struct sys_enter_ctx *ctx) {
    // attached to every call below (from 1 argument, unshare and chroot, to 6); arguments past the
    // first are read with arg_beyond. The call's operands, then one enter_ns (written once: the
    // verifier walks it once, not once per call)
    s32 nr = ctx->nr;
    u64 a0 = ctx->args[0];
    u16 op = 0;
    u64 flags = 0, target = 0;
    s32 dfd = 0, dfd2 = 0;
    const char *p1 = NULL, *p2 = NULL;
    switch (nr) {
    case __NR_unshare:
        if (!(a0 & (NS_FLAGS_ | CLONE_NEWTIME_)))
            return 0;
        op = NS_UNSHARE; flags = a0;
        break;
    case __NR_setns:
        op = NS_SETNS; flags = (u32)A(1); target = (s32)a0;
        break;
    case __NR_clone:
        if (!(a0 & NS_FLAGS_))
            return 0;  // almost every clone: no record
        // without the low byte (clone's exit signal; clone3's CLONE_NEWTIME)
        op = NS_CLONE; flags = a0 & ~0xFFULL;
        break;
    case __NR_clone3:
        if (bpf_probe_read_user(&flags, sizeof(flags), (void *)a0) != 0 || !(flags & (NS_FLAGS_ | CLONE_NEWTIME_)))
            return 0;
        op = NS_CLONE;
        break;
    case __NR_mount:
        op = NS_MOUNT; flags = (u32)A(3); dfd = -100; p1 = (const char *)a0; dfd2 = -100; p2 = P(1);
        break;
    case __NR_move_mount:
        op = NS_MOVE_MOUNT; flags = (u32)A(4); dfd = (s32)a0; p1 = P(1); dfd2 = (s32)A(2); p2 = P(3);
        break;
    case __NR_open_tree:
        op = NS_OPEN_TREE; flags = (u32)A(2); dfd = (s32)a0; p1 = P(1);
        break;
    case __NR_fsmount:
        op = NS_FSMOUNT; flags = (u32)A(1); target = (s32)a0;
        break;
    case __NR_pivot_root:
        op = NS_PIVOT_ROOT; dfd = -100; p1 = (const char *)a0; dfd2 = -100; p2 = P(1);
        break;
    case __NR_chroot:
        op = NS_CHROOT; dfd = -100; p1 = (const char *)a0;
        break;
    case __NR_ptrace:
        // attach, seize, and writes to the tracee's memory or user area: poketext, pokedata, pokeuser
        if (a0 != 16 && a0 != 0x4206 && a0 != 4 && a0 != 5 && a0 != 6)
            return 0;
        op = NS_PTRACE; flags = a0; target = (u32)A(1);
        break;
    case __NR_process_vm_writev:
        op = NS_VM_WRITE; target = (u32)a0;
        break;
    default:
        return 0;
    }
    u32 run = current_run();
    if (!run)
        return 0;
    enter_ns(run, nr, op, flags, target, dfd, p1, dfd2, p2);
    if (nr == __NR_mount) {  // the filesystem's type, once the record is the thread's call
        u32 tid = (u32)bpf_get_current_pid_tgid();
        struct call *c = inflight.lookup(&tid);
        const char *type = P(2);
        if (c && c->ev.h.kind == EV_NS && type)
            bpf_probe_read_user_str(c->ev.ns.fstype, sizeof(c->ev.ns.fstype), type);
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
