/* Full detail's hot path in C: the event lines and content hashes of opens, the most frequent
 * records by far (bundle/sink.py: EventSink._full_batch calls these; its Python code is the
 * reference, and tests/unit/test_fast.py holds both byte-identical on generated records).
 *
 * - opens(items, i, seq, consts): the events of the plain open records items[i], items[i+1], ...
 *   (dicts: an open that stands for itself), up to the first item it does not take (a repeat's time,
 *   another kind, a value canonical JSON here does not write: a float, a nested object, an integer
 *   past 64 bits, a string that is not UTF-8), which the Python path makes;
 * - repeats(items, i, seq, parts, consts): the events of the repeats items[i], ... (ints: a record's
 *   time, the record before repeated at it), its data cut at its time (`parts`).
 * Each returns (the index it stopped at, the lines joined, their content hashes as 64 hex digits
 * and a newline each, the longest line's length).
 *
 * Canonical JSON as orjson writes it with sorted keys (bundle/canonical.py): '"' and '\\' escaped,
 * control characters as \b \t \n \f \r or \u00xx (lowercase), everything else as its UTF-8; keys
 * sorted by their UTF-8 bytes (code point order). The content hash is OpenSSL's SHA-256.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/evp.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    char *p;
    size_t n, cap;
} Buf;

static int buf_grow(Buf *b, size_t more) {
    if (b->n + more <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->n + more) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static inline int put(Buf *b, const char *s, size_t n) {
    if (buf_grow(b, n)) return -1;
    memcpy(b->p + b->n, s, n);
    b->n += n;
    return 0;
}

static inline int put_bytes(Buf *b, PyObject *o) { /* o: exact bytes (checked by the caller) */
    return put(b, PyBytes_AS_STRING(o), (size_t)PyBytes_GET_SIZE(o));
}

static int put_u64(Buf *b, unsigned long long v) {
    char tmp[24];
    int k = 24;
    do {
        tmp[--k] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    return put(b, tmp + k, (size_t)(24 - k));
}

static int put_i64(Buf *b, long long v) {
    if (v < 0) {
        if (put(b, "-", 1)) return -1;
        return put_u64(b, (unsigned long long)(-(v + 1)) + 1);
    }
    return put_u64(b, (unsigned long long)v);
}

static const char HEX[] = "0123456789abcdef";

/* a JSON string of UTF-8 bytes s[0..n), escaped as orjson escapes */
static int put_json_str(Buf *b, const char *s, size_t n) {
    if (buf_grow(b, n * 6 + 2)) return -1;
    char *o = b->p + b->n;
    *o++ = '"';
    for (size_t k = 0; k < n; k++) {
        unsigned char c = (unsigned char)s[k];
        if (c >= 0x20 && c != '"' && c != '\\') {
            *o++ = (char)c;
            continue;
        }
        *o++ = '\\';
        switch (c) {
            case '"': *o++ = '"'; break;
            case '\\': *o++ = '\\'; break;
            case '\b': *o++ = 'b'; break;
            case '\t': *o++ = 't'; break;
            case '\n': *o++ = 'n'; break;
            case '\f': *o++ = 'f'; break;
            case '\r': *o++ = 'r'; break;
            default:
                *o++ = 'u';
                *o++ = '0';
                *o++ = '0';
                *o++ = HEX[c >> 4];
                *o++ = HEX[c & 15];
        }
    }
    *o++ = '"';
    b->n = (size_t)(o - b->p);
    return 0;
}

/* 1: written; 0: a value this does not write (the Python path does); -1: an error set */
static int put_value(Buf *b, PyObject *v, int depth) {
    if (v == Py_None) return put(b, "null", 4) ? -1 : 1;
    if (v == Py_True) return put(b, "true", 4) ? -1 : 1;
    if (v == Py_False) return put(b, "false", 5) ? -1 : 1;
    if (PyUnicode_CheckExact(v)) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(v, &n);
        if (!s) { /* a lone surrogate: not UTF-8 */
            PyErr_Clear();
            return 0;
        }
        return put_json_str(b, s, (size_t)n) ? -1 : 1;
    }
    if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow) return 0;
        if (x == -1 && PyErr_Occurred()) return -1;
        return put_i64(b, x) ? -1 : 1;
    }
    if ((PyList_CheckExact(v) || PyTuple_CheckExact(v)) && depth < 8) {
        PyObject *seq = v;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (put(b, "[", 1)) return -1;
        for (Py_ssize_t k = 0; k < n; k++) {
            if (k && put(b, ",", 1)) return -1;
            int r = put_value(b, PySequence_Fast_GET_ITEM(seq, k), depth + 1);
            if (r <= 0) return r;
        }
        return put(b, "]", 1) ? -1 : 1;
    }
    return 0;
}

typedef struct {
    const char *s;
    Py_ssize_t n;
    PyObject *v; /* borrowed; NULL: one of the three fields made here */
    int made;    /* 1: count, 2: first_time, 3: last_time */
} Field;

static int field_cmp(const void *a, const void *b) {
    const Field *x = a, *y = b;
    Py_ssize_t n = x->n < y->n ? x->n : y->n;
    int c = memcmp(x->s, y->s, (size_t)n);
    if (c) return c;
    return (x->n > y->n) - (x->n < y->n);
}

static EVP_MD *SHA256_MD;

/* the content hash of core[0..n) as 64 hex digits and a newline, onto `out` */
static int put_hash(Buf *out, EVP_MD_CTX *ctx, const char *core, size_t n) {
    unsigned char md[32];
    unsigned int len = 0;
    if (!EVP_DigestInit_ex(ctx, SHA256_MD, NULL) || !EVP_DigestUpdate(ctx, core, n) ||
        !EVP_DigestFinal_ex(ctx, md, &len)) {
        PyErr_SetString(PyExc_RuntimeError, "sha256 failed");
        return -1;
    }
    if (buf_grow(out, 65)) return -1;
    char *o = out->p + out->n;
    for (int k = 0; k < 32; k++) {
        o[2 * k] = HEX[md[k] >> 4];
        o[2 * k + 1] = HEX[md[k] & 15];
    }
    o[64] = '\n';
    out->n += 65;
    return 0;
}

/* The text of a time's second, "YYYY-MM-DDTHH:MM:SS", from format.py's _second (called once a
 * second of the records' times), and the time as format_time writes it: that, '.', nine digits, 'Z'. */
typedef struct {
    PyObject *second_text; /* callable: seconds -> str */
    long long second;
    char text[64];
    Py_ssize_t text_n;
    char when[96];
    Py_ssize_t when_n;
} Clock;

/* 1: clock->when is t's; 0: a time this does not format; -1: an error */
static int clock_at(Clock *c, PyObject *tv) {
    if (!PyLong_CheckExact(tv)) return 0;
    int overflow = 0;
    long long t = PyLong_AsLongLongAndOverflow(tv, &overflow);
    if (overflow || t < 0) {
        if (t == -1 && PyErr_Occurred()) return -1;
        return 0;
    }
    long long sec = t / 1000000000LL, frac = t % 1000000000LL;
    if (sec != c->second) {
        PyObject *s = PyObject_CallFunction(c->second_text, "L", sec);
        if (!s) return -1;
        Py_ssize_t n;
        const char *u = PyUnicode_Check(s) ? PyUnicode_AsUTF8AndSize(s, &n) : NULL;
        if (!u || n > 60) {
            Py_DECREF(s);
            PyErr_Clear();
            return 0;
        }
        memcpy(c->text, u, (size_t)n);
        c->text_n = n;
        c->second = sec;
        Py_DECREF(s);
    }
    memcpy(c->when, c->text, (size_t)c->text_n);
    char *o = c->when + c->text_n;
    *o++ = '.';
    for (int k = 8; k >= 0; k--) {
        o[k] = (char)('0' + frac % 10);
        frac /= 10;
    }
    o[9] = 'Z';
    c->when_n = c->text_n + 11;
    return 1;
}

static int all_bytes(PyObject *const *xs, int n) {
    for (int k = 0; k < n; k++)
        if (!PyBytes_CheckExact(xs[k])) {
            PyErr_SetString(PyExc_TypeError, "the line's constant parts are bytes");
            return 0;
        }
    return 1;
}

static PyObject *result(Py_ssize_t i, Buf *lines, Buf *hashes, size_t longest) {
    PyObject *l = PyBytes_FromStringAndSize(lines->p ? lines->p : "", (Py_ssize_t)lines->n);
    PyObject *h = l ? PyBytes_FromStringAndSize(hashes->p ? hashes->p : "", (Py_ssize_t)hashes->n) : NULL;
    PyObject *out = h ? Py_BuildValue("(nNNn)", i, l, h, (Py_ssize_t)longest) : NULL;
    if (!out) {
        Py_XDECREF(l);
        Py_XDECREF(h);
    }
    return out;
}

static PyObject *K, *T, *N, *TL, *PATH, *OPEN;

/* opens(items, i, seq, id_, runid, after_source, core_mid, open_type, second_text) */
static PyObject *fast_opens(PyObject *self, PyObject *args) {
    PyObject *items, *id_, *runid, *after_source, *core_mid, *open_type;
    Py_ssize_t i;
    unsigned long long seq;
    Clock clock = {.second = -1};
    if (!PyArg_ParseTuple(args, "O!nKOOOOOO", &PyList_Type, &items, &i, &seq, &id_, &runid, &after_source,
                          &core_mid, &open_type, &clock.second_text))
        return NULL;
    PyObject *consts[] = {id_, runid, after_source, core_mid, open_type};
    if (!all_bytes(consts, 5)) return NULL;
    Buf lines = {0}, hashes = {0}, data = {0}, subj = {0}, core = {0};
    Field fields[64];
    size_t longest = 0;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx) return PyErr_NoMemory();
    Py_ssize_t count = PyList_GET_SIZE(items);
    for (; i < count; i++) {
        PyObject *rec = PyList_GET_ITEM(items, i);
        if (!PyDict_CheckExact(rec)) break;
        PyObject *k = PyDict_GetItemWithError(rec, K);
        if (!k || PyObject_RichCompareBool(k, OPEN, Py_EQ) != 1) break;
        if (PyDict_GetItemWithError(rec, N) || PyDict_GetItemWithError(rec, TL)) break;
        PyObject *path = PyDict_GetItemWithError(rec, PATH);
        if (!path || !PyUnicode_CheckExact(path)) break;
        PyObject *tv = PyDict_GetItemWithError(rec, T);
        if (!tv) break;
        int r = clock_at(&clock, tv);
        if (r < 0) goto fail;
        if (r == 0) break;
        /* the data: the record without k and t, with count 1 and its time as first and last */
        Py_ssize_t pos = 0, nf = 0;
        PyObject *key, *value;
        int ok = 1;
        while (PyDict_Next(rec, &pos, &key, &value)) {
            if (!PyUnicode_CheckExact(key) || nf >= 60) {
                ok = 0;
                break;
            }
            Py_ssize_t n;
            const char *s = PyUnicode_AsUTF8AndSize(key, &n);
            if (!s) {
                PyErr_Clear();
                ok = 0;
                break;
            }
            if ((n == 1 && (s[0] == 'k' || s[0] == 't')) || (n == 5 && !memcmp(s, "count", 5)) ||
                (n == 10 && (!memcmp(s, "first_time", 10))) || (n == 9 && !memcmp(s, "last_time", 9)))
                continue;
            fields[nf++] = (Field){s, n, value, 0};
        }
        if (!ok) break;
        fields[nf++] = (Field){"count", 5, NULL, 1};
        fields[nf++] = (Field){"first_time", 10, NULL, 2};
        fields[nf++] = (Field){"last_time", 9, NULL, 3};
        qsort(fields, (size_t)nf, sizeof(Field), field_cmp);
        data.n = 0;
        if (put(&data, "{", 1)) goto fail;
        for (Py_ssize_t f = 0; f < nf && ok; f++) {
            if (f && put(&data, ",", 1)) goto fail;
            if (put_json_str(&data, fields[f].s, (size_t)fields[f].n) || put(&data, ":", 1)) goto fail;
            if (fields[f].made == 1) {
                if (put(&data, "1", 1)) goto fail;
            } else if (fields[f].made) {
                if (put(&data, "\"", 1) || put(&data, clock.when, (size_t)clock.when_n) || put(&data, "\"", 1))
                    goto fail;
            } else {
                r = put_value(&data, fields[f].v, 0);
                if (r < 0) goto fail;
                ok = r;
            }
        }
        if (!ok || put(&data, "}", 1)) {
            if (ok) goto fail;
            break;
        }
        subj.n = 0;
        if (put_value(&subj, path, 0) != 1) {
            if (PyErr_Occurred()) goto fail;
            break;
        }
        /* the line, and the content hash's core */
        size_t start = lines.n;
        if (put(&lines, "{\"data\":", 8) || put(&lines, data.p, data.n) || put_bytes(&lines, id_) ||
            put_u64(&lines, seq) || put_bytes(&lines, runid) || put_u64(&lines, seq) ||
            put_bytes(&lines, after_source) || put(&lines, subj.p, subj.n) || put(&lines, ",\"time\":\"", 9) ||
            put(&lines, clock.when, (size_t)clock.when_n) || put(&lines, "\"", 1) || put_bytes(&lines, open_type) ||
            put(&lines, "\n", 1))
            goto fail;
        if (lines.n - start > longest) longest = lines.n - start;
        core.n = 0;
        if (put(&core, "{\"data\":", 8) || put(&core, data.p, data.n) || put_bytes(&core, core_mid) ||
            put(&core, subj.p, subj.n) || put_bytes(&core, open_type))
            goto fail;
        if (put_hash(&hashes, ctx, core.p, core.n)) goto fail;
        seq++;
    }
    if (PyErr_Occurred()) goto fail;
    PyObject *out = result(i, &lines, &hashes, longest);
    EVP_MD_CTX_free(ctx);
    free(lines.p), free(hashes.p), free(data.p), free(subj.p), free(core.p);
    return out;
fail:
    EVP_MD_CTX_free(ctx);
    free(lines.p), free(hashes.p), free(data.p), free(subj.p), free(core.p);
    return NULL;
}

/* repeats(items, i, seq, parts, id_, runid, after_seq, end, core_end, second_text) */
static PyObject *fast_repeats(PyObject *self, PyObject *args) {
    PyObject *items, *parts, *id_, *runid, *after_seq, *end, *core_end;
    Py_ssize_t i;
    unsigned long long seq;
    Clock clock = {.second = -1};
    if (!PyArg_ParseTuple(args, "O!nKO!OOOOOO", &PyList_Type, &items, &i, &seq, &PyTuple_Type, &parts, &id_,
                          &runid, &after_seq, &end, &core_end, &clock.second_text))
        return NULL;
    PyObject *consts[] = {id_, runid, after_seq, end, core_end};
    if (!all_bytes(consts, 5)) return NULL;
    Py_ssize_t nparts = PyTuple_GET_SIZE(parts);
    for (Py_ssize_t k = 0; k < nparts; k++)
        if (!PyBytes_CheckExact(PyTuple_GET_ITEM(parts, k))) {
            PyErr_SetString(PyExc_TypeError, "the data's parts are bytes");
            return NULL;
        }
    Buf lines = {0}, hashes = {0}, data = {0}, core = {0};
    size_t longest = 0;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx) return PyErr_NoMemory();
    Py_ssize_t count = PyList_GET_SIZE(items);
    for (; i < count; i++) {
        PyObject *tv = PyList_GET_ITEM(items, i);
        if (!PyLong_CheckExact(tv)) break;
        int r = clock_at(&clock, tv);
        if (r < 0) goto fail;
        if (r == 0) break;
        data.n = 0;
        for (Py_ssize_t k = 0; k < nparts; k++) {
            if (k && (put(&data, "\"", 1) || put(&data, clock.when, (size_t)clock.when_n) || put(&data, "\"", 1)))
                goto fail;
            if (put_bytes(&data, PyTuple_GET_ITEM(parts, k))) goto fail;
        }
        size_t start = lines.n;
        if (put(&lines, "{\"data\":", 8) || put(&lines, data.p, data.n) || put_bytes(&lines, id_) ||
            put_u64(&lines, seq) || put_bytes(&lines, runid) || put_u64(&lines, seq) ||
            put_bytes(&lines, after_seq) || put(&lines, clock.when, (size_t)clock.when_n) || put_bytes(&lines, end))
            goto fail;
        if (lines.n - start > longest) longest = lines.n - start;
        core.n = 0;
        if (put(&core, "{\"data\":", 8) || put(&core, data.p, data.n) || put_bytes(&core, core_end)) goto fail;
        if (put_hash(&hashes, ctx, core.p, core.n)) goto fail;
        seq++;
    }
    PyObject *out = result(i, &lines, &hashes, longest);
    EVP_MD_CTX_free(ctx);
    free(lines.p), free(hashes.p), free(data.p), free(core.p);
    return out;
fail:
    EVP_MD_CTX_free(ctx);
    free(lines.p), free(hashes.p), free(data.p), free(core.p);
    return NULL;
}

static PyMethodDef methods[] = {
    {"opens", fast_opens, METH_VARARGS, "The events of plain open records from items[i] (see the module's head)."},
    {"repeats", fast_repeats, METH_VARARGS, "The events of repeats (times) from items[i] (see the module's head)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fast", "Full detail's hot path in C.", -1, methods};

PyMODINIT_FUNC PyInit__fast(void) {
    SHA256_MD = EVP_MD_fetch(NULL, "SHA256", NULL);
    if (!SHA256_MD) {
        PyErr_SetString(PyExc_ImportError, "OpenSSL has no SHA256");
        return NULL;
    }
    K = PyUnicode_InternFromString("k");
    T = PyUnicode_InternFromString("t");
    N = PyUnicode_InternFromString("n");
    TL = PyUnicode_InternFromString("tl");
    PATH = PyUnicode_InternFromString("path");
    OPEN = PyUnicode_InternFromString("open");
    if (!K || !T || !N || !TL || !PATH || !OPEN) return NULL;
    return PyModule_Create(&module);
}
