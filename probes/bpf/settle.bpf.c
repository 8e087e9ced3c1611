// ---- a paired call's exit: its name hashed, its key counted in `agg` or its record emitted

// Sets what hash_name hashes for the call: an open's or chdir's path against its base, or a
// connect's address (the bytes as given, up to 127).
static __always_inline void prepare_hash(struct call *c) {
    c->hskip = 1;
    c->htok = 0;
    c->hoff = 0;
    u32 kind = c->ev.h.kind;
    u32 run = c->ev.h.run;
    // a chdir's cwd is named by the kernel (kernel_name): its token is a random one (settle), since
    // the same name can reach another directory later and user space names the cwd by where it is
    if (kind != EV_OPEN && kind != EV_CONNECT)
        return;
    u32 *lim = limits.lookup(&run);
    if (!lim || *lim == 0)
        return;  // --detail full: every operation is a record
    if (kind == EV_CONNECT) {
        struct connect_ev *e = &c->ev.conn;
        c->hlen = e->addrlen > sizeof(e->addr) - 1 ? sizeof(e->addr) - 1 : e->addrlen;
        c->hbase = 0x636f6e6e656374ULL;  // "connect": apart from any path's
        c->hskip = 0;
        if (e->dino) {  // a relative AF_UNIX path: hashed against the cwd's token, like an open's
            struct pctx *p = proc_ctx(c->ev.h.tgid);
            u64 base = p ? cwd_base(p, e->dino) : 0;
            if (base)
                c->hbase = base;
            else
                c->hskip = 2;
        }
        return;
    }
    u32 len = 0;
    int unknown = 0;
    u64 base = path_base(&c->ev.open, &len, &unknown);
    if (unknown == 2)
        return;  // no room for the process's tokens: a plain record
    c->hbase = base;
    c->hlen = len;
    c->hskip = unknown ? 2 : 0;
}

// c->htok = the token of what prepare_hash set. The inputs are read back from the map value, so the
// verifier walks the loop with the same state from every path that leads here (else the
// program is too large to verify).
static __always_inline void hash_name(struct call *c) {
    if (*(volatile u32 *)&c->hskip != 0)
        return;
    u64 base = *(volatile u64 *)&c->hbase;
    u32 off = *(volatile u32 *)&c->hoff;
    c->htok = name_token(base, c->ev.open.path + (off & (PATH_MAX_ - 1)), &c->hlen);
    c->hskip = 3;  // hashed: on_exit_name keeps this token (see settle)
}

// The aggregation key of a completed open or connect whose token is `tok`.
static __always_inline void fill_key(struct call *c, struct pctx *p, u64 tok, struct akey *k) {
    struct hdr *h = &c->ev.h;
    s64 ret = c->ev.open.ret;
    k->exe = p->exe;
    k->tok = tok;
    k->cgid = h->cgid;
    k->run = h->run;
    k->kind = h->kind;
    k->result = ret < 0 ? (s32)ret : 0;
    if (h->kind == EV_OPEN) {
        k->access = c->ev.open.flags & ACCESS_BITS;
        k->ino = ret >= 0 ? c->ev.open.rino : 0;
    } else {
        k->access = h->flags & (F_SEND | F_FNAME_FAULT);
        k->ino = 0;
    }
}

BPF_PROG_ARRAY(exit_tail, 3);  // 0: on_exit_hash, 1: on_exit_name, 2: on_exit

// What a completed call changes in the kernel's tokens, and whether it is a record: 0 when an open
// or connect was counted under a key already kept (or past the cap) and changed nothing user space
// keeps. F_FIRST marks a key's first record (then *first = 1 and *k is its key).
//
// A successful open that will be a record (its key's first, or one the kernel does not count) and
// was not named by the kernel yet goes to on_exit_name first, which comes back to on_exit_hash and
// so here again: the record names the file the kernel opened, not the name the job's memory held
// when the probe read it (another thread can change it before the kernel reads it). That is
// decided at the one lookup of the key a repeat costs, before anything is changed, so that the
// second pass decides the same; a repeat counted under a key is the same file (the key has its
// inode), so only a key's first open costs the walk.
static __always_inline int settle(struct sys_exit_ctx *ctx, struct call *c, struct akey *k, int *first) {
    struct hdr *h = &c->ev.h;
    u32 kind = h->kind;
    s64 ret = c->ev.open.ret;
    u32 tgid = h->tgid;
    u32 run = h->run;
    if (kind == EV_CHDIR || kind == EV_FCHDIR || kind == EV_DUP) {
        if (ret < 0)
            return 1;
        struct pctx *p = proc_ctx(tgid);
        if (!p)
            return 1;
        if (kind == EV_DUP) {  // the new descriptor names what oldfd names: its token if oldfd is known as that
            u64 ino = c->ev.dup.rino;
            set_fd_token(p, tgid, (s32)ret, fd_token(p, tgid, c->ev.dup.oldfd, ino), ino);
            return 1;
        }
        // the new cwd: user space names it by the kernel's name of it (kernel_name), which another
        // chdir to the same name may not have: a token of its own
        p->cwd = random_token();
        p->cwd_ino = c->ev.open.rino;  // the new cwd, read at exit
        return 1;
    }
    if (kind != EV_OPEN && kind != EV_CONNECT)
        return 1;
    u32 *lim = limits.lookup(&run);
    if (!lim || *lim == 0)
        return 1;  // --detail full: every operation is a record
    int opened = kind == EV_OPEN && ret >= 0;
    struct pctx *p = proc_ctx(tgid);
    if (!p) {
        if (opened && !c->walked)
            exit_tail.call(ctx, 1);  // a plain record: named by the kernel
        return 1;
    }
    u64 tok = c->htok;
    int fd_changes = 0;
    u64 ino = 0;
    if (opened) {
        // what user space keeps for the descriptor changes: another token, or the same name on
        // another file (a directory removed and made again: user space needs its new inode)
        ino = c->ev.open.rino;
        fd_changes = fd_token(p, tgid, (s32)ret, ino) != tok;
    }
    // tok 0: resolved against something the kernel cannot name; F_OTHER_NS: another mount
    // namespace, never merged with the run's own names: each a plain record
    int plain = tok == 0 || (h->flags & F_OTHER_NS);
    struct aval *v = NULL;
    u32 *nd = NULL;
    int walk = plain;
    if (!plain) {
        fill_key(c, p, tok, k);
        v = agg.lookup(k);
        if (!v) {  // a key's first record; past the cap, a record only when fd_changes
            nd = distinct.lookup(&run);
            walk = !nd || *nd < *lim || fd_changes;
        }
    }
    if (walk && opened && !c->walked)
        exit_tail.call(ctx, 1);  // on_exit_name, then back to on_exit_hash (if it fails: the name as given)
    // from here on, state changes
    if (opened && (fd_changes || tok == 0))  // else the entry holds this generation, token and inode already
        set_fd_token(p, tgid, (s32)ret, tok, ino);
    if (plain)
        return 1;
    c->ev.open.exe = p->exe;  // the same offsets in connect_ev
    c->ev.open.tok = tok;
    if (!v) {
        if (!nd)
            return 1;
        if (*nd >= *lim) {
            count_lost(run, kind == EV_OPEN ? K_OPEN_PAST_CAP : K_CONNECT_PAST_CAP);
            if (!fd_changes)
                return 0;
            h->flags |= F_STATE;
            return 1;
        }
        struct aval nv = {.count = 1, .first = h->ts, .last = h->ts};
        if (agg.insert(k, &nv) == 0) {
            __sync_fetch_and_add(nd, 1);
            h->flags |= F_FIRST;
            *first = 1;
            return 1;
        }
        v = agg.lookup(k);  // inserted by another CPU just now, or the map is full
        if (!v) {
            count_lost(run, K_AGG_MAP_FULL);  // not lost: recorded one by one, and counted
            return 1;
        }
    }
    __sync_fetch_and_add(&v->count, 1);
    if (h->ts > v->last)
        v->last = h->ts;
    if (h->ts < v->first)
        v->first = h->ts;
    if (!fd_changes)
        return 0;
    h->flags |= F_STATE;
    return 1;
}

// At exit: the result goes into the record, a path not resident at entry is read again, and the
// one record is emitted (or, for a key counted in `agg`, not).
// Settles a call whose token is in c->htok and emits its record if it is one.
static __always_inline int settle_and_emit(struct sys_exit_ctx *ctx, struct call *c) {
    struct akey k = {};
    int first = 0;
    if (!settle(ctx, c, &k, &first)) {
        c->ev.h.kind = 0;  // counted in `agg`, and nothing user space keeps changed
        return 0;
    }
    s64 ret = c->ev.open.ret;
    u32 tgid = c->ev.h.tgid;
    u32 kind = c->ev.h.kind;
    u32 oflags = c->ev.open.flags;
    if (kind == EV_OPEN && ret >= 0 && (oflags & WRITE_BITS_) && !(oflags & O_PATH_))
        c->ev.open.nlink = inode_nlink(c->ev.open.rino);  // a write open that is a record
    if (emit_call(c) != 0) {
        if (first) {  // the key's first record is lost (counted): its next occurrence is first
            agg.delete(&k);
            u32 *nd = distinct.lookup(&k.run);
            if (nd)
                __sync_fetch_and_add(nd, -1);
        }
        if (kind == EV_OPEN && ret >= 0) {
            struct pctx *p = procs.lookup(&tgid);
            if (p)
                set_fd_token(p, tgid, (s32)ret, 0, 0);  // user space did not see what fd names now
        }
    }
    return 0;
}

// The second half of on_exit, a program of its own (a tail call) so that the verifier walks the
// hash loop from one clean state instead of once per path through the first half. A successful
// open that is to be a record is named by the kernel first (settle).
int on_exit_hash(struct sys_exit_ctx *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct call *c = inflight.lookup(&tid);
    if (!c || c->ev.h.kind == 0)
        return 0;
    hash_name(c);
    return settle_and_emit(ctx, c);
}
