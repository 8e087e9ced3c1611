// ---- paths read at entry (an open's, a chdir's, a change's)

// The call's open/chdir record holds a path of n bytes (with its NUL): its length and the size.
static __always_inline void set_path_len(struct call *c, int n) {
    c->ev.open.path_len = n;
    u32 size = offsetof(struct open_ev, path) + (n & (PATH_MAX_ - 1));
    if (n >= PATH_MAX_)
        size = sizeof(struct open_ev);
    c->size = size;
}

// Reads a path into the call's open/chdir record at entry; keeps the pointer when not resident.
static __always_inline void read_path(struct call *c, const char *filename) {
    struct open_ev *e = &c->ev.open;
    int n = bpf_probe_read_user_str(e->path, sizeof(e->path), filename);
    if (n < 0) {
        n = 1;
        e->path[0] = 0;
        e->h.flags |= F_FNAME_FAULT;
        c->refetch = (u64)filename;
    } else if (n == sizeof(e->path)) {
        e->h.flags |= F_PATH_TRUNC;
    }
    set_path_len(c, n);
}

// Reads a change's paths (p1, then p2 right after it; NULL: none) into its record and sets its size.
static __always_inline void read_change_paths(struct call *c, const char *p1, const char *p2) {
    struct change_ev *e = &c->ev.change;
    int n = 0;
    if (p1) {
        n = bpf_probe_read_user_str(e->buf, PATH_MAX_, p1);
        if (n < 0) {
            n = 1;
            e->buf[0] = 0;
            e->h.flags |= F_FNAME_FAULT;
        } else if (n == PATH_MAX_) {
            e->h.flags |= F_PATH_TRUNC;
        }
    }
    u32 off = n;
    barrier_var(off);
    if (off > PATH_MAX_)
        off = PATH_MAX_;
    int m = 0;
    if (p2) {
        m = bpf_probe_read_user_str(&e->buf[off], PATH_MAX_, p2);
        if (m < 0) {
            m = 1;
            e->buf[off] = 0;
            e->h.flags |= F_PATH2_FAULT;
        } else if (m == PATH_MAX_) {
            e->h.flags |= F_PATH2_TRUNC;
        }
    }
    if (m < 0 || m > PATH_MAX_)
        m = 0;
    e->len1 = off;
    e->len2 = m;
    c->refetch = (u64)p1;
    c->refetch2 = (u64)p2;
    u32 size = offsetof(struct change_ev, buf) + off + (u32)m;
    if (size > sizeof(struct change_ev))
        size = sizeof(struct change_ev);
    c->size = size;
}
