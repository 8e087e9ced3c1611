/* Full detail's hot path in C (issue 27). Each function does what a piece of the Python path does,
 * for the cases that make up a flood, and hands everything else back to it; the Python path is the
 * reference, and tests/unit/test_fast.py holds both byte-identical on generated records (hypothesis).
 * Built by `make setup` (setup.py) as evidence.bundle._fast; EVIDENCE_PURE_PYTHON=1 leaves it unused.
 *
 * From the ring buffer to the spool (probes/ringbuf.py, agent/recorder/pipeline.py, correlate.py):
 * - ring_read: RingBuffer.read's loop (given to the ring by the pipeline: probes/ imports nothing);
 * - process_opens: Pipeline._process's loop over the plain opens that follow one of the same run;
 * - open_plain: Correlator.open_record's plain case (an absolute name, through its directory's
 *   cached names, the descriptor entered in the process's table);
 * - spilled: _Spill.read's records of a batch the poller wrote to disk (a flood's, nearly all).
 * The run id's behaviour (bundle/run_id.py):
 * - LineSet: Behaviour.add of plain opens whose path no normalisation rule can change, each
 *   item kept as its line in a sorted run alone (no Python object an item), spilled sorted.
 * Full detail's events (bundle/premade.py, bundle/sink.py EventSink._full_batch):
 * - marked: a repeated open's spool line as its time;
 * - opens(items, i, seq, consts): the events of the plain open records items[i], items[i+1], ...
 *   (dicts: an open that stands for itself), up to the first item it does not take (a repeat's time,
 *   another kind, a value canonical JSON here does not write: a float, a nested object, an integer
 *   past 64 bits, a string that is not UTF-8), which the Python path makes;
 * - repeats(items, i, seq, parts, consts): the events of the repeats items[i], ... (ints: a record's
 *   time, the record before repeated at it), its data cut at its time (`parts`).
 *   Each returns (the index it stopped at, the lines joined, their content hashes as 64 hex digits
 *   and a newline each, the longest line's length); with `defer` true, in place of the hashes
 *   what they are taken over, (cores, ends), for
 * - open_lines(items, i, seq, consts): opens() from the spool's lines (bytes), with the GIL let go:
 *   the premade's own thread makes them beside the correlator (src/fast/lines.h);
 * - hash_cores(cores, ends): those hashes, made without the GIL on the premade hashes' file's own
 *   thread (bundle/premade.py), not the correlator's.
 * - merge_items(fds, lines, update): the run id's sorted runs (bundle/run_id.py _SpillSet) merged
 *   and their items handed to the hash, reading and merging without the GIL;
 * - translate(data, table): bytes.translate, without the GIL: the run id put in the premade lines
 *   at the run's end (bundle/writer.py _take_premade);
 * - ZFile: the premade files' compression and writes on a thread that never takes the GIL
 *   (src/fast/zfile.h).
 *
 * Canonical JSON as orjson writes it with sorted keys (bundle/canonical.py): '"' and '\\' escaped,
 * control characters as \b \t \n \f \r or \u00xx (lowercase), everything else as its UTF-8; keys
 * sorted by their UTF-8 bytes (code point order). The content hash is OpenSSL's SHA-256.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/evp.h>
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <zstd.h>

#include "buf.h"


static int buf_grow_nogil(Buf *b, size_t more) { /* buf_grow without the GIL: -1, no error set */
    size_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->n + more) cap *= 2;
    if (cap == b->cap) return 0;
    char *p = realloc(b->p, cap);
    if (!p) return -1;
    b->p = p;
    b->cap = cap;
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

/* the UTF-8 bytes s[0..n) escaped as orjson escapes them in a JSON string, at o (room for 6 * n
 * bytes); where they end */
static inline char *escaped(char *o, const char *s, size_t n) {
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
    return o;
}

/* a JSON string of the UTF-8 bytes s[0..n) and then t[0..tn) (a name's two parts: its directory's
 * and its own), escaped as orjson escapes */
static int put_json_str2(Buf *b, const char *s, size_t n, const char *t, size_t tn) {
    if (buf_grow(b, (n + tn) * 6 + 2)) return -1;
    char *o = b->p + b->n;
    *o++ = '"';
    o = escaped(o, s, n);
    o = escaped(o, t, tn);
    *o++ = '"';
    b->n = (size_t)(o - b->p);
    return 0;
}

static int put_json_str(Buf *b, const char *s, size_t n) { return put_json_str2(b, s, n, NULL, 0); }

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
    int at;      /* its place in the record's own order */
} Field;

static int field_cmp(const void *a, const void *b) {
    const Field *x = a, *y = b;
    Py_ssize_t n = x->n < y->n ? x->n : y->n;
    int c = memcmp(x->s, y->s, (size_t)n);
    if (c) return c;
    return (x->n > y->n) - (x->n < y->n);
}

static EVP_MD *SHA256_MD;

/* the content hash of core[0..n) as 64 hex digits and a newline at o[0..65): 1, or 0 when OpenSSL
 * failed (no Python error set: called without the GIL) */
static int hash_into(char *o, EVP_MD_CTX *ctx, const char *core, size_t n) {
    unsigned char md[32];
    unsigned int len = 0;
    if (!EVP_DigestInit_ex(ctx, SHA256_MD, NULL) || !EVP_DigestUpdate(ctx, core, n) ||
        !EVP_DigestFinal_ex(ctx, md, &len))
        return 0;
    for (int k = 0; k < 32; k++) {
        o[2 * k] = HEX[md[k] >> 4];
        o[2 * k + 1] = HEX[md[k] & 15];
    }
    o[64] = '\n';
    return 1;
}

/* A batch's content hash cores, one after the other (`cores`), and where each ends (`ends`, size_t
 * offsets), hashed at the batch's end with the GIL let go (SHA-256 is a third of an open's event:
 * the poller and the compressing threads run meanwhile). */
static int end_core(Buf *cores, Buf *ends) {
    size_t at = cores->n;
    return put(ends, (const char *)&at, sizeof at);
}

/* the content hashes of `count` cores, one after the other at `cores`, each ending where `ends`
 * (size_t offsets) says, at o[0..65 * count): 1, or 0 when OpenSSL failed (no Python call: put_hashes
 * and zfile.h's thread call it without the GIL) */
static int hash_run(char *o, EVP_MD_CTX *ctx, const char *cores, const char *ends, size_t count) {
    size_t from = 0;
    for (size_t k = 0; k < count; k++) {
        size_t to;
        memcpy(&to, ends + k * sizeof to, sizeof to);
        if (!hash_into(o + 65 * k, ctx, cores + from, to - from)) return 0;
        from = to;
    }
    return 1;
}

/* whether `ends` (n bytes of size_t offsets) are a run of cores' ends within `cores_n` bytes: in
 * order, none past them (what hash_run reads; hash_cores and ZFile.put check what they are given) */
static int ends_fit(const char *ends, size_t n, size_t cores_n) {
    if (n % sizeof(size_t)) return 0;
    size_t last = 0;
    for (size_t k = 0; k < n / sizeof(size_t); k++) {
        size_t to;
        memcpy(&to, ends + k * sizeof to, sizeof to);
        if (to < last || to > cores_n) return 0;
        last = to;
    }
    return 1;
}

static int put_hashes(Buf *out, EVP_MD_CTX *ctx, const Buf *cores, const Buf *ends) {
    size_t count = ends->n / sizeof(size_t);
    if (!count) return 0;
    if (buf_grow(out, 65 * count)) return -1;
    char *o = out->p + out->n;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = hash_run(o, ctx, cores->p, ends->p, count);
    Py_END_ALLOW_THREADS
    if (!ok) {
        PyErr_SetString(PyExc_RuntimeError, "sha256 failed");
        return -1;
    }
    out->n += 65 * count;
    return 0;
}

/* A time as format.format_time writes it, "YYYY-MM-DDTHH:MM:SS.nnnnnnnnnZ" (WHEN_N bytes), its
 * second's text made here (gmtime_r, as format._second's strftime writes it: UTC, four-digit years;
 * another year is the Python path's) once a second of the records' times. No Python call: open_lines
 * uses it with the GIL let go. */
#define WHEN_N 30
typedef struct {
    long long second;
    char when[WHEN_N]; /* the second's text in its first 19 bytes */
} Clock;

/* 1: c->when is t's (ns since the epoch, t >= 0); 0: a time this does not format */
static int clock_set(Clock *c, long long t) {
    if (t < 0) return 0;
    long long sec = t / 1000000000LL, frac = t % 1000000000LL;
    if (sec != c->second) {
        time_t tt = (time_t)sec;
        struct tm tm;
        if ((long long)tt != sec || !gmtime_r(&tt, &tm) || tm.tm_year + 1900 < 1000 || tm.tm_year + 1900 > 9999)
            return 0;
        int v[6] = {tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec};
        char *o = c->when;
        for (int k = 3; k >= 0; k--) o[k] = (char)('0' + v[0] % 10), v[0] /= 10;
        o += 4;
        for (int f = 1; f < 6; f++) {
            *o++ = f == 3 ? 'T' : f < 3 ? '-' : ':';
            *o++ = (char)('0' + v[f] / 10);
            *o++ = (char)('0' + v[f] % 10);
        }
        c->second = sec;
    }
    c->when[19] = '.';
    for (int k = 8; k >= 0; k--) c->when[20 + k] = (char)('0' + frac % 10), frac /= 10;
    c->when[29] = 'Z';
    return 1;
}

/* clock_set of an int object: 1, 0 (not an int this formats), or -1 with an error set */
static int clock_at(Clock *c, PyObject *tv) {
    if (!PyLong_CheckExact(tv)) return 0;
    int overflow = 0;
    long long t = PyLong_AsLongLongAndOverflow(tv, &overflow);
    if (t == -1 && PyErr_Occurred()) return -1;
    return overflow ? 0 : clock_set(c, t);
}

static int all_bytes(PyObject *const *xs, int n) {
    for (int k = 0; k < n; k++)
        if (!PyBytes_CheckExact(xs[k])) {
            PyErr_SetString(PyExc_TypeError, "the line's constant parts are bytes");
            return 0;
        }
    return 1;
}

/* A Buf whose bytes are a bytes object's own, grown in place (realloc: a large one is remapped,
 * not copied) and cut to its length at the end: a batch's lines (10 MB for 16,384 distinct opens)
 * are never held twice, as a buffer and as its copy. 0, or -1 with MemoryError set. */
static int bytes_buf(Buf *b) {
    b->bytes = PyBytes_FromStringAndSize(NULL, 1 << 16);
    if (!b->bytes) return -1;
    b->p = PyBytes_AS_STRING(b->bytes);
    b->n = 0;
    b->cap = 1 << 16;
    return 0;
}

/* the bytes of a bytes_buf, its own from now (NULL with an error set) */
static PyObject *bytes_buf_take(Buf *b) {
    PyObject *o = b->bytes;
    b->bytes = NULL;
    b->p = NULL;
    if (o && _PyBytes_Resize(&o, (Py_ssize_t)b->n)) return NULL;
    return o;
}

static void bytes_buf_drop(Buf *b) {
    Py_CLEAR(b->bytes);
    b->p = NULL;
}

/* (i, a, b, longest), or NULL with an error set (a or b NULL: one was not made); a's and b's
 * references are let go either way (Py_BuildValue's "N" would take them even when it fails) */
static PyObject *quad(Py_ssize_t i, PyObject *a, PyObject *b, size_t longest) {
    PyObject *out = a && b ? Py_BuildValue("(nOOn)", i, a, b, (Py_ssize_t)longest) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    return out;
}

static PyObject *result(Py_ssize_t i, Buf *lines, Buf *hashes, size_t longest) {
    PyObject *l = bytes_buf_take(lines);
    PyObject *h = l ? PyBytes_FromStringAndSize(hashes->p ? hashes->p : "", (Py_ssize_t)hashes->n) : NULL;
    return quad(i, l, h, longest);
}

/* opens' and repeats' result: (the index it stopped at, the lines, their content hashes, the
 * longest line's length); `defer`: in place of the hashes, (cores, ends) as bytes, which
 * hash_cores hashes later, on another thread (bundle/premade.py: the correlator's goes on). */
static PyObject *batch_result(Py_ssize_t i, Buf *lines, Buf *hashes, EVP_MD_CTX *ctx, const Buf *core,
                              const Buf *ends, size_t longest, int defer) {
    if (!defer) return put_hashes(hashes, ctx, core, ends) ? NULL : result(i, lines, hashes, longest);
    PyObject *pending = Py_BuildValue("(y#y#)", core->p ? core->p : "", (Py_ssize_t)core->n,
                                      ends->p ? ends->p : "", (Py_ssize_t)ends->n);
    PyObject *l = pending ? bytes_buf_take(lines) : NULL;
    return quad(i, l, pending, longest);
}

/* hash_cores(cores, ends): the content hashes that opens or repeats deferred (64 hex digits and a
 * newline each), hashed without the GIL */
static PyObject *fast_hash_cores(PyObject *self, PyObject *args) {
    Py_buffer cores, ends;
    if (!PyArg_ParseTuple(args, "y*y*", &cores, &ends)) return NULL;
    PyObject *out = NULL;
    Buf hashes = {0};
    if (!ends_fit(ends.buf, (size_t)ends.len, (size_t)cores.len)) {
        PyErr_SetString(PyExc_ValueError, "the cores' ends are not theirs");
        goto done;
    }
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx) {
        PyErr_NoMemory();
        goto done;
    }
    Buf c = {.p = cores.buf, .n = (size_t)cores.len}, e = {.p = ends.buf, .n = (size_t)ends.len};
    if (bytes_buf(&hashes) == 0 && put_hashes(&hashes, ctx, &c, &e) == 0) out = bytes_buf_take(&hashes);
    bytes_buf_drop(&hashes);
    EVP_MD_CTX_free(ctx);
done:
    PyBuffer_Release(&cores);
    PyBuffer_Release(&ends);
    return out;
}

static PyObject *K, *T, *N, *TL, *PATH, *OPEN;

/* opens(items, i, seq, id_, runid, after_source, core_mid, open_type) */
static PyObject *fast_opens(PyObject *self, PyObject *args) {
    PyObject *items, *id_, *runid, *after_source, *core_mid, *open_type;
    Py_ssize_t i;
    unsigned long long seq;
    Clock clock = {.second = -1};
    int defer = 0;
    if (!PyArg_ParseTuple(args, "O!nKOOOOO|p", &PyList_Type, &items, &i, &seq, &id_, &runid, &after_source,
                          &core_mid, &open_type, &defer))
        return NULL;
    PyObject *consts[] = {id_, runid, after_source, core_mid, open_type};
    if (!all_bytes(consts, 5)) return NULL;
    Buf lines = {0}, hashes = {0}, data = {0}, subj = {0}, core = {0}, ends = {0};
    if (bytes_buf(&lines)) return NULL;
    Field fields[64], given[64];
    /* the last record's keys in its order (borrowed: the records are alive in `items` until this
     * returns), and where each went in the sorted order: a record with the same keys in the same
     * order (every open the correlator makes) is sorted as the one before it */
    PyObject *keys_before[64];
    int order[64], n_before = -1;
    size_t longest = 0;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx) {
        bytes_buf_drop(&lines);
        return PyErr_NoMemory();
    }
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
        PyObject *key, *value, *keys[64];
        int ok = 1, same = 1;
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
            if (same && (nf >= n_before || keys_before[nf] != key)) same = 0;
            keys[nf] = key;
            given[nf] = (Field){s, n, value, 0, (int)nf};
            nf++;
        }
        if (!ok) break;
        if (nf != n_before) same = 0;
        given[nf] = (Field){"count", 5, NULL, 1, (int)nf};
        given[nf + 1] = (Field){"first_time", 10, NULL, 2, (int)nf + 1};
        given[nf + 2] = (Field){"last_time", 9, NULL, 3, (int)nf + 2};
        Py_ssize_t nkeys = nf;
        nf += 3;
        if (same) {
            for (Py_ssize_t f = 0; f < nf; f++) fields[f] = given[order[f]];
        } else {
            memcpy(fields, given, sizeof(Field) * (size_t)nf);
            qsort(fields, (size_t)nf, sizeof(Field), field_cmp);
            for (Py_ssize_t f = 0; f < nf; f++) order[f] = fields[f].at;
            memcpy(keys_before, keys, sizeof(PyObject *) * (size_t)nkeys);
            n_before = (int)nkeys;
        }
        data.n = 0;
        if (put(&data, "{", 1)) goto fail;
        for (Py_ssize_t f = 0; f < nf && ok; f++) {
            if (f && put(&data, ",", 1)) goto fail;
            if (put_json_str(&data, fields[f].s, (size_t)fields[f].n) || put(&data, ":", 1)) goto fail;
            if (fields[f].made == 1) {
                if (put(&data, "1", 1)) goto fail;
            } else if (fields[f].made) {
                if (put(&data, "\"", 1) || put(&data, clock.when, WHEN_N) || put(&data, "\"", 1))
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
            put(&lines, clock.when, WHEN_N) || put(&lines, "\"", 1) || put_bytes(&lines, open_type) ||
            put(&lines, "\n", 1))
            goto fail;
        if (lines.n - start > longest) longest = lines.n - start;
        if (put(&core, "{\"data\":", 8) || put(&core, data.p, data.n) || put_bytes(&core, core_mid) ||
            put(&core, subj.p, subj.n) || put_bytes(&core, open_type) || end_core(&core, &ends))
            goto fail;
        seq++;
    }
    if (PyErr_Occurred()) goto fail;
    PyObject *out = batch_result(i, &lines, &hashes, ctx, &core, &ends, longest, defer);
    if (!out) goto fail;
    EVP_MD_CTX_free(ctx);
    free(hashes.p), free(data.p), free(subj.p), free(core.p), free(ends.p);
    return out;
fail:
    EVP_MD_CTX_free(ctx);
    bytes_buf_drop(&lines);
    free(hashes.p), free(data.p), free(subj.p), free(core.p), free(ends.p);
    return NULL;
}

/* repeats(items, i, seq, parts, id_, runid, after_seq, end, core_end) */
static PyObject *fast_repeats(PyObject *self, PyObject *args) {
    PyObject *items, *parts, *id_, *runid, *after_seq, *end, *core_end;
    Py_ssize_t i;
    unsigned long long seq;
    Clock clock = {.second = -1};
    int defer = 0;
    if (!PyArg_ParseTuple(args, "O!nKO!OOOOO|p", &PyList_Type, &items, &i, &seq, &PyTuple_Type, &parts, &id_,
                          &runid, &after_seq, &end, &core_end, &defer))
        return NULL;
    PyObject *consts[] = {id_, runid, after_seq, end, core_end};
    if (!all_bytes(consts, 5)) return NULL;
    Py_ssize_t nparts = PyTuple_GET_SIZE(parts);
    for (Py_ssize_t k = 0; k < nparts; k++)
        if (!PyBytes_CheckExact(PyTuple_GET_ITEM(parts, k))) {
            PyErr_SetString(PyExc_TypeError, "the data's parts are bytes");
            return NULL;
        }
    Buf lines = {0}, hashes = {0}, data = {0}, core = {0}, ends = {0};
    size_t longest = 0;
    if (bytes_buf(&lines)) return NULL;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx) {
        bytes_buf_drop(&lines);
        return PyErr_NoMemory();
    }
    Py_ssize_t count = PyList_GET_SIZE(items);
    for (; i < count; i++) {
        PyObject *tv = PyList_GET_ITEM(items, i);
        if (!PyLong_CheckExact(tv)) break;
        int r = clock_at(&clock, tv);
        if (r < 0) goto fail;
        if (r == 0) break;
        data.n = 0;
        for (Py_ssize_t k = 0; k < nparts; k++) {
            if (k && (put(&data, "\"", 1) || put(&data, clock.when, WHEN_N) || put(&data, "\"", 1)))
                goto fail;
            if (put_bytes(&data, PyTuple_GET_ITEM(parts, k))) goto fail;
        }
        size_t start = lines.n;
        if (put(&lines, "{\"data\":", 8) || put(&lines, data.p, data.n) || put_bytes(&lines, id_) ||
            put_u64(&lines, seq) || put_bytes(&lines, runid) || put_u64(&lines, seq) ||
            put_bytes(&lines, after_seq) || put(&lines, clock.when, WHEN_N) || put_bytes(&lines, end))
            goto fail;
        if (lines.n - start > longest) longest = lines.n - start;
        if (put(&core, "{\"data\":", 8) || put(&core, data.p, data.n) || put_bytes(&core, core_end) ||
            end_core(&core, &ends))
            goto fail;
        seq++;
    }
    PyObject *out = batch_result(i, &lines, &hashes, ctx, &core, &ends, longest, defer);
    if (!out) goto fail;
    EVP_MD_CTX_free(ctx);
    free(hashes.p), free(data.p), free(core.p), free(ends.p);
    return out;
fail:
    EVP_MD_CTX_free(ctx);
    bytes_buf_drop(&lines);
    free(hashes.p), free(data.p), free(core.p), free(ends.p);
    return NULL;
}

#include "lines.h" /* open_lines, and the spool lines' reader add_files uses */

/* needs_normal(path, roots): whether Normalizer.text may change `path` (bundle/normalize.py): it
 * is one of the roots or below one, or it holds what a builtin rule starts from ("/proc/", "tmp",
 * 32 hex digits). 0: it is its own normal form. */
static int needs_normal(const char *s, Py_ssize_t n, PyObject *roots) {
    Py_ssize_t nr = PyTuple_GET_SIZE(roots);
    for (Py_ssize_t k = 0; k < nr; k++) {
        PyObject *r = PyTuple_GET_ITEM(roots, k);
        Py_ssize_t rn = PyBytes_GET_SIZE(r);
        if (n >= rn && !memcmp(s, PyBytes_AS_STRING(r), (size_t)rn) && (n == rn || s[rn] == '/')) return 1;
    }
    int hex = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        char c = s[k];
        if (c == 't' && k + 2 < n && s[k + 1] == 'm' && s[k + 2] == 'p') return 1;
        if (c == '/' && k + 5 < n && !memcmp(s + k, "/proc/", 6)) return 1;
        hex = ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')) ? hex + 1 : 0;
        if (hex >= 32) return 1;
    }
    return 0;
}

static PyObject *ACCESS, *RESULT;

static int put_repr(Buf *b, PyObject *v, int depth);

/* whether list `l` holds the very items of tuple `t` (a tuple made of it before, unchanged) */
static int same_items(PyObject *l, PyObject *t) {
    if (!t || PyList_GET_SIZE(l) != PyTuple_GET_SIZE(t)) return 0;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(l); k++)
        if (PyList_GET_ITEM(l, k) != PyTuple_GET_ITEM(t, k)) return 0;
    return 1;
}

/* LineSet: the run id's file items of plain opens (bundle/run_id.py _SpillSet.fast), each kept as
 * its line in a sorted run (repr, a tab, canonical JSON, a newline) and nothing else: no tuple, no
 * bytes object, no set entry of Python's per item. The lines sit back to back in one arena, found
 * again through a table keyed by the hash of the line's bytes (Python's keyed one, _Py_HashBytes: a
 * job cannot flood it with names made to collide), compared by their bytes. A spill
 * sorts them as Python sorts bytes (memcmp, then the shorter first) and writes them to a file
 * without the GIL. An item the Python path also holds (Behaviour.add's, in the set's `items`) may
 * be in both: the merge of the sorted runs takes each line once (_SpillSet.canonical_items). */
typedef struct {
    PyObject_HEAD
    char *arena;
    size_t used, cap;
    size_t *off;     /* line k: arena + off[k], len[k] bytes, its newline included */
    uint32_t *len;
    Py_hash_t *hash; /* line k's item hash */
    size_t count, lcap;
    uint32_t *table; /* open addressing: 0 empty, else k + 1 */
    size_t tmask;    /* the table's size - 1 (a power of two); 0 before the first line */
} LineSet;

static void lineset_clear(LineSet *ls) {
    free(ls->arena), free(ls->off), free(ls->len), free(ls->hash), free(ls->table);
    ls->arena = NULL, ls->off = NULL, ls->len = NULL, ls->hash = NULL, ls->table = NULL;
    ls->used = ls->cap = ls->count = ls->lcap = ls->tmask = 0;
}

static void lineset_dealloc(LineSet *ls) {
    lineset_clear(ls);
    Py_TYPE(ls)->tp_free((PyObject *)ls);
}

static Py_ssize_t lineset_len(LineSet *ls) { return (Py_ssize_t)ls->count; }

/* the table twice as large (or its first), every line entered again: 0, or -1 with MemoryError */
static int lineset_grow_table(LineSet *ls) {
    size_t size = ls->tmask ? 2 * (ls->tmask + 1) : 1 << 12;
    uint32_t *t = calloc(size, sizeof *t);
    if (!t) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t k = 0; k < ls->count; k++) {
        size_t at = (size_t)ls->hash[k] & (size - 1);
        while (t[at]) at = (at + 1) & (size - 1);
        t[at] = (uint32_t)(k + 1);
    }
    free(ls->table);
    ls->table = t;
    ls->tmask = size - 1;
    return 0;
}

/* `line` (n bytes) of item hash h entered: 1 new, 0 already there, -1 with an error set */
static int lineset_add(LineSet *ls, const char *line, size_t n, Py_hash_t h) {
    if (n >= UINT32_MAX || ls->count >= UINT32_MAX - 1) {
        PyErr_SetString(PyExc_OverflowError, "a line set past 2^32 lines or a line past 4 GiB");
        return -1;
    }
    if ((ls->count + 1) * 2 > ls->tmask + 1 && lineset_grow_table(ls)) return -1; /* at most half full */
    size_t at = (size_t)h & ls->tmask;
    for (uint32_t e; (e = ls->table[at]); at = (at + 1) & ls->tmask) {
        size_t k = e - 1;
        if (ls->hash[k] == h && ls->len[k] == n && !memcmp(ls->arena + ls->off[k], line, n)) return 0;
    }
    if (ls->count == ls->lcap) {
        size_t lcap = ls->lcap ? 2 * ls->lcap : 1 << 12;
        size_t *off = realloc(ls->off, lcap * sizeof *off);
        if (off) ls->off = off;
        uint32_t *len = off ? realloc(ls->len, lcap * sizeof *len) : NULL;
        if (len) ls->len = len;
        Py_hash_t *hash = len ? realloc(ls->hash, lcap * sizeof *hash) : NULL;
        if (!hash) {
            PyErr_NoMemory();
            return -1;
        }
        ls->hash = hash;
        ls->lcap = lcap;
    }
    if (ls->used + n > ls->cap) {
        size_t cap = ls->cap ? ls->cap : 1 << 16;
        while (cap < ls->used + n) cap *= 2;
        char *arena = realloc(ls->arena, cap);
        if (!arena) {
            PyErr_NoMemory();
            return -1;
        }
        ls->arena = arena;
        ls->cap = cap;
    }
    memcpy(ls->arena + ls->used, line, n);
    ls->off[ls->count] = ls->used;
    ls->len[ls->count] = (uint32_t)n;
    ls->hash[ls->count] = h;
    ls->used += n;
    ls->count++;
    ls->table[at] = (uint32_t)ls->count;
    return 1;
}

typedef struct {
    const char *p;
    uint32_t n;
} LineRef;

static int line_cmp(const void *a, const void *b) {
    const LineRef *x = a, *y = b;
    int c = memcmp(x->p, y->p, x->n < y->n ? x->n : y->n);
    return c ? c : (x->n > y->n) - (x->n < y->n);
}

/* spill(fd): the lines, sorted, written to file descriptor fd (at its position), then forgotten */
#define SPILL_LEVEL 1 /* the sorted runs' zstandard level */

static PyObject *lineset_spill(LineSet *ls, PyObject *args) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd)) return NULL;
    LineRef *refs = ls->count ? malloc(ls->count * sizeof *refs) : NULL;
    char *out = ls->count ? malloc(ls->used) : NULL;
    if (ls->count && (!refs || !out)) {
        free(refs), free(out);
        return PyErr_NoMemory();
    }
    int err = 0;
    char *z = NULL;
    Py_BEGIN_ALLOW_THREADS
    for (size_t k = 0; k < ls->count; k++) refs[k] = (LineRef){ls->arena + ls->off[k], ls->len[k]};
    qsort(refs, ls->count, sizeof *refs, line_cmp);
    size_t w = 0;
    for (size_t k = 0; k < ls->count; k++) {
        memcpy(out + w, refs[k].p, refs[k].n);
        w += refs[k].n;
    }
    /* written as one zstandard frame (merge_items and _SpillSet read either form): sorted names
     * share their beginnings, a tenth of the bytes to write, and the pages the page cache takes
     * were most of a spill's cost (a 2 x 1M flood's 200 MB of runs, 0.8 s) */
    size_t bound = ZSTD_compressBound(w);
    z = w ? malloc(bound) : NULL;
    size_t zn = z ? ZSTD_compress(z, bound, out, w, SPILL_LEVEL) : 0;
    if (w && (!z || ZSTD_isError(zn))) err = z ? EIO : ENOMEM;
    for (size_t done = 0; done < zn && !err;) {
        ssize_t r = write(fd, z + done, zn - done);
        if (r < 0 && errno != EINTR) err = errno;
        if (r > 0) done += (size_t)r;
    }
    Py_END_ALLOW_THREADS
    free(refs), free(out), free(z);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    lineset_clear(ls);
    Py_RETURN_NONE;
}

/* take(): a new LineSet holding these lines, this one left empty (for a spill on another thread) */
static PyObject *lineset_take(LineSet *ls, PyObject *unused) {
    LineSet *t = (LineSet *)PyType_GenericNew(Py_TYPE(ls), NULL, NULL);
    if (!t) return NULL;
    t->arena = ls->arena, t->used = ls->used, t->cap = ls->cap, t->off = ls->off, t->len = ls->len;
    t->hash = ls->hash, t->count = ls->count, t->lcap = ls->lcap, t->table = ls->table, t->tmask = ls->tmask;
    ls->arena = NULL, ls->off = NULL, ls->len = NULL, ls->hash = NULL, ls->table = NULL;
    ls->used = ls->cap = ls->count = ls->lcap = ls->tmask = 0;
    return (PyObject *)t;
}

/* lines(): a list of the lines as bytes, in the order they came */
static PyObject *lineset_lines(LineSet *ls, PyObject *unused) {
    PyObject *out = PyList_New((Py_ssize_t)ls->count);
    for (size_t k = 0; out && k < ls->count; k++) {
        PyObject *b = PyBytes_FromStringAndSize(ls->arena + ls->off[k], ls->len[k]);
        if (!b) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)k, b);
    }
    return out;
}

/* add_files(records, roots): what Behaviour.add adds to its files for each open of `records` whose
 * path is its own normal form (needs_normal), as lines here. Returns (how many were new, the
 * records it did not take: every other kind, opens whose path the Normalizer may change, and those
 * with a value not written here, for Behaviour.add); a spool line (bytes) adds nothing: a repeated
 * open's, or a plain open's, whose item process_opens added as it made the line. */
static PyObject *lineset_add_files(LineSet *ls, PyObject *args) {
    PyObject *recs, *roots;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &recs, &PyTuple_Type, &roots)) return NULL;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(roots); k++)
        if (!PyBytes_CheckExact(PyTuple_GET_ITEM(roots, k))) {
            PyErr_SetString(PyExc_TypeError, "roots are bytes");
            return NULL;
        }
    Buf line = {0};
    PyObject *rest = PyList_New(0);
    if (!rest) return NULL;
    PyObject *last_list = NULL, *last_acc = NULL; /* the last access list and its tuple */
    Py_ssize_t added = 0, n = PyList_GET_SIZE(recs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *rec = PyList_GET_ITEM(recs, i);
        if (PyBytes_CheckExact(rec)) continue;
        int took = 0;
        if (PyDict_CheckExact(rec)) {
            PyObject *k = PyDict_GetItemWithError(rec, K);
            PyObject *path = k ? PyDict_GetItemWithError(rec, PATH) : NULL;
            PyObject *access = path ? PyDict_GetItemWithError(rec, ACCESS) : NULL;
            PyObject *res = access ? PyDict_GetItemWithError(rec, RESULT) : NULL;
            if (PyErr_Occurred()) goto fail;
            if (res && PyUnicode_CheckExact(k) && PyUnicode_CheckExact(path) &&
                (PyList_CheckExact(access) || PyTuple_CheckExact(access)) &&
                PyUnicode_CompareWithASCIIString(k, "open") == 0) {
                Py_ssize_t pn;
                const char *ps = PyUnicode_AsUTF8AndSize(path, &pn);
                if (!ps) PyErr_Clear();
                if (ps && !needs_normal(ps, pn, roots)) {
                    PyObject *acc;
                    if (access == last_list && same_items(access, last_acc)) {
                        acc = Py_NewRef(last_acc); /* (the correlator's opens share their access lists) */
                    } else {
                        acc = PyList_CheckExact(access) ? PyList_AsTuple(access) : Py_NewRef(access);
                        if (acc && PyList_CheckExact(access)) {
                            Py_XSETREF(last_acc, Py_NewRef(acc));
                            last_list = access; /* (compared by identity, its items checked each time) */
                        }
                    }
                    if (!acc) goto fail;
                    /* its line in a sorted run: repr, a tab, canonical JSON (_SpillSet), as of the
                     * tuple (path, access, result); r 0: a value not written here, for Behaviour.add */
                    line.n = 0;
                    int r = put(&line, "(", 1) || put_repr(&line, path, 1) || put(&line, ", ", 2) ||
                                    put_repr(&line, acc, 1) || put(&line, ", ", 2) || put_repr(&line, res, 1) ||
                                    put(&line, ")\t[", 3)
                                ? -1
                                : put_value(&line, path, 1);
                    if (r == 1 && put(&line, ",", 1)) r = -1;
                    if (r == 1) r = put_value(&line, acc, 1);
                    if (r == 1 && put(&line, ",", 1)) r = -1;
                    if (r == 1) r = put_value(&line, res, 1);
                    if (r == 1 && put(&line, "]\n", 2)) r = -1;
                    if (r == 1) {
                        int got = lineset_add(ls, line.p, line.n, _Py_HashBytes(line.p, (Py_ssize_t)line.n));
                        if (got < 0) r = -1;
                        else added += got;
                    }
                    Py_DECREF(acc);
                    if (r < 0) goto fail;
                    took = r == 1;
                }
            }
        }
        if (!took && PyList_Append(rest, rec) < 0) goto fail;
    }
    free(line.p);
    Py_XDECREF(last_acc);
    return Py_BuildValue("(nN)", added, rest);
fail:
    free(line.p);
    Py_XDECREF(last_acc);
    Py_DECREF(rest);
    return NULL;
}

static PyMethodDef lineset_methods[] = {
    {"add_files", (PyCFunction)lineset_add_files, METH_VARARGS, "Plain opens' file items added (see above)."},
    {"spill", (PyCFunction)lineset_spill, METH_VARARGS, "The lines sorted into a file, then forgotten."},
    {"lines", (PyCFunction)lineset_lines, METH_NOARGS, "The lines as bytes, in the order they came."},
    {"take", (PyCFunction)lineset_take, METH_NOARGS, "A new set of these lines, this one left empty."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods lineset_seq = {.sq_length = (lenfunc)lineset_len};

static PyTypeObject LineSetType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "evidence.bundle._fast.LineSet",
    .tp_basicsize = sizeof(LineSet),
    .tp_dealloc = (destructor)lineset_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The run id's file items of plain opens, as their lines (see above).",
    .tp_methods = lineset_methods,
    .tp_as_sequence = &lineset_seq,
    .tp_new = PyType_GenericNew,
};

/* repr(v) onto `b` for what behaviour items hold, as Python writes it: a printable ASCII string
 * without quote or backslash as itself in single quotes, an int in decimal, None, True, False, a
 * tuple of such; anything else through PyObject_Repr. 0, or -1 with an error set. */
static int put_repr(Buf *b, PyObject *v, int depth) {
    if (PyUnicode_CheckExact(v) && PyUnicode_IS_ASCII(v)) {
        Py_ssize_t n = PyUnicode_GET_LENGTH(v);
        const char *s = (const char *)PyUnicode_DATA(v);
        Py_ssize_t k = 0;
        while (k < n && s[k] >= 0x20 && s[k] < 0x7f && s[k] != '\'' && s[k] != '\\') k++;
        if (k == n) return put(b, "'", 1) || put(b, s, (size_t)n) || put(b, "'", 1) ? -1 : 0;
    } else if (v == Py_None) {
        return put(b, "None", 4);
    } else if (v == Py_True) {
        return put(b, "True", 4);
    } else if (v == Py_False) {
        return put(b, "False", 5);
    } else if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (!overflow) {
            if (x == -1 && PyErr_Occurred()) return -1;
            return put_i64(b, x);
        }
    } else if (PyTuple_CheckExact(v) && depth < 8) {
        Py_ssize_t n = PyTuple_GET_SIZE(v);
        if (put(b, "(", 1)) return -1;
        for (Py_ssize_t k = 0; k < n; k++) {
            if (k && put(b, ", ", 2)) return -1;
            if (put_repr(b, PyTuple_GET_ITEM(v, k), depth + 1)) return -1;
        }
        return put(b, n == 1 ? ",)" : ")", n == 1 ? 2 : 1);
    }
    PyObject *r = PyObject_Repr(v);
    if (!r) return -1;
    PyObject *u = PyUnicode_AsEncodedString(r, "utf-8", "surrogatepass");
    Py_DECREF(r);
    if (!u) return -1;
    int out = put_bytes(b, u);
    Py_DECREF(u);
    return out;
}

/* marked(records, head, other): the records as FullWriter takes them (bundle/premade.py _marked):
 * a spool line (bytes) that starts with `head` and whose digits after it end at a comma is its time
 * (an int); every other line is other(line) (which parses it); a record is itself. */
static PyObject *fast_marked(PyObject *self, PyObject *args) {
    PyObject *recs, *head, *other;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyList_Type, &recs, &PyBytes_Type, &head, &other)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(recs), hn = PyBytes_GET_SIZE(head);
    const char *hs = PyBytes_AS_STRING(head);
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PyList_GET_ITEM(recs, i), *v = NULL;
        if (PyBytes_Check(r)) {
            const char *s = PyBytes_AS_STRING(r);
            Py_ssize_t len = PyBytes_GET_SIZE(r), k = hn;
            unsigned long long t = 0;
            if (len > hn && !memcmp(s, hs, (size_t)hn)) {
                while (k < len && k - hn < 19 && s[k] >= '0' && s[k] <= '9') t = t * 10 + (unsigned)(s[k++] - '0');
                if (k > hn && k < len && s[k] == ',') v = PyLong_FromUnsignedLongLong(t);
            }
            if (!v) v = PyObject_CallOneArg(other, r);
        } else {
            v = Py_NewRef(r);
        }
        if (!v) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* ---- correlation (agent/recorder/correlate.py Correlator.open_record) ---- */

static PyObject *MAGIC, *S_PID, *S_PPID, *S_EXE, *S_FDS, *S_RAW_PATH, *S_DIRFD, *S_FLAGS, *S_MODE, *S_NLINK, *S_WRITE,
    *S_CREATE, *ZERO;

/* a dict's value for `key`, made by `make(key)` and kept when missing (new reference) */
static PyObject *cached(PyObject *cache, PyObject *key, PyObject *make) {
    PyObject *v = PyDict_GetItemWithError(cache, key);
    if (v) return Py_NewRef(v);
    if (PyErr_Occurred()) return NULL;
    v = PyObject_CallOneArg(make, key);
    if (v && PyDict_SetItem(cache, key, v) < 0) Py_CLEAR(v);
    return v;
}

/* open_plain(p, t, raw, dfd, oflags, mode, ret, rino, nlink, paths, dirs, dir_names, limit,
 *            open_flags, flag_cache, result_of, result_cache)
 * The record of an open whose name `raw` (its bytes up to and with the NUL) is absolute and named
 * by no flag of its own (the caller checked: no F_KNAME, F_FNAME_FAULT, F_STATE, F_IN_ROOT,
 * F_OTHER_NS, and the run's own cgroup), as Correlator.open_record makes it: its names from the
 * cache `paths` (raw -> (raw_path, path)) or from its directory's (Correlator._in_dir: `dirs`,
 * `dir_names` for one not in it, emptied past `limit`), the descriptor it returns entered in
 * p.fds. None, with nothing changed but `dirs`, for anything else: a name _in_dir does not take,
 * an open for writing that returned a descriptor (Correlator._leaving looks at it). */
typedef struct {
    PyObject *paths, *dirs, *dir_names, *open_flags, *flag_cache, *result_of, *result_cache;
    Py_ssize_t limit;
    /* one call's memos (strong references, let go by caches_drop): the last two directories looked
     * up in `dirs` and their names (two processes' opens interleave), the last flags and their names
     * and access */
    PyObject *where[2], *known[2], *fl;
    int next; /* the memo's entry the next directory goes to */
    long long fl_oflags;
    Buf item; /* a file item's line (open_core's, for `files`), its room kept from one to the next */
    /* process_opens's last two processes (two processes' opens interleave): their tgids, the Proc
     * and its pid, ppid and exe (nothing that runs during one call changes them) */
    unsigned long long tgid[2];
    PyObject *proc[2], *who[2][3];
    int pnext;
} Caches;

static void caches_forget_dirs(Caches *c) {
    for (int k = 0; k < 2; k++) {
        Py_CLEAR(c->where[k]);
        Py_CLEAR(c->known[k]);
    }
}

static void caches_drop(Caches *c) {
    caches_forget_dirs(c);
    for (int k = 0; k < 2; k++) {
        Py_CLEAR(c->proc[k]);
        for (int f = 0; f < 3; f++) Py_CLEAR(c->who[k][f]);
    }
    Py_CLEAR(c->fl);
    free(c->item.p);
    c->item = (Buf){0};
}

/* A name as two runs of UTF-8 bytes, one after the other (a directory's resolved name and a leaf;
 * b NULL: one run), borrowed from strings or a record that outlive its use. */
typedef struct {
    const char *a, *b;
    Py_ssize_t an, bn;
} Text;

/* a string's UTF-8 as a Text: 1, or 0 for one that is not an exact str of UTF-8 (a lone surrogate) */
static int text_of(PyObject *s, Text *t) {
    if (!PyUnicode_CheckExact(s)) return 0;
    t->a = PyUnicode_AsUTF8AndSize(s, &t->an);
    t->b = NULL, t->bn = 0;
    if (!t->a) PyErr_Clear();
    return t->a != NULL;
}

static int text_starts(const Text *t, const char *prefix) {
    size_t n = strlen(prefix), first = (size_t)t->an < n ? (size_t)t->an : n;
    if (memcmp(t->a, prefix, first)) return 0;
    return first == n || ((size_t)t->bn >= n - first && !memcmp(t->b, prefix + first, n - first));
}

/* The record's spool line (orjson.dumps of the dict open_core makes, and a newline: the same keys in
 * the same order, each value as put_value writes it, which is orjson's way) into `b`: 1; 0 when a
 * value is one put_value does not write (the dict is made instead); -1 with an error set. */
static int open_line(Buf *b, long long t, PyObject *pid, PyObject *ppid, PyObject *exe, const Text *path,
                     const Text *raw_path, long long dfd, PyObject *names, PyObject *access, int creates,
                     long long mode, PyObject *res, long long nlink) {
    b->n = 0;
    int r;
    if (put(b, "{\"k\":\"open\",\"t\":", 16) || put_i64(b, t) || put(b, ",\"pid\":", 7)) return -1;
    if ((r = put_value(b, pid, 0)) <= 0) return r;
    if (put(b, ",\"ppid\":", 8)) return -1;
    if ((r = put_value(b, ppid, 0)) <= 0) return r;
    if (put(b, ",\"exe\":", 7)) return -1;
    if ((r = put_value(b, exe, 0)) <= 0) return r;
    if (put(b, ",\"path\":", 8) || put_json_str2(b, path->a, (size_t)path->an, path->b, (size_t)path->bn) ||
        put(b, ",\"raw_path\":", 12) ||
        put_json_str2(b, raw_path->a, (size_t)raw_path->an, raw_path->b, (size_t)raw_path->bn) ||
        put(b, ",\"dirfd\":", 9) || (dfd == -100 ? put(b, "null", 4) : put_i64(b, dfd)) ||
        put(b, ",\"flags\":", 9))
        return -1;
    if ((r = put_value(b, names, 0)) <= 0) return r;
    if (put(b, ",\"access\":", 10)) return -1;
    if ((r = put_value(b, access, 0)) <= 0) return r;
    if (put(b, ",\"mode\":", 8) || (creates ? put_i64(b, mode) : put(b, "null", 4)) || put(b, ",\"result\":", 10))
        return -1;
    if ((r = put_value(b, res, 0)) <= 0) return r;
    if (nlink > 1 && (put(b, ",\"nlink\":", 9) || put_i64(b, nlink))) return -1;
    return put(b, "}\n", 2) ? -1 : 1;
}

/* An open's file item for the run id (Behaviour.add's, as add_files makes it of the record: repr, a
 * tab, canonical JSON, a newline) of its path's bytes, its access and its result, into `item`: 1; 0
 * when add_files would not take it (a path the Normalizer may change, or whose repr is not its
 * bytes: not printable ASCII, a quote or a backslash in it); -1 with an error set. */
static int file_item(Buf *item, const Text *path, PyObject *access, PyObject *res, PyObject *roots) {
    item->n = 0;
    if (put(item, "('", 2) || put(item, path->a, (size_t)path->an) || put(item, path->b, (size_t)path->bn))
        return -1;
    const char *ps = item->p + 2;
    Py_ssize_t pn = path->an + path->bn;
    for (Py_ssize_t k = 0; k < pn; k++)
        if (ps[k] < 0x20 || ps[k] > 0x7e || ps[k] == '\'' || ps[k] == '\\') return 0;
    if (needs_normal(ps, pn, roots)) return 0;
    PyObject *acc = PyList_CheckExact(access) ? PyList_AsTuple(access) : Py_NewRef(access);
    if (!acc) return -1;
    int r = put(item, "', ", 3) || put_repr(item, acc, 1) || put(item, ", ", 2) || put_repr(item, res, 1) ||
                    put(item, ")\t[", 3) ||
                    put_json_str2(item, path->a, (size_t)path->an, path->b, (size_t)path->bn) || put(item, ",", 1)
                ? -1
                : put_value(item, acc, 1);
    if (r == 1 && put(item, ",", 1)) r = -1;
    if (r == 1) r = put_value(item, res, 1);
    if (r == 1 && put(item, "]\n", 2)) r = -1;
    Py_DECREF(acc);
    return r;
}

/* open_plain's work: the record (new reference), Py_None (new reference: not taken), or NULL. Its
 * time: `t`, or when NULL `t_ns`. With `line`, the record's spool line (bytes, open_line's) in place
 * of its dict, where it can be made: then a name made here of its directory's and its leaf's bytes
 * (a leaf of ASCII, the usual case) is never made a string, but where the descriptor table needs it;
 * and its file item is added to `files` (the run id's LineSet, `roots` its roots as add_files takes
 * them; counted in *added): a line is never read for it again (Behaviour.add_many passes lines by).
 * A record whose item is not made here is a dict, for Behaviour.add_many. */
static PyObject *open_core(Caches *c, PyObject *p, PyObject *const *who, PyObject *t, long long t_ns, PyObject *raw,
                           long long dfd, long long oflags, long long mode, long long ret, PyObject *rino,
                           long long nlink, Buf *line, LineSet *files, PyObject *roots, Py_ssize_t *added) {
    PyObject *paths = c->paths, *dirs = c->dirs, *dir_names = c->dir_names, *open_flags = c->open_flags,
             *flag_cache = c->flag_cache, *result_of = c->result_of, *result_cache = c->result_cache;
    Py_ssize_t limit = c->limit;
    PyObject *raw_path = NULL, *path = NULL, *rec = NULL, *fl = NULL, *res = NULL, *tmp = NULL, *known = NULL;
    Text path_t = {0}, raw_t = {0}; /* (lines: the names' bytes, when they are not strings) */
    int texts = 0;
    PyObject *hit = PyDict_GetItemWithError(paths, raw);
    if (hit) {
        if (!PyTuple_CheckExact(hit) || PyTuple_GET_SIZE(hit) != 2) Py_RETURN_NONE;
        raw_path = Py_NewRef(PyTuple_GET_ITEM(hit, 0));
        path = Py_NewRef(PyTuple_GET_ITEM(hit, 1));
    } else {
        if (PyErr_Occurred()) return NULL;
        /* Correlator._in_dir */
        const char *s = PyBytes_AS_STRING(raw);
        Py_ssize_t n = PyBytes_GET_SIZE(raw), slash = n - 1;
        while (slash >= 0 && s[slash] != '/') slash--;
        if (slash < 0) Py_RETURN_NONE;
        const char *leaf = s + slash + 1;
        Py_ssize_t ln = n - slash - 1;
        const char *nul = memchr(leaf, 0, (size_t)ln);
        if (!nul || nul != leaf + ln - 1 || ln == 1 || (ln == 2 && leaf[0] == '.') ||
            (ln == 3 && leaf[0] == '.' && leaf[1] == '.'))
            Py_RETURN_NONE;
        int memo = -1;
        for (int k = 0; k < 2 && memo < 0; k++)
            if (c->where[k] && PyBytes_GET_SIZE(c->where[k]) == slash &&
                !memcmp(PyBytes_AS_STRING(c->where[k]), s, (size_t)slash))
                memo = k;
        if (memo >= 0) {
            known = Py_NewRef(c->known[memo]); /* a directory of the opens before (a flood's share few) */
        } else {
            PyObject *where = PyBytes_FromStringAndSize(s, slash);
            if (!where) return NULL;
            known = PyDict_GetItemWithError(dirs, where);
            if (known) {
                Py_INCREF(known);
            } else if (!PyErr_Occurred()) {
                if (PyDict_GET_SIZE(dirs) >= limit) { /* (the memo's too: each entry made again) */
                    PyDict_Clear(dirs);
                    caches_forget_dirs(c);
                }
                known = PyObject_CallOneArg(dir_names, where);
                if (known && PyDict_SetItem(dirs, where, known) < 0) Py_CLEAR(known);
            }
            if (known) {
                Py_XSETREF(c->where[c->next], Py_NewRef(where));
                Py_XSETREF(c->known[c->next], Py_NewRef(known));
                c->next ^= 1;
            }
            Py_DECREF(where);
            if (!known) return NULL;
        }
        if (!PyTuple_CheckExact(known) || PyTuple_GET_SIZE(known) != 2) {
            Py_DECREF(known);
            Py_RETURN_NONE;
        }
        PyObject *given = PyTuple_GET_ITEM(known, 0), *resolved = PyTuple_GET_ITEM(known, 1);
        if (line && ret < 0) { /* (no descriptor to enter: the names need not be strings) */
            int ascii = 1;
            for (Py_ssize_t k = 0; k < ln - 1 && ascii; k++) ascii = (unsigned char)leaf[k] < 0x80;
            if (ascii && text_of(resolved, &path_t) && text_of(given, &raw_t)) {
                path_t.b = raw_t.b = leaf;
                path_t.bn = raw_t.bn = ln - 1;
                if (raw_t.an == path_t.an && !memcmp(raw_t.a, path_t.a, (size_t)path_t.an)) raw_t = path_t;
                /* names.MAGIC: another file each time, named by the Python path */
                if (text_starts(&path_t, "/proc/") || text_starts(&path_t, "/dev/fd/")) {
                    Py_DECREF(known);
                    Py_RETURN_NONE;
                }
                texts = 1;
            }
        }
        if (!texts) {
            PyObject *name = PyUnicode_DecodeUTF8(leaf, ln - 1, "backslashreplace");
            if (!name) goto fail;
            int same = PyUnicode_CheckExact(given) && PyUnicode_CheckExact(resolved) &&
                       (given == resolved || PyUnicode_Compare(given, resolved) == 0);
            path = PyUnicode_Concat(resolved, name);
            /* (a directory named as it resolves, the usual case: one string for both names) */
            raw_path = path ? (same ? Py_NewRef(path) : PyUnicode_Concat(given, name)) : NULL;
            Py_DECREF(name);
            if (!raw_path) goto fail;
            /* names.MAGIC: another file each time, named by the Python path */
            if (PyUnicode_Tailmatch(path, PyTuple_GET_ITEM(MAGIC, 0), 0, PY_SSIZE_T_MAX, -1) ||
                PyUnicode_Tailmatch(path, PyTuple_GET_ITEM(MAGIC, 1), 0, PY_SSIZE_T_MAX, -1))
                goto none;
        }
    }
    if (c->fl && c->fl_oflags == oflags) {
        fl = Py_NewRef(c->fl); /* (the open before's flags, the usual case) */
    } else {
        tmp = PyLong_FromLongLong(oflags);
        fl = tmp ? cached(flag_cache, tmp, open_flags) : NULL;
        Py_CLEAR(tmp);
        if (!fl) goto fail;
        Py_XSETREF(c->fl, Py_NewRef(fl));
        c->fl_oflags = oflags;
    }
    if (!PyTuple_CheckExact(fl) || PyTuple_GET_SIZE(fl) != 2) goto none;
    PyObject *names = PyTuple_GET_ITEM(fl, 0), *access = PyTuple_GET_ITEM(fl, 1);
    int writes = PySequence_Contains(access, S_WRITE), creates = PySequence_Contains(access, S_CREATE);
    if (writes < 0 || creates < 0) goto fail;
    if (writes && ret >= 0) goto none; /* _leaving's to look at */
    if (ret >= 0) {
        res = Py_NewRef(ZERO);
    } else {
        tmp = PyLong_FromLongLong(ret);
        res = tmp ? cached(result_cache, tmp, result_of) : NULL;
        Py_CLEAR(tmp);
        if (!res) goto fail;
    }
    /* (`who`: p's pid, ppid and exe, read before; else read here) */
    PyObject *pid = who ? Py_NewRef(who[0]) : PyObject_GetAttr(p, S_PID),
             *ppid = who ? Py_NewRef(who[1]) : pid ? PyObject_GetAttr(p, S_PPID) : NULL,
             *exe = who ? Py_NewRef(who[2]) : ppid ? PyObject_GetAttr(p, S_EXE) : NULL;
    if (!exe) {
        Py_XDECREF(pid);
        Py_XDECREF(ppid);
        goto fail;
    }
    if (line && !t) {
        int r = 1;
        if (!texts && !(text_of(path, &path_t) && text_of(raw_path, &raw_t))) r = 0;
        if (r) r = open_line(line, t_ns, pid, ppid, exe, &path_t, &raw_t, dfd, names, access, creates, mode, res, nlink);
        Buf *item = &c->item;
        if (r == 1) r = file_item(item, &path_t, access, res, roots);
        if (r == 1) {
            int got = lineset_add(files, item->p, item->n, _Py_HashBytes(item->p, (Py_ssize_t)item->n));
            if (got < 0) r = -1;
            else *added += got;
        }
        if (r == 1) rec = PyBytes_FromStringAndSize(line->p, (Py_ssize_t)line->n);
        if (r < 0 || (r == 1 && !rec)) {
            Py_DECREF(pid);
            Py_DECREF(ppid);
            Py_DECREF(exe);
            goto fail;
        }
    }
    if (rec) {
        Py_DECREF(pid);
        Py_DECREF(ppid);
        Py_DECREF(exe);
        goto fds;
    }
    if (texts) { /* (a value open_line does not write: the names made strings after all) */
        PyObject *leaf = PyUnicode_DecodeUTF8(path_t.b, path_t.bn, "strict");
        PyObject *dir = leaf ? PyTuple_GET_ITEM(known, 1) : NULL, *given = leaf ? PyTuple_GET_ITEM(known, 0) : NULL;
        path = leaf ? PyUnicode_Concat(dir, leaf) : NULL;
        raw_path = path ? (raw_t.a == path_t.a ? Py_NewRef(path) : PyUnicode_Concat(given, leaf)) : NULL;
        Py_XDECREF(leaf);
        if (!raw_path) {
            Py_DECREF(pid);
            Py_DECREF(ppid);
            Py_DECREF(exe);
            goto fail;
        }
    }
    if (!t) {
        t = tmp = PyLong_FromLongLong(t_ns);
        if (!t) {
            Py_DECREF(pid);
            Py_DECREF(ppid);
            Py_DECREF(exe);
            goto fail;
        }
    }
    rec = PyDict_New();
    int bad = !rec || PyDict_SetItem(rec, K, OPEN) || PyDict_SetItem(rec, T, t) || PyDict_SetItem(rec, S_PID, pid) ||
              PyDict_SetItem(rec, S_PPID, ppid) || PyDict_SetItem(rec, S_EXE, exe);
    Py_DECREF(pid);
    Py_DECREF(ppid);
    Py_DECREF(exe);
    Py_CLEAR(tmp);
    if (bad || PyDict_SetItem(rec, PATH, path) || PyDict_SetItem(rec, S_RAW_PATH, raw_path)) goto fail;
    tmp = dfd == -100 ? Py_NewRef(Py_None) : PyLong_FromLongLong(dfd);
    if (!tmp || PyDict_SetItem(rec, S_DIRFD, tmp)) goto fail;
    Py_CLEAR(tmp);
    if (PyDict_SetItem(rec, S_FLAGS, names) || PyDict_SetItem(rec, ACCESS, access)) goto fail;
    tmp = creates ? PyLong_FromLongLong(mode) : Py_NewRef(Py_None);
    if (!tmp || PyDict_SetItem(rec, S_MODE, tmp)) goto fail;
    Py_CLEAR(tmp);
    if (PyDict_SetItem(rec, RESULT, res)) goto fail;
    if (nlink > 1) {
        tmp = PyLong_FromLongLong(nlink);
        if (!tmp || PyDict_SetItem(rec, S_NLINK, tmp)) goto fail;
        Py_CLEAR(tmp);
    }
fds:
    if (ret >= 0) { /* the descriptor now names `path` (while it names inode `rino`) */
        PyObject *fds = PyObject_GetAttr(p, S_FDS);
        if (!fds) goto fail;
        PyObject *fd = PyLong_FromLongLong(ret), *entry = PyTuple_Pack(2, path, rino);
        int r = fd && entry ? PyObject_SetItem(fds, fd, entry) : -1;
        Py_XDECREF(fd);
        Py_XDECREF(entry);
        Py_DECREF(fds);
        if (r < 0) goto fail;
    }
    Py_XDECREF(path);
    Py_XDECREF(raw_path);
    Py_XDECREF(known);
    Py_DECREF(fl);
    Py_DECREF(res);
    return rec;
none:
    Py_XDECREF(path);
    Py_XDECREF(raw_path);
    Py_XDECREF(known);
    Py_XDECREF(fl);
    Py_XDECREF(res);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(path);
    Py_XDECREF(raw_path);
    Py_XDECREF(known);
    Py_XDECREF(fl);
    Py_XDECREF(res);
    Py_XDECREF(rec);
    Py_XDECREF(tmp);
    return NULL;
}

static PyObject *fast_open_plain(PyObject *self, PyObject *args) {
    PyObject *p, *t, *raw, *rino;
    long long dfd, oflags, mode, ret, nlink;
    Caches c = {0};
    if (!PyArg_ParseTuple(args, "OOO!LLLLOLO!O!OnOO!OO!", &p, &t, &PyBytes_Type, &raw, &dfd, &oflags, &mode,
                          &ret, &rino, &nlink, &PyDict_Type, &c.paths, &PyDict_Type, &c.dirs, &c.dir_names,
                          &c.limit, &c.open_flags, &PyDict_Type, &c.flag_cache, &c.result_of, &PyDict_Type,
                          &c.result_cache))
        return NULL;
    PyObject *rec = open_core(&c, p, NULL, t, 0, raw, dfd, oflags, mode, ret, rino, nlink, NULL, NULL, NULL, NULL);
    caches_drop(&c);
    return rec;
}

/* The open record's layout this file knows (agent/recorder/decode.py OPEN_REC): its fields are read
 * here in place; process_opens takes nothing when the struct `unpack` belongs to has another format
 * (the Python path then takes every record; tests/unit/test_fast.py holds the two formats equal). */
static const char OPEN_FORMAT[] = "<QQIIIHHqQQiIHHHHQQ";
#define OPEN_SIZE 88

/* 1: `unpack` is the bound unpack_from of a struct of OPEN_FORMAT, its path at OPEN_SIZE; 0: not */
static int known_layout(PyObject *unpack, Py_ssize_t path_off) {
    if (path_off != OPEN_SIZE) return 0;
    PyObject *st = PyObject_GetAttrString(unpack, "__self__");
    if (!st) {
        PyErr_Clear();
        return 0;
    }
    PyObject *fmt = PyObject_GetAttrString(st, "format");
    Py_DECREF(st);
    if (!fmt) {
        PyErr_Clear();
        return 0;
    }
    int same = PyUnicode_Check(fmt) && PyUnicode_CompareWithASCIIString(fmt, OPEN_FORMAT) == 0;
    Py_DECREF(fmt);
    return same;
}

static inline unsigned long long le_u(const char *p, int n) {
    unsigned long long v = 0;
    for (int k = n - 1; k >= 0; k--) v = (v << 8) | (unsigned char)p[k];
    return v;
}

/* the fields of an open record process_opens uses */
typedef struct {
    unsigned long long ts, cgid, tgid, rino;
    long long run, flags, ret, dfd, oflags, mode, nlink, plen;
} OpenFields;

/* read at OPEN_FORMAT's places (rs: at least OPEN_SIZE bytes) */
static void open_read(const char *rs, OpenFields *o) {
    o->ts = le_u(rs, 8), o->cgid = le_u(rs + 8, 8), o->run = (long long)le_u(rs + 16, 4);
    o->tgid = le_u(rs + 20, 4), o->flags = (long long)le_u(rs + 30, 2), o->ret = (long long)le_u(rs + 32, 8);
    o->dfd = (long long)(int32_t)(uint32_t)le_u(rs + 56, 4), o->oflags = (long long)le_u(rs + 60, 4);
    o->mode = (long long)le_u(rs + 64, 2), o->nlink = (long long)le_u(rs + 66, 2);
    o->plen = (long long)le_u(rs + 70, 2), o->rino = le_u(rs + 80, 8);
}

/* process_opens(batch, i, last_tail, run, unpack, kind_off, open_kind, path_off, stop_flags, procs,
 *               wall_offset, cgroups, files, roots, <open_plain's caches>)
 * pipeline.Pipeline._process's loop over the raw records batch[i], ... as far as they are plain
 * opens of run `run` (not a repeat of the record before: its bytes after the time differ from
 * `last_tail`, none of `stop_flags`, an absolute name, a process in `procs`, the run's own cgroup:
 * `cgroups` None or its entry's name None) that open_core takes. Their fields are unpack(raw)'s,
 * read in place (open_read) when unpack's struct has OPEN_FORMAT, else none is taken. `files`, the
 * run id's LineSet (or None), and its `roots`: a record as its spool line (bytes: open_line), not a
 * dict, wherever one can be made (for a run whose spool takes lines: pipeline.py _opens_as_lines),
 * its file item added to `files` (open_core). Returns (the index it stopped at, their records, the
 * last one's bytes after its time or None, its record or None, how many items were new to `files`). */
static PyObject *fast_process_opens(PyObject *self, PyObject *args) {
    PyObject *batch, *last_tail, *unpack, *open_kind, *procs, *wall_offset, *cgroups;
    Py_ssize_t i, kind_off, path_off;
    long long run, stop_flags;
    PyObject *files, *roots;
    Py_ssize_t added = 0;
    Caches c = {0};
    if (!PyArg_ParseTuple(args, "O!nOLOnO!nLO!OOOOO!O!OnOO!OO!", &PyList_Type, &batch, &i, &last_tail, &run, &unpack,
                          &kind_off, &PyBytes_Type, &open_kind, &path_off, &stop_flags, &PyDict_Type, &procs,
                          &wall_offset, &cgroups, &files, &roots, &PyDict_Type, &c.paths, &PyDict_Type, &c.dirs,
                          &c.dir_names, &c.limit, &c.open_flags, &PyDict_Type, &c.flag_cache, &c.result_of,
                          &PyDict_Type, &c.result_cache))
        return NULL;
    /* lines only with the run id's LineSet to add their items to */
    int as_lines = files != Py_None;
    if (as_lines && (!PyObject_TypeCheck(files, &LineSetType) || !PyTuple_CheckExact(roots))) {
        PyErr_SetString(PyExc_TypeError, "files is a LineSet (or None), roots a tuple of bytes");
        return NULL;
    }
    for (Py_ssize_t k = 0; as_lines && k < PyTuple_GET_SIZE(roots); k++)
        if (!PyBytes_CheckExact(PyTuple_GET_ITEM(roots, k))) {
            PyErr_SetString(PyExc_TypeError, "roots are bytes");
            return NULL;
        }
    Buf line = {0};
    if (!PyBytes_CheckExact(last_tail) || PyBytes_GET_SIZE(open_kind) != 2) {
        PyErr_SetString(PyExc_TypeError, "last_tail is bytes, open_kind two bytes");
        return NULL;
    }
    if (!known_layout(unpack, path_off)) return Py_BuildValue("(n[]OOn)", i, Py_None, Py_None, (Py_ssize_t)0);
    long long wall = PyLong_AsLongLong(wall_offset);
    if (wall == -1 && PyErr_Occurred()) return NULL;
    PyObject *out = PyList_New(0), *last_rec = NULL;
    if (!out) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(batch), last = -1;
    const char *tail = PyBytes_AS_STRING(last_tail);
    Py_ssize_t tail_n = PyBytes_GET_SIZE(last_tail);
    for (; i < n; i++) {
        PyObject *raw = PyList_GET_ITEM(batch, i);
        if (!PyBytes_CheckExact(raw)) break;
        const char *rs = PyBytes_AS_STRING(raw);
        Py_ssize_t rn = PyBytes_GET_SIZE(raw);
        if (rn < path_off || rn < kind_off + 2 || memcmp(rs + kind_off, PyBytes_AS_STRING(open_kind), 2)) break;
        if (rn - 8 == tail_n && !memcmp(rs + 8, tail, (size_t)tail_n)) break; /* a repeat: _process's */
        OpenFields o;
        open_read(rs, &o);
        if (o.run != run || (o.flags & stop_flags) || o.plen < 1 || path_off + o.plen > rn || rs[path_off] != '/')
            break;
        if (cgroups != Py_None) {
            PyObject *cg = PyLong_FromUnsignedLongLong(o.cgid);
            PyObject *named = cg ? PyDict_GetItemWithError(cgroups, cg) : NULL;
            Py_XDECREF(cg);
            if (!named || !PyTuple_Check(named) || PyTuple_GET_SIZE(named) < 1 ||
                PyTuple_GET_ITEM(named, 0) != Py_None) {
                if (PyErr_Occurred()) goto fail;
                break;
            }
        }
        int slot = c.proc[0] && c.tgid[0] == o.tgid ? 0 : c.proc[1] && c.tgid[1] == o.tgid ? 1 : -1;
        if (slot < 0) {
            PyObject *tg = PyLong_FromUnsignedLongLong(o.tgid);
            PyObject *found = tg ? PyDict_GetItemWithError(procs, tg) : NULL;
            Py_XDECREF(tg);
            if (!found) {
                if (PyErr_Occurred()) goto fail;
                break;
            }
            slot = c.pnext;
            c.pnext ^= 1;
            Py_XSETREF(c.proc[slot], Py_NewRef(found));
            c.tgid[slot] = o.tgid;
            PyObject *names[3] = {S_PID, S_PPID, S_EXE};
            for (int f = 0; f < 3; f++) {
                Py_XSETREF(c.who[slot][f], PyObject_GetAttr(found, names[f]));
                if (!c.who[slot][f]) {
                    Py_CLEAR(c.proc[slot]);
                    goto fail;
                }
            }
        }
        PyObject *p = Py_NewRef(c.proc[slot]);
        long long sum = 0;
        PyObject *t = NULL; /* (NULL: its time is `sum`) */
        int ok = 1;
        if (o.ts <= (unsigned long long)LLONG_MAX && !__builtin_add_overflow((long long)o.ts, wall, &sum)) {
            if (!as_lines) ok = (t = PyLong_FromLongLong(sum)) != NULL;
        } else {
            PyObject *ts = PyLong_FromUnsignedLongLong(o.ts);
            ok = (t = ts ? PyNumber_Add(ts, wall_offset) : NULL) != NULL;
            Py_XDECREF(ts);
        }
        PyObject *path = ok ? PyBytes_FromStringAndSize(rs + path_off, (Py_ssize_t)o.plen) : NULL;
        PyObject *rino = path ? (o.ret >= 0 ? PyLong_FromUnsignedLongLong(o.rino) : Py_NewRef(Py_None)) : NULL;
        PyObject *rec = rino ? open_core(&c, p, (PyObject *const *)c.who[slot], t, sum, path, o.dfd, o.oflags,
                                         o.mode, o.ret, rino, o.nlink, as_lines ? &line : NULL, (LineSet *)files,
                                         roots, &added)
                             : NULL;
        Py_XDECREF(t);
        Py_XDECREF(path);
        Py_XDECREF(rino);
        Py_DECREF(p);
        if (!rec) goto fail;
        if (rec == Py_None) {
            Py_DECREF(rec);
            break;
        }
        if (PyList_Append(out, rec) < 0) {
            Py_DECREF(rec);
            goto fail;
        }
        Py_XSETREF(last_rec, rec);
        last = i;
        tail = rs + 8;
        tail_n = rn - 8;
    }
    PyObject *lt = last < 0 ? Py_NewRef(Py_None)
                            : PyBytes_FromStringAndSize(tail, tail_n);
    if (!lt) goto fail;
    free(line.p);
    caches_drop(&c);
    return Py_BuildValue("(nNNNn)", i, out, lt, last_rec ? last_rec : Py_NewRef(Py_None), added);
fail:
    free(line.p);
    caches_drop(&c);
    Py_DECREF(out);
    Py_XDECREF(last_rec);
    return NULL;
}

/* ---- the ring buffer (probes/ringbuf.py RingBuffer.read) ---- */

/* ring_read(data, prod_pos, cons, max_records): RingBuffer.read's loop: every committed record
 * from consumer position `cons` up to the producer's (the first 8 bytes of `prod_pos`, read again
 * when reached), at most max_records, oldest first; a record that wraps past the end of `data` (the
 * data area once, its size a power of two) put together. Returns (the records, the new consumer
 * position, how many wrapped); the caller stores the position (one aligned 8-byte store). */
static PyObject *fast_ring_read(PyObject *self, PyObject *args) {
    Py_buffer data, prod;
    unsigned long long cons;
    Py_ssize_t max_records;
    if (!PyArg_ParseTuple(args, "y*y*Kn", &data, &prod, &cons, &max_records)) return NULL;
    PyObject *out = NULL;
    Py_ssize_t stitched = 0;
    uint64_t size = (uint64_t)data.len, mask = size - 1;
    if (prod.len < 8 || size < 8 || (size & mask)) {
        PyErr_SetString(PyExc_ValueError, "a ring's data area is a power of two, its position 8 bytes");
        goto done;
    }
    const unsigned char *d = data.buf;
    const uint64_t *prod_pos = prod.buf;
    out = PyList_New(0);
    if (!out) goto done;
    uint64_t pos = __atomic_load_n(prod_pos, __ATOMIC_ACQUIRE);
    while (cons < pos && PyList_GET_SIZE(out) < max_records) {
        uint64_t off = cons & mask;
        uint32_t hdr = __atomic_load_n((const uint32_t *)(d + off), __ATOMIC_ACQUIRE);
        if (hdr & (1u << 31)) break; /* reserved, not yet committed: read it next time */
        uint64_t len = hdr & ~((1u << 31) | (1u << 30));
        if (!(hdr & (1u << 30))) {
            uint64_t start = (off + 8) & mask, end = start + len;
            PyObject *rec;
            if (end <= size) {
                rec = PyBytes_FromStringAndSize((const char *)d + start, (Py_ssize_t)len);
            } else {
                /* (as the Python loop slices: a length past the area, which the kernel never
                 * writes, takes what there is) */
                uint64_t first = size - start, second = end - size < size ? end - size : size;
                rec = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(first + second));
                if (rec) {
                    memcpy(PyBytes_AS_STRING(rec), d + start, first);
                    memcpy(PyBytes_AS_STRING(rec) + first, d, second);
                }
                stitched++;
            }
            if (!rec || PyList_Append(out, rec) < 0) {
                Py_XDECREF(rec);
                Py_CLEAR(out);
                goto done;
            }
            Py_DECREF(rec);
        }
        cons += (len + 8 + 7) & ~7ULL;
        if (cons >= pos) pos = __atomic_load_n(prod_pos, __ATOMIC_ACQUIRE);
    }
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&prod);
    if (!out) return NULL;
    return Py_BuildValue("(NKn)", out, cons, stitched);
}

/* ---- the run id's sorted runs merged (bundle/run_id.py _SpillSet.canonical_items) ---- */

/* One source of sorted lines: a run on disk (read from offset 0 of its descriptor, with pread, in
 * pieces of 256 KiB or a line's length) or the lines held in memory (a tuple of bytes). */
typedef struct {
    int fd; /* -1: the tuple's lines */
    off_t off;
    char *buf;
    size_t start, end, cap;
    int eof;
    int form; /* 0: not read yet; 1: lines as they are; 2: a zstandard frame of them (lineset_spill's) */
    ZSTD_DCtx *z;
    char *in; /* the frame's bytes read and not yet decompressed: in[in_at..in_n) */
    size_t in_at, in_n;
    int pending; /* the last decompression filled its output: it may hold more before reading again */
    int whole;   /* the frame's end was decompressed (a run cut short is an error, not its lines) */
    PyObject *lines; /* (a borrowed tuple, held by the caller) */
    Py_ssize_t next;
    const char *line; /* the current line (its newline included), NULL at its end */
    size_t len;
} MergeSrc;

/* The source's next line; 0, or -1 with errno set (a read failed). Without the GIL. */
static int merge_next(MergeSrc *src) {
    if (src->fd < 0) {
        if (src->next < PyTuple_GET_SIZE(src->lines)) {
            PyObject *o = PyTuple_GET_ITEM(src->lines, src->next++);
            src->line = PyBytes_AS_STRING(o);
            src->len = (size_t)PyBytes_GET_SIZE(o);
        } else {
            src->line = NULL;
        }
        return 0;
    }
    for (;;) {
        char *nl = src->end > src->start ? memchr(src->buf + src->start, '\n', src->end - src->start) : NULL;
        if (nl) {
            src->line = src->buf + src->start;
            src->len = (size_t)(nl + 1 - src->line);
            src->start += src->len;
            return 0;
        }
        if (src->eof) { /* (a last line without its newline, as a file's iterator yields it) */
            src->line = src->end > src->start ? src->buf + src->start : NULL;
            src->len = src->end - src->start;
            src->start = src->end;
            return 0;
        }
        if (src->start) {
            memmove(src->buf, src->buf + src->start, src->end - src->start);
            src->end -= src->start;
            src->start = 0;
        }
        if (src->end == src->cap) {
            size_t cap = src->cap ? src->cap * 2 : 1 << 18;
            char *p = realloc(src->buf, cap);
            if (!p) {
                errno = ENOMEM;
                return -1;
            }
            src->buf = p;
            src->cap = cap;
        }
        if (!src->form) { /* a zstandard frame's magic number first, or lines */
            unsigned char magic[4];
            ssize_t got = pread(src->fd, magic, 4, 0);
            if (got < 0) {
                if (errno == EINTR) continue;
                return -1;
            }
            src->form = got == 4 && magic[0] == 0x28 && magic[1] == 0xb5 && magic[2] == 0x2f && magic[3] == 0xfd ? 2 : 1;
            if (src->form == 2 && (!(src->z = ZSTD_createDCtx()) || !(src->in = malloc(ZSTD_DStreamInSize())))) {
                errno = ENOMEM;
                return -1;
            }
        }
        if (src->form == 2) {
            if (src->in_at == src->in_n && !src->pending) {
                ssize_t got = pread(src->fd, src->in, ZSTD_DStreamInSize(), src->off);
                if (got < 0) {
                    if (errno == EINTR) continue;
                    return -1;
                }
                src->off += got;
                src->in_at = 0, src->in_n = (size_t)got;
                if (got == 0) {
                    if (!src->whole) {
                        errno = EIO;
                        return -1;
                    }
                    src->eof = 1;
                    continue;
                }
            }
            ZSTD_inBuffer zin = {src->in, src->in_n, src->in_at};
            ZSTD_outBuffer zout = {src->buf, src->cap, src->end};
            size_t r = ZSTD_decompressStream(src->z, &zout, &zin);
            if (ZSTD_isError(r)) {
                errno = EIO;
                return -1;
            }
            src->in_at = zin.pos;
            src->end = zout.pos;
            src->pending = r != 0 && zout.pos == zout.size; /* (a frame ended holds nothing more) */
            src->whole = r == 0;
            continue;
        }
        ssize_t got = pread(src->fd, src->buf + src->end, src->cap - src->end, src->off);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (got == 0) src->eof = 1;
        src->end += (size_t)got;
        src->off += got;
    }
}

/* bytes' order, equal lines in the order of their sources (as heapq.merge takes them) */
static inline int merge_less(const MergeSrc *a, const MergeSrc *b) {
    size_t n = a->len < b->len ? a->len : b->len;
    int c = memcmp(a->line, b->line, n);
    return c < 0 || (c == 0 && (a->len < b->len || (a->len == b->len && a < b)));
}

static void merge_down(MergeSrc **heap, size_t n, size_t i) {
    for (;;) {
        size_t l = 2 * i + 1, m = i;
        if (l < n && merge_less(heap[l], heap[m])) m = l;
        if (l + 1 < n && merge_less(heap[l + 1], heap[m])) m = l + 1;
        if (m == i) return;
        MergeSrc *t = heap[i];
        heap[i] = heap[m];
        heap[m] = t;
        i = m;
    }
}

/* merge_items(fds, lines, update): _SpillSet.canonical_items joined by commas, handed to
 * update() (a hash's) about a MiB at a time: the sorted runs on disk (their descriptors, read
 * from offset 0) and the sorted `lines` (a tuple of bytes), merged in bytes' order, a line equal to
 * the one before it taken once, each line's part after its first tab, its last byte (the
 * newline) left out. Reads and merges without the GIL. Returns None. */
static PyObject *fast_merge_items(PyObject *self, PyObject *args) {
    PyObject *fds, *lines, *update;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyList_Type, &fds, &PyTuple_Type, &lines, &update)) return NULL;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(lines); k++)
        if (!PyBytes_CheckExact(PyTuple_GET_ITEM(lines, k))) {
            PyErr_SetString(PyExc_TypeError, "lines are bytes");
            return NULL;
        }
    size_t nsrc = (size_t)PyList_GET_SIZE(fds) + 1;
    MergeSrc *srcs = calloc(nsrc, sizeof(MergeSrc));
    MergeSrc **heap = calloc(nsrc, sizeof(MergeSrc *));
    Buf out = {0}, last = {0};
    PyObject *result = NULL;
    int err = 0, notab = 0, have_last = 0, first = 1;
    if (!srcs || !heap) {
        PyErr_NoMemory();
        goto done;
    }
    srcs[0].fd = -1;
    srcs[0].lines = lines;
    for (size_t k = 1; k < nsrc; k++) {
        long fd = PyLong_AsLong(PyList_GET_ITEM(fds, (Py_ssize_t)k - 1));
        if (fd == -1 && PyErr_Occurred()) goto done;
        srcs[k].fd = (int)fd;
    }
    if (buf_grow(&out, (1 << 20) + 4096)) goto done;
    size_t n = 0;
    Py_BEGIN_ALLOW_THREADS
    for (size_t k = 0; k < nsrc && !err; k++) {
        if (merge_next(&srcs[k]) < 0) err = errno;
        else if (srcs[k].line) heap[n++] = &srcs[k];
    }
    for (size_t k = n / 2; k-- > 0;) merge_down(heap, n, k);
    while (n && !err && !notab) {
        MergeSrc *top = heap[0];
        if (!have_last || last.n != top->len || memcmp(last.p, top->line, top->len)) {
            const char *tab = memchr(top->line, '\t', top->len);
            if (!tab) {
                notab = 1;
                break;
            }
            size_t from = (size_t)(tab + 1 - top->line), to = top->len - 1;
            size_t part = to > from ? to - from : 0;
            last.n = 0;
            if ((last.cap < top->len && buf_grow_nogil(&last, top->len)) ||
                (out.cap - out.n < part + 1 && buf_grow_nogil(&out, part + 1))) {
                err = ENOMEM;
                break;
            }
            memcpy(last.p, top->line, top->len);
            last.n = top->len;
            have_last = 1;
            if (!first) out.p[out.n++] = ',';
            first = 0;
            memcpy(out.p + out.n, top->line + from, part);
            out.n += part;
            if (out.n >= 1 << 20) {
                Py_BLOCK_THREADS
                PyObject *r = PyObject_CallFunction(update, "y#", out.p, (Py_ssize_t)out.n);
                Py_XDECREF(r);
                Py_UNBLOCK_THREADS
                if (!r) {
                    err = -1; /* (the error set) */
                    break;
                }
                out.n = 0;
            }
        }
        if (merge_next(top) < 0) {
            err = errno;
            break;
        }
        if (top->line) merge_down(heap, n, 0);
        else {
            heap[0] = heap[--n];
            merge_down(heap, n, 0);
        }
    }
    Py_END_ALLOW_THREADS
    if (err == -1) goto done;
    if (err) {
        errno = err;
        PyErr_SetFromErrno(err == ENOMEM ? PyExc_MemoryError : PyExc_OSError);
        goto done;
    }
    if (notab) {
        PyErr_SetString(PyExc_ValueError, "a sorted run's line without a tab");
        goto done;
    }
    if (out.n) {
        PyObject *r = PyObject_CallFunction(update, "y#", out.p, (Py_ssize_t)out.n);
        if (!r) goto done;
        Py_DECREF(r);
    }
    result = Py_NewRef(Py_None);
done:
    if (srcs)
        for (size_t k = 0; k < nsrc; k++) {
            free(srcs[k].buf);
            free(srcs[k].in);
            ZSTD_freeDCtx(srcs[k].z);
        }
    free(srcs);
    free(heap);
    free(out.p);
    free(last.p);
    return result;
}

/* ---- the run id put in (bundle/writer.py _take_premade) ---- */

/* translate(data, table): data.translate(table) (a 256-byte table), without the GIL. A table that
 * changes only bytes below 0x20 and 0xff (the placeholder's: bundle/premade.py), which canonical
 * JSON lines hold nowhere else, is applied a word at a time: a word holding none of them is copied
 * as it is; any other table, byte by byte. */
static PyObject *fast_translate(PyObject *self, PyObject *args) {
    Py_buffer data, table;
    if (!PyArg_ParseTuple(args, "y*y*", &data, &table)) return NULL;
    PyObject *out = NULL;
    if (table.len != 256) {
        PyErr_SetString(PyExc_ValueError, "a translation table is 256 bytes");
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, data.len);
    if (!out) goto done;
    const unsigned char *t = table.buf, *s = data.buf;
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(out);
    size_t n = (size_t)data.len, i = 0;
    int low = 1;
    for (int c = 0x20; c < 0xff; c++)
        if (t[c] != c) low = 0;
    Py_BEGIN_ALLOW_THREADS
    if (low) {
        const uint64_t ones = 0x0101010101010101ULL, highs = 0x8080808080808080ULL;
        for (; i + 8 <= n; i += 8) {
            uint64_t x, nx;
            memcpy(&x, s + i, 8);
            nx = ~x;
            /* a byte below 0x20, or a 0xff (a zero byte of ~x): then byte by byte */
            if (((x - 0x20 * ones) & nx & highs) | ((nx - ones) & x & highs)) {
                for (int k = 0; k < 8; k++) o[i + k] = t[s[i + k]];
            } else {
                memcpy(o + i, &x, 8);
            }
        }
    }
    for (; i < n; i++) o[i] = t[s[i]];
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&table);
    return out;
}

/* spilled(data, count): _Spill.read's records of a batch read back: `count` lengths (native
 * unsigned 32-bit, as array("I") writes them), then the records' bytes, each sliced as Python
 * slices (past the end: what there is). */
static PyObject *fast_spilled(PyObject *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "y*n", &data, &count)) return NULL;
    PyObject *out = NULL;
    if (count < 0 || count > data.len / 4) {
        PyErr_SetString(PyExc_ValueError, "fewer lengths than records");
        goto done;
    }
    out = PyList_New(count);
    if (!out) goto done;
    const char *d = data.buf;
    size_t size = (size_t)data.len, at = 4 * (size_t)count;
    for (Py_ssize_t k = 0; k < count; k++) {
        uint32_t n;
        memcpy(&n, d + 4 * k, 4);
        size_t start = at < size ? at : size, end = at + n < size ? at + n : size;
        PyObject *rec = PyBytes_FromStringAndSize(d + start, (Py_ssize_t)(end - start));
        if (!rec) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, k, rec);
        at += n;
    }
done:
    PyBuffer_Release(&data);
    return out;
}

#include "zfile.h"

static PyMethodDef methods[] = {
    {"ring_read", fast_ring_read, METH_VARARGS, "RingBuffer.read's loop (see above)."},
    {"spilled", fast_spilled, METH_VARARGS, "A spilled batch's records read back (see above)."},
    {"merge_items", fast_merge_items, METH_VARARGS, "The run id's sorted runs merged into a hash (see above)."},
    {"hash_cores", fast_hash_cores, METH_VARARGS, "The content hashes opens or repeats deferred (see above)."},
    {"translate", fast_translate, METH_VARARGS, "data.translate(table), without the GIL (see above)."},
    {"process_opens", fast_process_opens, METH_VARARGS, "_process's loop over plain opens (see above)."},
    {"open_plain", fast_open_plain, METH_VARARGS, "An open's record, as Correlator.open_record makes it (see above)."},
    {"marked", fast_marked, METH_VARARGS, "Records with a repeated open's line as its time (see above)."},
    {"opens", fast_opens, METH_VARARGS, "The events of plain open records from items[i] (see the module's head)."},
    {"open_lines", fast_open_lines, METH_VARARGS, "opens() from spool lines, without the GIL (src/fast/lines.h)."},
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
    ACCESS = PyUnicode_InternFromString("access");
    RESULT = PyUnicode_InternFromString("result");
    if (!K || !T || !N || !TL || !PATH || !OPEN || !ACCESS || !RESULT) return NULL;
    S_PID = PyUnicode_InternFromString("pid");
    S_PPID = PyUnicode_InternFromString("ppid");
    S_EXE = PyUnicode_InternFromString("exe");
    S_FDS = PyUnicode_InternFromString("fds");
    S_RAW_PATH = PyUnicode_InternFromString("raw_path");
    S_DIRFD = PyUnicode_InternFromString("dirfd");
    S_FLAGS = PyUnicode_InternFromString("flags");
    S_MODE = PyUnicode_InternFromString("mode");
    S_NLINK = PyUnicode_InternFromString("nlink");
    S_WRITE = PyUnicode_InternFromString("write");
    S_CREATE = PyUnicode_InternFromString("create");
    ZERO = PyLong_FromLong(0);
    MAGIC = Py_BuildValue("(ss)", "/proc/", "/dev/fd/");
    if (!S_PID || !S_PPID || !S_EXE || !S_FDS || !S_RAW_PATH || !S_DIRFD || !S_FLAGS || !S_MODE || !S_NLINK ||
        !S_WRITE || !S_CREATE || !ZERO || !MAGIC)
        return NULL;
    if (PyType_Ready(&LineSetType) < 0 || PyType_Ready(&ZFileType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddObjectRef(m, "LineSet", (PyObject *)&LineSetType) < 0) Py_CLEAR(m);
    if (m && PyModule_AddObjectRef(m, "ZFile", (PyObject *)&ZFileType) < 0) Py_CLEAR(m);
    if (m && PyModule_AddStringConstant(m, "OPEN_FORMAT", OPEN_FORMAT) < 0) Py_CLEAR(m);
    return m;
}
