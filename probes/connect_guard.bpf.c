// connect_guard: cgroup/sock_addr programs that allow or deny connect() and sendmsg() by address.
//
// Rendered by probes/render.py: render_guard() replaces the UPPERCASE tokens below and refuses to
// return C with a token left. Only `struct bpf_sock_addr` context fields (UAPI) and BPF helpers are
// used; no kernel struct is ever dereferenced.
//
// Rules live in two LPM tries (IPv4, IPv6) keyed by prefix. Each prefix holds every rule whose CIDR
// contains it (user space copies the covering rules in), sorted most specific first: prefix length,
// then a port, then a protocol, deny before allow on a tie. The first entry whose port and protocol
// match decides; no match means the policy default. An IPv4-mapped IPv6 destination
// (::ffff:a.b.c.d) is looked up in the IPv4 trie, so an IPv4 rule also catches it (a UDP datagram
// sent to a v4-mapped address never reaches sendmsg6: the kernel hands it to the IPv4 path, where
// sendmsg4 sees the plain IPv4 address).
//
// Dry run: a deny is reported with enforced=0 and the call is allowed.

#include <uapi/linux/bpf.h>

#define MAX_ENTRIES_PER_PREFIX __MAX_ENTRIES__
#define ACTION_ALLOW 1
#define ACTION_DENY 2
#define RULE_DEFAULT 0xffffffff
#define OP_CONNECT 1
#define OP_SENDMSG 2
#define DEFAULT_ALLOW __DEFAULT_ALLOW__
#define DRY_RUN __DRY_RUN__

struct lpm_v4_key {
    u32 prefixlen;
    u32 addr;  // network byte order
};

struct lpm_v6_key {
    u32 prefixlen;
    u32 addr[4];  // network byte order
};

struct rule_entry {
    u16 port;   // host byte order; 0 = any
    u8 proto;   // IPPROTO_TCP / IPPROTO_UDP; 0 = any
    u8 action;  // ACTION_ALLOW / ACTION_DENY
    u32 rule;   // index into the rule labels kept by user space
};

struct rule_set {
    u32 n;
    u32 pad;
    struct rule_entry e[MAX_ENTRIES_PER_PREFIX];
};

// One record per deny or would-block; 56 bytes, decoded by policy/connect.py:decode_record.
struct denial {
    u64 ts_ns;      // bpf_ktime_get_ns (CLOCK_MONOTONIC)
    u64 cgroup_id;
    u32 tgid;
    u32 tid;
    u32 rule;
    u16 port;       // host byte order
    u8 family;      // 4 or 6 (as seen by the program: a v4-mapped address is family 6, mapped 1)
    u8 proto;
    u8 op;          // OP_CONNECT / OP_SENDMSG
    u8 enforced;
    u8 mapped;
    u8 pad1;
    u32 addr[4];    // network byte order; IPv4 in addr[0]
    u32 pad2;
};

BPF_LPM_TRIE(rules_v4, struct lpm_v4_key, struct rule_set, __V4_CAPACITY__);
BPF_LPM_TRIE(rules_v6, struct lpm_v6_key, struct rule_set, __V6_CAPACITY__);
BPF_RINGBUF_OUTPUT(denials, __RINGBUF_PAGES__);
BPF_ARRAY(lost, u64, 1);

static __always_inline int decide(struct rule_set *rs, u16 port, u8 proto, u32 *rule)
{
    // 1 allow, 0 deny, -1 no rule matches
    u32 n = rs->n;
    for (int i = 0; i < MAX_ENTRIES_PER_PREFIX; i++) {
        if (i >= n)
            break;
        struct rule_entry *e = &rs->e[i];
        if (e->port && e->port != port)
            continue;
        if (e->proto && e->proto != proto)
            continue;
        *rule = e->rule;
        return e->action == ACTION_ALLOW ? 1 : 0;
    }
    return -1;
}

static __always_inline int report(u8 op, u8 family, u8 mapped, u32 *addr, u16 port, u8 proto, u32 rule)
{
    struct denial *d = denials.ringbuf_reserve(sizeof(struct denial));
    if (!d) {
        int zero = 0;
        u64 *count = lost.lookup(&zero);
        if (count)
            __sync_fetch_and_add(count, 1);
        return 0;
    }
    u64 id = bpf_get_current_pid_tgid();
    d->ts_ns = bpf_ktime_get_ns();
    d->cgroup_id = bpf_get_current_cgroup_id();
    d->tgid = id >> 32;
    d->tid = (u32)id;
    d->rule = rule;
    d->port = port;
    d->family = family;
    d->proto = proto;
    d->op = op;
    d->enforced = DRY_RUN ? 0 : 1;
    d->mapped = mapped;
    d->pad1 = 0;
    d->addr[0] = addr[0];
    d->addr[1] = addr[1];
    d->addr[2] = addr[2];
    d->addr[3] = addr[3];
    d->pad2 = 0;
    denials.ringbuf_submit(d, 0);
    return 0;
}

static __always_inline int verdict(int v, u8 op, u8 family, u8 mapped, u32 *addr, u16 port, u8 proto, u32 rule)
{
    if (v < 0) {
        v = DEFAULT_ALLOW;
        rule = RULE_DEFAULT;
    }
    if (v)
        return 1;
    report(op, family, mapped, addr, port, proto, rule);
    return DRY_RUN ? 1 : 0;
}

static __always_inline int check_v4(u32 ip4, u16 port, u8 proto, u8 op, u8 family, u8 mapped, u32 *addr)
{
    struct lpm_v4_key key = {};
    u32 rule = RULE_DEFAULT;
    int v = -1;
    key.prefixlen = 32;
    key.addr = ip4;
    struct rule_set *rs = rules_v4.lookup(&key);
    if (rs)
        v = decide(rs, port, proto, &rule);
    return verdict(v, op, family, mapped, addr, port, proto, rule);
}

static __always_inline int guard4(struct bpf_sock_addr *ctx, u8 op)
{
    u32 addr[4] = {};
    addr[0] = ctx->user_ip4;
    u16 port = bpf_ntohs((u16)ctx->user_port);
    u8 proto = (u8)ctx->protocol;
    return check_v4(addr[0], port, proto, op, 4, 0, addr);
}

static __always_inline int guard6(struct bpf_sock_addr *ctx, u8 op)
{
    u32 addr[4] = {};
    addr[0] = ctx->user_ip6[0];
    addr[1] = ctx->user_ip6[1];
    addr[2] = ctx->user_ip6[2];
    addr[3] = ctx->user_ip6[3];
    u16 port = bpf_ntohs((u16)ctx->user_port);
    u8 proto = (u8)ctx->protocol;
    if (addr[0] == 0 && addr[1] == 0 && addr[2] == bpf_htonl(0x0000ffff))
        return check_v4(addr[3], port, proto, op, 6, 1, addr);

    struct lpm_v6_key key = {};
    u32 rule = RULE_DEFAULT;
    int v = -1;
    key.prefixlen = 128;
    key.addr[0] = addr[0];
    key.addr[1] = addr[1];
    key.addr[2] = addr[2];
    key.addr[3] = addr[3];
    struct rule_set *rs = rules_v6.lookup(&key);
    if (rs)
        v = decide(rs, port, proto, &rule);
    return verdict(v, op, 6, 0, addr, port, proto, rule);
}

int guard_connect4(struct bpf_sock_addr *ctx)
{
    return guard4(ctx, OP_CONNECT);
}

int guard_connect6(struct bpf_sock_addr *ctx)
{
    return guard6(ctx, OP_CONNECT);
}

int guard_sendmsg4(struct bpf_sock_addr *ctx)
{
    return guard4(ctx, OP_SENDMSG);
}

int guard_sendmsg6(struct bpf_sock_addr *ctx)
{
    return guard6(ctx, OP_SENDMSG);
}
