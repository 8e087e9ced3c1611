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

// struct akey and struct aval (`agg`'s key and value) are the ABI's (probes/abi.py)
BPF_ARRAY(hkey, u64, 2);                  // SipHash key (user space writes it once, at load)
BPF_ARRAY(limits, u32, MAX_RUNS_);        // per run: distinct keys kept (0: no aggregation)
BPF_ARRAY(distinct, u32, MAX_RUNS_);      // per run: distinct keys in `agg`
BPF_F_TABLE("hash", u32, struct pctx, procs, 65536, BPF_F_NO_PREALLOC);
BPF_TABLE("lru_hash", u64, struct fdtok, fds, 65536);
BPF_F_TABLE("hash", struct akey, struct aval, agg, AGG_MAX, BPF_F_NO_PREALLOC);

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

// The token of `base` and the first *len_at bytes at buf (in the thread's call or the exec record:
// a map value, read directly, 8 bytes a load; buf + HASH_MAX_ + 8 stays inside the value), 0 when
// no key is set or the name is longer than HASH_MAX_ bytes (then the call is a plain record:
// correct, only not aggregated; the verifier walks this loop once per iteration and state, so it
// is kept short). The length is read from the map value before the loop and again after it: the
// loop's ways out (one per number of words) then meet in one state for the last bytes.
static __always_inline u64 name_token(u64 base, const char *buf, const u32 *len_at) {
    struct sip s;
    u32 len = *(const volatile u32 *)len_at;
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
    len = *(const volatile u32 *)len_at;
    if (len > HASH_MAX_)
        return 0;
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
