// ---- file changes that are not opens ------------------------------------------------------

// A change through a magic link of the process's own descriptors (`truncate /proc/self/fd/3`,
// `mkdir /proc/self/fd/3/sub` with 3 an O_PATH directory; /dev/fd/N, /proc/thread-self/fd/N,
// /proc/<pid>[/task/<tid>]/fd/N, and relative: fd/N from /proc/<pid>, N from a .../fd directory)
// changes the file descriptor N names, whatever name it was opened by. The probe does not decide
// whether a name is such a link (user space does, from the resolved name); it reads the number N
// of a name's first component of digits that is its first component or follows a component `fd`
// (within its first MAGIC_SCAN_ bytes: the ABI's), -1 when there is none, and records what descriptor N
// names (magic_inode), so user space names the change after its table's entry for N while N
// still names that file. names.magic_fd reads a name the same way: change both together.

#define FD_SLASH_ 0x66642f  // "fd/", the three bytes before a candidate

// The number of the descriptor the name at e->buf[base] reaches through a magic link, -1: none.
// Where the number starts goes through *at (the call's, a map value): the verifier walks the
// digits' loop once from an unknown start, not once per position the scan can stop at.
static __always_inline s32 magic_fd(struct change_ev *e, u32 base, s32 *at) {
    u32 w = 0;  // w: the four bytes before position i
    *(volatile s32 *)at = -1;
#pragma clang loop unroll(disable)
    for (u32 i = 0; i < MAGIC_SCAN_; i++) {
        u8 ch = e->buf[(base + i) & (2 * PATH_MAX_ - 1)];
        if (ch == 0)
            break;
        if (ch >= '0' && ch <= '9' && (i == 0 || (i >= 3 && (w & 0xffffff) == FD_SLASH_ && (i == 3 || (w >> 24) == '/')))) {
            *(volatile s32 *)at = i;
            break;
        }
        w = (w << 8) | ch;
    }
    s32 start = *(volatile s32 *)at;
    if (start < 0)
        return -1;
    s32 n = 0;
#pragma clang loop unroll(disable)
    for (u32 j = 0; j < 10; j++) {  // at most 9 digits, then '/' or the end of the name
        u8 ch = e->buf[(base + (u32)start + j) & (2 * PATH_MAX_ - 1)];
        if (ch == '/' || ch == 0)
            return n;
        if (ch < '0' || ch > '9' || j == 9)
            return -1;
        n = n * 10 + (ch - '0');
    }
    return -1;
}

static __always_inline int enter_change(u32 run, s32 nr, u16 op, s32 dfd, const char *p1, s32 dfd2, const char *p2, u32 mode, u32 uid, u32 gid, u32 at_flags) {
    struct call *c = begin_call(run, EV_CHANGE, nr);
    if (!c)
        return 0;
    struct change_ev *e = &c->ev.change;
    e->mode = mode;
    e->nlink = 0;
    e->uid = uid;
    e->gid = gid;
    e->at_flags = at_flags;
    e->op = op;
    e->pad = 0;
    e->dfd = dfd;
    e->dfd2 = dfd2;
    read_change_paths(c, p1, p2);
    // what the dirfds, or the cwd, name now (fchmod, fchown: the descriptor itself); rare calls:
    // read for any path
    e->dino = read_dir_inode(dfd);
    e->dino2 = p2 ? read_dir_inode(dfd2) : 0;
    // a name through a magic link: what its descriptor names (checked again at exit: finish_call)
    // (both names through one copy of the scan, each name's inputs read from the record: the
    // verifier walks it once a name)
#pragma clang loop unroll(disable)
    for (int k = 0; k < 2; k++) {
        s32 *mfd = k ? &c->mfd2 : &c->mfd;
        u32 len = k ? *(volatile u16 *)&e->len2 : *(volatile u16 *)&e->len1;
        u32 base = k ? *(volatile u16 *)&e->len1 : 0;
        s32 fd = len ? magic_fd(e, base, mfd) : -1;
        *(volatile s32 *)mfd = fd;
    }
    e->mino = c->mfd >= 0 ? read_fd_inode(c->mfd) : 0;
    e->mino2 = c->mfd2 >= 0 ? read_fd_inode(c->mfd2) : 0;
    return 0;
}

#define A(i) arg_beyond(ctx, i)
#define P(i) ((const char *)arg_beyond(ctx, i))

int on_enter_change(struct sys_enter_ctx *ctx) {
    // attached to every call below; arguments past the first are read with arg_beyond, since the
    // tracepoints sharing this handler have from 1 (unlink) to 5 (renameat2, linkat) arguments
    // the run first: the verifier walks its cgroup loop once, not once per call's operands below
    u32 run = current_run();
    if (!run)
        return 0;
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
    return enter_change(run, nr, op, dfd, p1, dfd2, p2, mode, uid, gid, fl);
}

#undef A
#undef P
