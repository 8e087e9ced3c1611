// ---- network -----------------------------------------------------------------------------

// ---- dns: defined in its section below; connect and the sends run it first (BCC keeps one program
// per tracepoint, so the DNS work on a shared tracepoint is a call, not a program of its own)
static __always_inline void dns_connect(struct sys_enter_ctx *ctx);
static __always_inline void dns_send(struct sys_enter_ctx *ctx);

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
    e->dino = n > 2 && e->addr[0] == 1 && e->addr[1] == 0 && e->addr[2] != '/' && e->addr[2] != 0 ? read_cwd_inode() : 0;
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
    dns_send(ctx);
    const void *addr;
    u32 len;
    if (ctx->nr == __NR_sendto) {
        addr = (const void *)arg_beyond(ctx, 4);
        len = (u32)arg_beyond(ctx, 5);
    } else {
        if (ctx->nr == __NR_sendmmsg && (u32)ctx->args[2] == 0)
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
        addr = (const void *)h.name;
        len = h.namelen;
    }
    return enter_send(ctx->nr, (s32)ctx->args[0], addr, len);  // written once: walked once
}

int on_enter_connect(struct sys_enter_ctx *ctx) {
    dns_connect(ctx);
    u32 run = current_run();
    if (run)
        enter_sockaddr(run, ctx->nr, 0, (s32)ctx->args[0], (const void *)ctx->args[1], (u32)ctx->args[2]);
    return 0;
}
