// ---- dns: what the kernel delivered to the run's sockets (a cgroup program, not a tracepoint)

// The run of a packet's socket: its cgroup's (bpf_skb_cgroup_id), found as a task's is.
static __always_inline u32 skb_run(struct __sk_buff *skb) {
    return cgroup_run(bpf_skb_cgroup_id(skb), skb);
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
