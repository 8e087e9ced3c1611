/* A growing byte buffer, shared by the compiled modules (_fast.c, _wire.c). Requires Python.h,
 * string.h and stdlib.h before it. */
#ifndef EVIDENCE_FAST_BUF_H
#define EVIDENCE_FAST_BUF_H

typedef struct {
    char *p;
    size_t n, cap;
    PyObject *bytes; /* when set, p is its buffer (bytes_buf: a result made in place, not copied) */
} Buf;

/* buf_grow's growing: 0, or -1 with MemoryError set. */
static int buf_grow_slow(Buf *b, size_t more) {
    size_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->n + more) cap *= 2;
    if (b->bytes) { /* (on failure _PyBytes_Resize drops it and sets MemoryError) */
        if (_PyBytes_Resize(&b->bytes, (Py_ssize_t)cap)) {
            b->p = NULL;
            b->n = b->cap = 0;
            return -1;
        }
        b->p = PyBytes_AS_STRING(b->bytes);
        b->cap = cap;
        return 0;
    }
    char *p = realloc(b->p, cap);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

/* Room for `more` bytes: 0, or -1 with MemoryError set (the usual case, room already, inline). */
static inline int buf_grow(Buf *b, size_t more) {
    return b->n + more <= b->cap ? 0 : buf_grow_slow(b, more);
}

static inline int put(Buf *b, const char *s, size_t n) {
    if (buf_grow(b, n)) return -1;
    memcpy(b->p + b->n, s, n);
    b->n += n;
    return 0;
}

/* the decimal digits of v (as "%lld" writes them) into tmp (at least 21 bytes); their count */
static inline int decimal(char *tmp, long long v) {
    char rev[20];
    int n = 0, k = 0;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        rev[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0) tmp[k++] = '-';
    while (n) tmp[k++] = rev[--n];
    return k;
}

#endif
