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
    if (!p || p->gen != d->gen || read_fd_inode(fd) != d->ino) {
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
    struct dnsfd d = {.gen = p->gen, .ino = read_fd_inode(fd)};
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
    if (!ino || bpf_probe_read_kernel(&mode, sizeof(mode), (void *)(ino + INODE_MODE_OFF)) != 0)
        return 0;
    if ((mode & 0170000) != 0140000)  // S_IFSOCK
        return 0;
    u64 file = read_fd_file(fd), sock = 0, sk = 0, cookie = 0;
    if (!file || bpf_probe_read_kernel(&sock, sizeof(sock), (void *)(file + FILE_PRIVATE_DATA_OFF)) != 0 || !sock)
        return 0;
    if (bpf_probe_read_kernel(&sk, sizeof(sk), (void *)(sock + SOCKET_SK_OFF)) != 0 || !sk)
        return 0;
    bpf_probe_read_kernel(&cookie, sizeof(cookie), (void *)(sk + SOCK_COOKIE_OFF));
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

// The DNS work of a syscall's entry, by the handler that runs it (each handler's own calls only:
// the verifier walks what each program can run, not every call's way in every program).
// connect: the socket is marked as a DNS socket (or unmarked).
static __always_inline void dns_connect(struct sys_enter_ctx *ctx) {
    if (!current_run())
        return;
    s32 fd = (s32)ctx->args[0];
    u8 addr[28] = {};
    if (dns_port((const void *)ctx->args[1], (u32)ctx->args[2], addr))
        dns_mark(fd, addr);
    else
        dns_mark(fd, NULL);
}

// sendmsg (3 arguments), sendmmsg (4) and sendto (6)
static __always_inline void dns_send(struct sys_enter_ctx *ctx) {
    s32 nr = ctx->nr;
    s32 fd = (s32)ctx->args[0];
    struct dnsfd *d = dns_fd(fd);
    if (nr == __NR_sendto) {
        u64 uaddr = arg_beyond(ctx, 4);
        u8 addr[28] = {};
        u64 sock = 0;
        if (!d && !uaddr)
            return;
        if (uaddr && current_run() && dns_port((const void *)uaddr, (u32)arg_beyond(ctx, 5), addr)) {
            sock = dns_mark(fd, addr);
        } else if (d) {
            __builtin_memcpy(addr, d->addr, sizeof(addr));
            sock = d->ino;
        } else {
            return;
        }
        u32 run = current_run();
        if (run)
            dns_emit(run, fd, DNS_SENT, ctx->args[2], ctx->args[1], ctx->args[2], addr, sock, 0);
        return;
    }
    if (nr == __NR_sendmsg) {
        if (d || current_run())
            dns_send_msg(fd, d, ctx->args[1]);
        return;
    }
    if (nr == __NR_sendmmsg) {
        if (!d && !current_run())
            return;
        u64 vec = ctx->args[1];
        u32 vlen = (u32)ctx->args[2];
        // struct mmsghdr: a user_msghdr (56 bytes) and the length sent; the resolvers send a
        // query or two (A and AAAA) at a time: the first two are read
        if (vlen > 0)
            dns_send_msg(fd, d, vec);
        if (vlen > 1)
            dns_send_msg(fd, dns_fd(fd), vec + 64);
    }
}

// read, write, writev (3 arguments), recvmsg (3), recvmmsg (5) and recvfrom (6): a message written
// to a DNS socket, or where a receive's message will be, kept until its exit
static __always_inline int dns_io(struct sys_enter_ctx *ctx) {
    s32 nr = ctx->nr;
    s32 fd = (s32)ctx->args[0];
    struct dnsfd *d = dns_fd(fd);
    if (!d)
        return 0;
    u32 run = current_run();
    if (!run)
        return 0;
    if (nr == __NR_write) {
        if (ctx->args[2] == 2)
            return 0;  // a DNS-over-TCP length on its own
        dns_emit(run, fd, DNS_SENT, ctx->args[2], ctx->args[1], ctx->args[2], d->addr, d->ino, 0);
        return 0;
    }
    if (nr == __NR_writev) {
        u64 buf, len;
        dns_iov(ctx->args[1], ctx->args[2], &buf, &len);
        dns_emit(run, fd, DNS_SENT, len, buf, len, d->addr, d->ino, 0);
        return 0;
    }
    // a receive: where the message will be is kept until the exit
    struct dnsrecv r = {.fd = fd, .nr = nr};
    if (nr == __NR_read || nr == __NR_recvfrom) {
        r.buf = ctx->args[1];
        r.cap = ctx->args[2];
        if (nr == __NR_read && r.cap == 2)
            return 0;  // a DNS-over-TCP length on its own
    } else if (nr == __NR_recvmsg) {
        struct dns_msghdr m = {};
        if (bpf_probe_read_user(&m, sizeof(m), (void *)ctx->args[1]) != 0)
            return 0;
        dns_iov(m.iov, m.iovlen, &r.buf, &r.cap);
    } else if (nr == __NR_recvmmsg) {
        r.vec = ctx->args[1];
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
    // attached to read, write, writev, recvfrom, recvmsg and recvmmsg (connect and the sends run
    // dns_connect and dns_send from their own handlers)
    return dns_io(ctx);
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
