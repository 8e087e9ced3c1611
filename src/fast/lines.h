/* open_lines: full detail's open events made from the spool's lines, with the GIL let go. Included
 * by _fast.c after opens (its Buf, end_core, hash_run and HEX).
 *
 * Why: the premade lines (bundle/premade.py) were made on the correlator's thread, from the
 * records' dicts, under the GIL it holds all the while it works: a third of its CPU a distinct open
 * (0.62 of 1.96 us), while after the job most of a CPU stood idle. A spool line is bytes, which no
 * thread changes: the premade's own thread reads the lines the spool was just given and makes their
 * events here without the GIL, beside the correlator.
 *
 * open_lines(items, i, seq, id_, runid, after_source, core_mid, open_type, defer): what opens()
 * makes of the records that the lines items[i], items[i+1], ... hold (each orjson's JSON of a
 * record, as the spool has it, with its newline or without), up to the first item that is not such a line or
 * whose record opens() does not take: not an open, an open with "n" or "tl", a path that is not a
 * string, a time that is not an integer, a value it would hand to the Python path (an object, a
 * number with a fraction or an exponent, lists nested past 8 deep), a key it would have to escape.
 * The Python path then parses that line and makes its event (bundle/sink.py _full_batch). The bytes
 * are opens()'s: each value is copied as orjson wrote it, which is how canonical JSON writes it
 * (orjson again, sorted keys: tests/unit/test_fast.py holds the two equal), and the keys are sorted
 * by their bytes. Times are formatted as format.format_time does (clock_set, years 1000-9999; another
 * year is the Python path's). Returns what opens() returns. `items` is not changed while the GIL is
 * let go: its caller's batch (FullWriter's), which no other thread holds. */

typedef struct {
    const char *k, *v; /* the key's bytes (no escape among them) and its value's JSON */
    size_t kn, vn;
    int made; /* 1: count, 2: first_time, 3: last_time (made here) */
} LField;

#define LFIELDS 64

/* one past the JSON value at s (before e), or NULL for a value opens() does not write as it stands */
static const char *skip_value(const char *s, const char *e, int depth) {
    if (s >= e) return NULL;
    switch (*s) {
        case '"':
            for (s++; s < e;) { /* (memchr's: most strings hold no escape) */
                const char *q = memchr(s, '"', (size_t)(e - s));
                if (!q) return NULL;
                const char *b = memchr(s, '\\', (size_t)(q - s));
                if (!b) return q + 1;
                s = b + 2; /* past the escape's backslash and the byte it escapes */
            }
            return NULL;
        case 'n': return e - s >= 4 && !memcmp(s, "null", 4) ? s + 4 : NULL;
        case 't': return e - s >= 4 && !memcmp(s, "true", 4) ? s + 4 : NULL;
        case 'f': return e - s >= 5 && !memcmp(s, "false", 5) ? s + 5 : NULL;
        case '[':
            if (depth >= 8) return NULL; /* put_value's bound */
            if (++s < e && *s == ']') return s + 1;
            for (;;) {
                s = skip_value(s, e, depth + 1);
                if (!s || s >= e) return NULL;
                if (*s == ']') return s + 1;
                if (*s++ != ',') return NULL;
            }
        default: {
            if (*s == '-') s++;
            const char *d = s;
            while (s < e && *s >= '0' && *s <= '9') s++;
            if (s == d || s - d > 20 || (s < e && (*s == '.' || *s == 'e' || *s == 'E'))) return NULL;
            return s;
        }
    }
}

static int lfield_cmp(const void *a, const void *b) {
    const LField *x = a, *y = b;
    size_t n = x->kn < y->kn ? x->kn : y->kn;
    int c = memcmp(x->k, y->k, n);
    if (c) return c;
    return (x->kn > y->kn) - (x->kn < y->kn);
}

static inline int key_is(const LField *f, const char *k, size_t n) { return f->kn == n && !memcmp(f->k, k, n); }

/* A line's record, as opens() reads it: its fields but k, t, count, first_time and last_time, in the
 * line's order (given, ng), its time, its path's JSON. 1, or 0: not one opens() takes. */
static int read_line(const char *s, size_t n, LField *given, int *ng, unsigned long long *t, const char **path,
                     size_t *path_n) {
    if (n && s[n - 1] == '\n') n--; /* (with its newline or without) */
    if (n < 2 || s[0] != '{' || s[n - 1] != '}') return 0;
    const char *p = s + 1, *e = s + n - 1; /* between the braces */
    int kind = 0, timed = 0, count = 0;
    *path = NULL;
    if (p == e) return 0;
    for (;;) {
        if (p >= e || *p != '"') return 0;
        const char *k = ++p;
        while (p < e && *p != '"' && *p != '\\') p++;
        if (p >= e || *p != '"') return 0; /* an escape in a key: the Python path's */
        size_t kn = (size_t)(p - k);
        if (++p >= e || *p++ != ':') return 0;
        const char *v = p;
        p = skip_value(p, e, 0);
        if (!p) return 0;
        size_t vn = (size_t)(p - v);
        LField f = {k, v, kn, vn, 0};
        if (key_is(&f, "k", 1)) {
            if (vn != 6 || memcmp(v, "\"open\"", 6)) return 0;
            kind = 1;
        } else if (key_is(&f, "t", 1)) {
            if (vn > 19 || *v < '0' || *v > '9') return 0;
            unsigned long long x = 0;
            for (size_t k2 = 0; k2 < vn; k2++) x = x * 10 + (unsigned long long)(v[k2] - '0');
            if (x > (unsigned long long)LLONG_MAX) return 0;
            *t = x;
            timed = 1;
        } else if (key_is(&f, "n", 1) || key_is(&f, "tl", 2)) {
            return 0;
        } else if (!key_is(&f, "count", 5) && !key_is(&f, "first_time", 10) && !key_is(&f, "last_time", 9)) {
            if (count >= LFIELDS - 4) return 0;
            if (key_is(&f, "path", 4)) {
                if (*v != '"') return 0;
                *path = v, *path_n = vn;
            }
            given[count++] = f;
        }
        if (p == e) break;
        if (*p++ != ',') return 0;
    }
    *ng = count;
    return kind && timed && *path;
}

typedef struct {
    const char *id_, *runid, *after_source, *core_mid, *open_type;
    size_t id_n, runid_n, after_source_n, core_mid_n, open_type_n;
} LConsts;

/* The events of `count` lines (lines[k], ns[k]) into out (lines), cores and ends (room made by the
 * caller: each bounded by line_bound and core_bound), their hashes at hashes (or none); how many it
 * made (it stops at the first line read_line does not take). No Python call: the GIL is let go. */
typedef struct {
    char *lines, *cores, *ends, *hashes;
    size_t lines_n, cores_n, longest;
    int failed; /* OpenSSL failed */
} LOut;

static size_t make_from_lines(const char *const *lines, const size_t *ns, size_t count, unsigned long long seq,
                              const LConsts *c, LOut *o, EVP_MD_CTX *ctx) {
    LField given[LFIELDS], fields[LFIELDS];
    /* the last line's keys, and their sorted order: a line with the same keys in the same order
     * (every open the correlator makes) is sorted as the one before it */
    const char *keys_before[LFIELDS];
    size_t kns_before[LFIELDS];
    int order[LFIELDS], n_before = -1;
    Clock clock = {.second = -1};
    size_t made = 0;
    for (; made < count; made++) {
        int ng;
        unsigned long long t = 0;
        const char *path = NULL;
        size_t path_n = 0;
        if (!read_line(lines[made], ns[made], given, &ng, &t, &path, &path_n)) break;
        if (!clock_set(&clock, (long long)t)) break; /* (read_line: t <= LLONG_MAX) */
        int same = ng == n_before;
        for (int f = 0; f < ng && same; f++)
            same = given[f].kn == kns_before[f] && !memcmp(given[f].k, keys_before[f], given[f].kn);
        given[ng] = (LField){"count", NULL, 5, 0, 1};
        given[ng + 1] = (LField){"first_time", NULL, 10, 0, 2};
        given[ng + 2] = (LField){"last_time", NULL, 9, 0, 3};
        int nf = ng + 3;
        if (same) {
            for (int f = 0; f < nf; f++) fields[f] = given[order[f]];
        } else {
            for (int f = 0; f < nf; f++) fields[f] = given[f], fields[f].vn = (size_t)f; /* (vn: its place, for a moment) */
            qsort(fields, (size_t)nf, sizeof(LField), lfield_cmp);
            int dup = 0;
            for (int f = 0; f < nf; f++) {
                order[f] = (int)fields[f].vn;
                if (f && !lfield_cmp(&fields[f - 1], &fields[f])) dup = 1;
            }
            if (dup) break; /* (orjson never writes a key twice) */
            for (int f = 0; f < nf; f++) fields[f] = given[order[f]];
            for (int f = 0; f < ng; f++) keys_before[f] = given[f].k, kns_before[f] = given[f].kn;
            n_before = ng;
        }
        /* the line: {"data":DATA, id_ seq runid seq after_source SUBJECT ,"time":"WHEN" "open_type \n */
        char *w = o->lines + o->lines_n, *start = w;
        memcpy(w, "{\"data\":{", 9), w += 9;
        char *data = w - 1;
        for (int f = 0; f < nf; f++) {
            if (f) *w++ = ',';
            *w++ = '"';
            memcpy(w, fields[f].k, fields[f].kn), w += fields[f].kn;
            *w++ = '"', *w++ = ':';
            if (fields[f].made == 1) {
                *w++ = '1';
            } else if (fields[f].made) {
                *w++ = '"';
                memcpy(w, clock.when, WHEN_N), w += WHEN_N;
                *w++ = '"';
            } else {
                memcpy(w, fields[f].v, fields[f].vn), w += fields[f].vn;
            }
        }
        *w++ = '}';
        size_t data_n = (size_t)(w - data);
        char digits[24];
        int dn = decimal(digits, (long long)seq);
        memcpy(w, c->id_, c->id_n), w += c->id_n;
        memcpy(w, digits, (size_t)dn), w += dn;
        memcpy(w, c->runid, c->runid_n), w += c->runid_n;
        memcpy(w, digits, (size_t)dn), w += dn;
        memcpy(w, c->after_source, c->after_source_n), w += c->after_source_n;
        memcpy(w, path, path_n), w += path_n;
        memcpy(w, ",\"time\":\"", 9), w += 9;
        memcpy(w, clock.when, WHEN_N), w += WHEN_N;
        *w++ = '"';
        memcpy(w, c->open_type, c->open_type_n), w += c->open_type_n;
        *w++ = '\n';
        size_t line_n = (size_t)(w - start);
        o->lines_n += line_n;
        if (line_n > o->longest) o->longest = line_n;
        /* the content hash's core: {"data":DATA core_mid SUBJECT open_type */
        char *k = o->cores + o->cores_n, *core = k;
        memcpy(k, "{\"data\":", 8), k += 8;
        memcpy(k, data, data_n), k += data_n;
        memcpy(k, c->core_mid, c->core_mid_n), k += c->core_mid_n;
        memcpy(k, path, path_n), k += path_n;
        memcpy(k, c->open_type, c->open_type_n), k += c->open_type_n;
        o->cores_n += (size_t)(k - core);
        if (o->hashes) {
            if (!hash_into(o->hashes + 65 * made, ctx, core, (size_t)(k - core))) {
                o->failed = 1;
                break;
            }
            o->cores_n = 0; /* (hashed: the core's room used again) */
        } else {
            memcpy(o->ends + made * sizeof(size_t), &o->cores_n, sizeof(size_t));
        }
        seq++;
    }
    return made;
}

static PyObject *fast_open_lines(PyObject *self, PyObject *args) {
    PyObject *items, *id_, *runid, *after_source, *core_mid, *open_type;
    Py_ssize_t i;
    unsigned long long seq;
    int defer = 0;
    if (!PyArg_ParseTuple(args, "O!nKOOOOO|p", &PyList_Type, &items, &i, &seq, &id_, &runid, &after_source,
                          &core_mid, &open_type, &defer))
        return NULL;
    PyObject *consts[] = {id_, runid, after_source, core_mid, open_type};
    if (!all_bytes(consts, 5)) return NULL;
    LConsts c = {PyBytes_AS_STRING(id_), PyBytes_AS_STRING(runid), PyBytes_AS_STRING(after_source),
                 PyBytes_AS_STRING(core_mid), PyBytes_AS_STRING(open_type), (size_t)PyBytes_GET_SIZE(id_),
                 (size_t)PyBytes_GET_SIZE(runid), (size_t)PyBytes_GET_SIZE(after_source),
                 (size_t)PyBytes_GET_SIZE(core_mid), (size_t)PyBytes_GET_SIZE(open_type)};
    Py_ssize_t total = PyList_GET_SIZE(items), count = 0;
    if (i < 0 || i > total) i = total;
    while (i + count < total && PyBytes_CheckExact(PyList_GET_ITEM(items, i + count))) count++;
    const char **lines = PyMem_Malloc(sizeof(char *) * (size_t)(count + 1));
    size_t *ns = PyMem_Malloc(sizeof(size_t) * (size_t)(count + 1));
    /* room: a line's event holds its fields (the line's bytes at most), three more of fixed size, its
     * path once more and the constants; its core the same but for id_, runid and the time */
    size_t fixed = 160 + c.id_n + c.runid_n + c.after_source_n + c.core_mid_n + c.open_type_n + 2 * 24;
    size_t lines_room = 0, core_room = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *b = PyList_GET_ITEM(items, i + k);
        if (lines && ns) lines[k] = PyBytes_AS_STRING(b), ns[k] = (size_t)PyBytes_GET_SIZE(b);
        size_t n = (size_t)PyBytes_GET_SIZE(b);
        lines_room += 2 * n + fixed;
        core_room = 2 * n + fixed > core_room ? 2 * n + fixed : core_room;
    }
    PyObject *out_lines = NULL, *out_cores = NULL, *out_ends = NULL, *out = NULL;
    EVP_MD_CTX *ctx = NULL;
    if (!lines || !ns) {
        PyErr_NoMemory();
        goto done;
    }
    LOut o = {0};
    out_lines = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)lines_room);
    /* deferred: every core kept (their ends beside); else one core's room, hashed as it is made */
    out_cores = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(defer ? lines_room : core_room));
    out_ends = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(defer ? sizeof(size_t) : 65) * count);
    ctx = EVP_MD_CTX_new();
    if (!out_lines || !out_cores || !out_ends || !ctx) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    o.lines = PyBytes_AS_STRING(out_lines);
    o.cores = PyBytes_AS_STRING(out_cores);
    if (defer)
        o.ends = PyBytes_AS_STRING(out_ends);
    else
        o.hashes = PyBytes_AS_STRING(out_ends);
    size_t made;
    Py_BEGIN_ALLOW_THREADS
    made = make_from_lines(lines, ns, (size_t)count, seq, &c, &o, ctx);
    Py_END_ALLOW_THREADS
    if (o.failed) {
        PyErr_SetString(PyExc_RuntimeError, "sha256 failed");
        goto done;
    }
    if (_PyBytes_Resize(&out_lines, (Py_ssize_t)o.lines_n) ||
        _PyBytes_Resize(&out_ends, (Py_ssize_t)((defer ? sizeof(size_t) : 65) * made)))
        goto done;
    if (defer) {
        if (_PyBytes_Resize(&out_cores, (Py_ssize_t)o.cores_n)) goto done;
        PyObject *pending = PyTuple_Pack(2, out_cores, out_ends);
        if (pending) out = Py_BuildValue("(nONn)", i + (Py_ssize_t)made, out_lines, pending, (Py_ssize_t)o.longest);
    } else {
        out = Py_BuildValue("(nOOn)", i + (Py_ssize_t)made, out_lines, out_ends, (Py_ssize_t)o.longest);
    }
done:
    Py_XDECREF(out_lines);
    Py_XDECREF(out_cores);
    Py_XDECREF(out_ends);
    EVP_MD_CTX_free(ctx);
    PyMem_Free(lines);
    PyMem_Free(ns);
    return out;
}
