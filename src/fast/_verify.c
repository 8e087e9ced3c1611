/* The verifying reader's fast path over event lines, line by line in C (issue 25: the lint of every
 * bundle the agent's fleet publisher indexes, and every `lint`, `verify`, `show`, `diff`): what
 * bundle/fastpath.py `fast` does in Python, step for step and in the same order, the same checks
 * and the same functions (orjson's loads and dumps, the generated data checks, the time pattern),
 * without the Python around them. The Python loop stays the reference; tests/unit/test_lint_fast.py
 * holds both equal on good lines and on generated damage. Built by `make setup` (setup.py) as
 * evidence.bundle._verify; EVIDENCE_PURE_PYTHON=1 leaves it unused.
 *
 * lines(lines, seq, before_id, before_seq, before_subject, middle, types, specs, loads, dumps,
 *       option, is_time, hashes, counts, errors[, envelope]) -> an iterator
 *   lines: a list of bytes, or a piece (bytes of lines each ending with a newline, read in place:
 *   what follows the last newline is no line), the first of which is event `seq`; before_id, before_seq,
 *   before_subject: the constant bytes of a line (fastpath._envelope_parts), middle: those of a
 *   content hash's core (fastpath._CORE_MIDDLE); types: fastpath._TYPES (type -> (line tail, core
 *   tail, data check)); specs: fastpath._SPECS (type -> its data check's spec: that check made
 *   here, `valid` below; a type without one is checked by its Python check); loads, dumps, option:
 *   orjson's; is_time: the time pattern's match; hashes,
 *   counts: a Passed's (each event's content hash in hex appended, its type counted); errors: the
 *   exceptions that end the fast path without a word (any other is raised); envelope (optional:
 *   None or left out, no shortcut): the values the constant parts were made of, (datacontenttype,
 *   id prefix, labels or None, runid, source, specversion), for the shortcut below.
 *   Each next() checks the next line and returns its event if it passes, else ends (StopIteration)
 *   there for good. Per line, as `fast`:
 *     ev = loads(line); line_tail, core_tail, check = types[ev["type"]]
 *     data, time, subject = ev["data"], ev["time"], ev["subject"]
 *     type(subject) is str and check(data) is None and type(time) is str
 *       and (time == data.get("last_time") or is_time(time) is not None)
 *     line == b'{"data":' + dumps(data, option) + before_id + seq + before_seq + seq
 *             + before_subject + dumps(subject) + b',"time":"' + time + line_tail
 *   and its content hash is sha256(b'{"data":' + dumps(data) + middle + dumps(subject) + core_tail).
 *   With an envelope, `shortcut` first tries the line without loads of all of it (its data alone);
 *   it passes exactly the lines the steps above pass, with the same event, and leaves the rest to
 *   them (tests/unit/test_verify_shortcut.py).
 *
 * shape(piece) -> (lines, the longest line's length), of a piece as `lines` reads it.
 *
 * valid(spec, data) -> bool
 *   Whether `data` passes the check `spec` describes: schemas.compile_checker's check of the same
 *   model says None (valid) exactly then (tests/unit/test_lint_fast.py holds both equal).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/evp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "buf.h"

static const char HEX[] = "0123456789abcdef";
static EVP_MD *SHA256_MD;
static PyObject *s_type, *s_data, *s_time, *s_subject, *s_last_time, *kw_option, *ONE;

typedef struct {
    PyObject_HEAD
    PyObject *lines; /* a list of bytes */
    Py_ssize_t next; /* the index of the next line */
    Py_ssize_t seq;  /* its event's seq */
    int over;        /* a line did not pass, or the lines ended */
    PyObject *before_id, *before_seq, *before_subject, *middle; /* bytes */
    PyObject *types, *specs, *loads, *dumps, *option, *is_time, *hashes, *counts, *errors;
    /* the envelope's values, for the shortcut (NULL: no shortcut): (datacontenttype, id prefix,
     * labels or None, runid, source, specversion), checked against the constant parts */
    PyObject *envelope;
    PyObject *last_type, *last_known; /* the type of the last line the shortcut took, and its types entry */
    EVP_MD_CTX *ctx;
    Buf core;
} Lines;

static void lines_dealloc(Lines *self) {
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->lines);
    Py_CLEAR(self->before_id);
    Py_CLEAR(self->before_seq);
    Py_CLEAR(self->before_subject);
    Py_CLEAR(self->middle);
    Py_CLEAR(self->types);
    Py_CLEAR(self->specs);
    Py_CLEAR(self->loads);
    Py_CLEAR(self->dumps);
    Py_CLEAR(self->option);
    Py_CLEAR(self->is_time);
    Py_CLEAR(self->hashes);
    Py_CLEAR(self->counts);
    Py_CLEAR(self->errors);
    Py_CLEAR(self->envelope);
    Py_CLEAR(self->last_type);
    Py_CLEAR(self->last_known);
    if (self->ctx) EVP_MD_CTX_free(self->ctx);
    free(self->core.p);
    PyObject_GC_Del(self);
}

static int lines_traverse(Lines *self, visitproc visit, void *arg) {
    Py_VISIT(self->lines);
    Py_VISIT(self->types);
    Py_VISIT(self->specs);
    Py_VISIT(self->loads);
    Py_VISIT(self->dumps);
    Py_VISIT(self->option);
    Py_VISIT(self->is_time);
    Py_VISIT(self->hashes);
    Py_VISIT(self->counts);
    Py_VISIT(self->errors);
    Py_VISIT(self->envelope);
    Py_VISIT(self->last_type);
    Py_VISIT(self->last_known);
    return 0;
}

/* An exception raised on the way: one of `errors` (the Python path's `except errors: return`) ends
 * the fast path quietly (0), any other is raised (-1). */
static int quiet(Lines *self) {
    if (PyErr_ExceptionMatches(self->errors)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

/* Whether b[*at..] starts with s[0..n), moving *at past it. */
static inline int same(const char *b, Py_ssize_t *at, const char *s, Py_ssize_t n) {
    if (memcmp(b + *at, s, (size_t)n) != 0) return 0;
    *at += n;
    return 1;
}

#define BYTES(o) PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o)

/* --- the data checks (fastpath._spec: each event type's model as a spec, compiled once) ---------
 * A spec is a tuple of fields (name, required, is_time, test); a test is (tag,) or (tag, arg):
 * STR, INT, BOOL exact types, NONE None, LIT (arg: the literals: the same exact type and equal to
 * one), UNION (arg: the tests, one passes), LIST (arg: every item's test), DICT (arg: the test of
 * every value, every key an exact str). What schemas.compile_checker's checks test, the same way. */
enum { T_STR, T_INT, T_BOOL, T_NONE, T_LIT, T_UNION, T_LIST, T_DICT };

/* 1 v passes, 0 it does not, -1 an error (a spec that is not one) */
static int passes(PyObject *t, PyObject *v) {
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) < 1) goto bad;
    long tag = PyLong_AsLong(PyTuple_GET_ITEM(t, 0));
    if (tag == -1 && PyErr_Occurred()) return -1;
    PyObject *arg = PyTuple_GET_SIZE(t) > 1 ? PyTuple_GET_ITEM(t, 1) : NULL;
    switch (tag) {
    case T_STR:
        return PyUnicode_CheckExact(v);
    case T_INT:
        return PyLong_CheckExact(v);
    case T_BOOL:
        return PyBool_Check(v);
    case T_NONE:
        return v == Py_None;
    case T_LIT:
        if (!arg || !PyTuple_CheckExact(arg)) goto bad;
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(arg); k++) {
            PyObject *a = PyTuple_GET_ITEM(arg, k); /* str, int or bool: equal without Python code */
            if (Py_TYPE(v) != Py_TYPE(a)) continue;
            int eq = PyObject_RichCompareBool(v, a, Py_EQ);
            if (eq) return eq;
        }
        return 0;
    case T_UNION:
        if (!arg || !PyTuple_CheckExact(arg)) goto bad;
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(arg); k++) {
            int r = passes(PyTuple_GET_ITEM(arg, k), v);
            if (r) return r;
        }
        return 0;
    case T_LIST:
        if (!arg) goto bad;
        if (!PyList_CheckExact(v)) return 0;
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(v); k++) {
            int r = passes(arg, PyList_GET_ITEM(v, k));
            if (r <= 0) return r;
        }
        return 1;
    case T_DICT: {
        if (!arg) goto bad;
        if (!PyDict_CheckExact(v)) return 0;
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(v, &pos, &key, &value)) {
            if (!PyUnicode_CheckExact(key)) return 0;
        }
        pos = 0;
        while (PyDict_Next(v, &pos, &key, &value)) {
            int r = passes(arg, value);
            if (r <= 0) return r;
        }
        return 1;
    }
    }
bad:
    PyErr_SetString(PyExc_ValueError, "not a data check's spec");
    return -1;
}

/* schemas.TIME_PATTERN: ^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{9}Z$ (as a
 * Python pattern, $ at the very end: \Z), on a str */
static int time_form(PyObject *v) {
    static const char form[] = "dddd-dd-ddTdd:dd:dd.dddddddddZ";
    if (!PyUnicode_CheckExact(v) || PyUnicode_GET_LENGTH(v) != 30) return 0;
    int kind = PyUnicode_KIND(v);
    const void *data = PyUnicode_DATA(v);
    for (Py_ssize_t k = 0; k < 30; k++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, k);
        if (form[k] == 'd' ? (c < '0' || c > '9') : c != (Py_UCS4)form[k]) return 0;
    }
    return 1;
}

/* 1 `d` is valid data for `spec` (the Python check says None), 0 not, -1 an error */
static int valid_data(PyObject *spec, PyObject *d) {
    if (!PyTuple_CheckExact(spec)) {
        PyErr_SetString(PyExc_ValueError, "not a data check's spec");
        return -1;
    }
    if (!PyDict_CheckExact(d)) return 0;
    Py_ssize_t seen = 0;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(spec); k++) {
        PyObject *f = PyTuple_GET_ITEM(spec, k);
        if (!PyTuple_CheckExact(f) || PyTuple_GET_SIZE(f) != 4 || !PyUnicode_CheckExact(PyTuple_GET_ITEM(f, 0))) {
            PyErr_SetString(PyExc_ValueError, "not a data check's spec");
            return -1;
        }
        PyObject *v = PyDict_GetItemWithError(d, PyTuple_GET_ITEM(f, 0)); /* a str key: no Python code */
        if (!v) {
            if (PyErr_Occurred()) return -1;
            if (PyObject_IsTrue(PyTuple_GET_ITEM(f, 1))) return 0; /* required */
            continue;
        }
        seen++;
        int r = passes(PyTuple_GET_ITEM(f, 3), v);
        if (r <= 0) return r;
        if (PyTuple_GET_ITEM(f, 2) == Py_True && !time_form(v)) return 0;
    }
    return seen == PyDict_GET_SIZE(d); /* no field the model does not have */
}

static PyObject *valid(PyObject *module, PyObject *args) {
    PyObject *spec, *data;
    if (!PyArg_ParseTuple(args, "OO", &spec, &data)) return NULL;
    int r = valid_data(spec, data);
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

/* A line that passed: its content hash, sha256(b'{"data":' + d + middle + s + core_tail), appended
 * in hex to hashes, and its type counted. 0, or -1 with an error set. */
static int take(Lines *self, PyObject *etype, const char *d, Py_ssize_t dn, const char *s, Py_ssize_t sn,
                PyObject *core_tail) {
    Buf *c = &self->core;
    c->n = 0;
    unsigned char md[32];
    unsigned int mdn = 0;
    if (put(c, "{\"data\":", 8) || put(c, d, (size_t)dn) || put(c, BYTES(self->middle)) || put(c, s, (size_t)sn) ||
        put(c, BYTES(core_tail)))
        return -1;
    if (!EVP_DigestInit_ex(self->ctx, SHA256_MD, NULL) || !EVP_DigestUpdate(self->ctx, c->p, c->n) ||
        !EVP_DigestFinal_ex(self->ctx, md, &mdn)) {
        PyErr_SetString(PyExc_RuntimeError, "sha256 failed");
        return -1;
    }
    char hex[64];
    for (int k = 0; k < 32; k++) {
        hex[2 * k] = HEX[md[k] >> 4];
        hex[2 * k + 1] = HEX[md[k] & 15];
    }
    PyObject *h = PyUnicode_FromStringAndSize(hex, 64);
    if (!h) return -1;
    int appended = PyList_Append(self->hashes, h);
    Py_DECREF(h);
    if (appended) return -1;
    PyObject *was = PyDict_GetItemWithError(self->counts, etype); /* counts.get(etype, 0) + 1 */
    if (!was && PyErr_Occurred()) return -1;
    PyObject *now = was ? PyNumber_Add(was, ONE) : Py_NewRef(ONE);
    if (!now) return -1;
    int stored = PyDict_SetItem(self->counts, etype, now);
    Py_DECREF(now);
    return stored ? -1 : 0;
}

/* 1: the line passed (its hash and count taken); 0: it did not (nothing taken); -1: an error. */
static int check_line(Lines *self, PyObject *line, PyObject *ev) {
    /* ev["type"], then types[...]: not a dict (TypeError), no such key or type (KeyError), an
     * unhashable type (TypeError) all end it, as they do the Python path. */
    if (!PyDict_CheckExact(ev)) return 0;
    PyObject *etype = PyDict_GetItemWithError(ev, s_type);
    if (!etype) return PyErr_Occurred() ? quiet(self) : 0;
    PyObject *known = PyDict_GetItemWithError(self->types, etype);
    if (!known) return PyErr_Occurred() ? quiet(self) : 0;
    if (!PyTuple_CheckExact(known) || PyTuple_GET_SIZE(known) != 3 || !PyBytes_CheckExact(PyTuple_GET_ITEM(known, 0)) ||
        !PyBytes_CheckExact(PyTuple_GET_ITEM(known, 1))) {
        PyErr_SetString(PyExc_TypeError, "types: (line tail, core tail, check) each, the tails bytes");
        return -1;
    }
    PyObject *data = PyDict_GetItemWithError(ev, s_data);
    if (!data) return PyErr_Occurred() ? quiet(self) : 0;
    PyObject *time = PyDict_GetItemWithError(ev, s_time);
    if (!time) return PyErr_Occurred() ? quiet(self) : 0;
    PyObject *subject = PyDict_GetItemWithError(ev, s_subject);
    if (!subject) return PyErr_Occurred() ? quiet(self) : 0;
    if (!PyUnicode_CheckExact(subject)) return 0;
    /* held from here on: a check or the time pattern may be Python, which could change the dict */
    Py_INCREF(known);
    Py_INCREF(etype);
    Py_INCREF(data);
    Py_INCREF(time);
    Py_INCREF(subject);
    PyObject *line_tail = PyTuple_GET_ITEM(known, 0), *core_tail = PyTuple_GET_ITEM(known, 1);
    PyObject *d = NULL, *s = NULL;
    int r = 0;
    int valid;
    PyObject *spec = PyDict_GetItemWithError(self->specs, etype); /* the check in C, when it has one */
    if (spec) {
        valid = valid_data(spec, data);
        if (valid < 0) {
            r = -1;
            goto out;
        }
    } else if (PyErr_Occurred()) {
        r = -1;
        goto out;
    } else {
        PyObject *why = PyObject_CallOneArg(PyTuple_GET_ITEM(known, 2), data);
        if (!why) {
            r = quiet(self);
            goto out;
        }
        valid = why == Py_None;
        Py_DECREF(why);
    }
    /* data.get("last_time"): a valid data is a dict (else AttributeError: the end) */
    if (!valid || !PyUnicode_CheckExact(time) || !PyDict_CheckExact(data)) goto out;
    PyObject *last = PyDict_GetItemWithError(data, s_last_time);
    if (!last && PyErr_Occurred()) {
        r = quiet(self);
        goto out;
    }
    int eq = last ? PyObject_RichCompareBool(time, last, Py_EQ) : 0;
    if (eq < 0) {
        r = quiet(self);
        goto out;
    }
    if (!eq) {
        PyObject *m = PyObject_CallOneArg(self->is_time, time);
        if (!m) {
            r = quiet(self);
            goto out;
        }
        int matched = m != Py_None;
        Py_DECREF(m);
        if (!matched) goto out;
    }
    char digits[32];
    Py_ssize_t dn = decimal(digits, (long long)self->seq);
    PyObject *call[2] = {data, self->option};
    d = PyObject_Vectorcall(self->dumps, call, 1, kw_option);
    if (!d) {
        r = quiet(self);
        goto out;
    }
    s = PyObject_CallOneArg(self->dumps, subject);
    if (!s) {
        r = quiet(self);
        goto out;
    }
    Py_ssize_t tn;
    const char *t = PyUnicode_AsUTF8AndSize(time, &tn); /* time.encode() */
    if (!t) {
        r = quiet(self);
        goto out;
    }
    if (!PyBytes_CheckExact(d) || !PyBytes_CheckExact(s)) {
        PyErr_SetString(PyExc_TypeError, "dumps made no bytes");
        r = -1;
        goto out;
    }
    /* the line as the Python path puts it together, compared piece by piece */
    Py_ssize_t want = 8 + PyBytes_GET_SIZE(d) + PyBytes_GET_SIZE(self->before_id) + 2 * dn +
                      PyBytes_GET_SIZE(self->before_seq) + PyBytes_GET_SIZE(self->before_subject) +
                      PyBytes_GET_SIZE(s) + 9 + tn + PyBytes_GET_SIZE(line_tail);
    const char *b = PyBytes_AS_STRING(line);
    Py_ssize_t at = 0;
    if (want != PyBytes_GET_SIZE(line) || !same(b, &at, "{\"data\":", 8) || !same(b, &at, BYTES(d)) ||
        !same(b, &at, BYTES(self->before_id)) || !same(b, &at, digits, dn) ||
        !same(b, &at, BYTES(self->before_seq)) || !same(b, &at, digits, dn) ||
        !same(b, &at, BYTES(self->before_subject)) || !same(b, &at, BYTES(s)) ||
        !same(b, &at, ",\"time\":\"", 9) || !same(b, &at, t, tn) || !same(b, &at, BYTES(line_tail)))
        goto out;
    /* passed: its content hash, and its type counted */
    if (take(self, etype, BYTES(d), BYTES(s), core_tail)) {
        r = -1;
        goto out;
    }
    r = 1;
out:
    Py_XDECREF(d);
    Py_XDECREF(s);
    Py_DECREF(known);
    Py_DECREF(etype);
    Py_DECREF(data);
    Py_DECREF(time);
    Py_DECREF(subject);
    return r;
}

/* --- the shortcut: the line taken apart where its constant parts are -----------------------------
 * The line `fast` passes is b'{"data":' + D + before_id + seq + before_seq + seq + before_subject + S
 * + b',"time":"' + T + line_tail (D = dumps(data, option), S = dumps(subject), T = time.encode()).
 * So rather than loads of the whole line (every envelope attribute made a Python object: about
 * half of the line's parsing) the shortcut finds the type, T, S and D in the line's bytes, from
 * the end: the type by its line_tail; T back to the quote that opens it (T has none); S back to
 * its opening quote (it must be text JSON writes as is: UTF-8 with no '"', '\' or control byte,
 * which dumps writes unchanged, so it has no quote inside); before it the constant parts and the
 * seq's digits, compared; D the rest, after b'{"data":'. It loads D alone, decodes S and T, makes
 * check_line's checks with the same functions in the same order, compares dumps(data, option)
 * with D, and builds the event loads would make of the line (the same keys in the same order,
 * equal values; the envelope's constant values shared). A line it passes is then exactly what
 * check_line compares the line with, and loads(line) is that event: it passes a line only when
 * check_line passes it, with the same event, hash and count. Anything else (a part not where it
 * should be, an escape in S or T, D not dumps' own, a check that fails or raises one of `errors`)
 * is no verdict: check_line then decides, as before, from loads of the whole line. */

static const char DATA_OPEN[] = "{\"data\":";
static PyObject *s_datacontenttype, *s_id, *s_labels, *s_runid, *s_seq, *s_source, *s_specversion;

/* Whether b[0..n) is text JSON writes as is between quotes: no '"', '\' or control byte. */
static inline int plain_text(const char *b, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) {
        unsigned char c = (unsigned char)b[k];
        if (c < 0x20 || c == '"' || c == '\\') return 0;
    }
    return 1;
}

/* The str of UTF-8 bytes; NULL with no error set if they are not valid UTF-8 (which loads refuses
 * too), NULL with the error set for any other failure. */
static PyObject *utf8(const char *b, Py_ssize_t n) {
    PyObject *u = PyUnicode_DecodeUTF8(b, n, NULL);
    if (!u && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) PyErr_Clear();
    return u;
}

/* id_prefix + the seq's digits */
static PyObject *event_id(PyObject *prefix, const char *digits, Py_ssize_t dn) {
    if (!PyUnicode_IS_ASCII(prefix)) return PyUnicode_FromFormat("%U%.*s", prefix, (int)dn, digits);
    Py_ssize_t pn = PyUnicode_GET_LENGTH(prefix);
    PyObject *u = PyUnicode_New(pn + dn, 127);
    if (!u) return NULL;
    memcpy(PyUnicode_DATA(u), PyUnicode_DATA(prefix), (size_t)pn);
    memcpy((char *)PyUnicode_DATA(u) + pn, digits, (size_t)dn);
    return u;
}

/* The event loads makes of a line that is exactly its canonical dump: its keys in the line's
 * order (sorted), the envelope's values those of `envelope`. */
static PyObject *event(Lines *self, PyObject *data, PyObject *id, PyObject *seq, PyObject *subject, PyObject *time,
                       PyObject *etype) {
    PyObject *e = self->envelope; /* (datacontenttype, id prefix, labels or None, runid, source, specversion) */
    PyObject *labels = PyTuple_GET_ITEM(e, 2);
    PyObject *ev = _PyDict_NewPresized(11); /* as loads makes it: no growing on the way */
    if (!ev) return NULL;
    if (PyDict_SetItem(ev, s_data, data) || PyDict_SetItem(ev, s_datacontenttype, PyTuple_GET_ITEM(e, 0)) ||
        PyDict_SetItem(ev, s_id, id) || (labels != Py_None && PyDict_SetItem(ev, s_labels, labels)) ||
        PyDict_SetItem(ev, s_runid, PyTuple_GET_ITEM(e, 3)) || PyDict_SetItem(ev, s_seq, seq) ||
        PyDict_SetItem(ev, s_source, PyTuple_GET_ITEM(e, 4)) ||
        PyDict_SetItem(ev, s_specversion, PyTuple_GET_ITEM(e, 5)) || PyDict_SetItem(ev, s_subject, subject) ||
        PyDict_SetItem(ev, s_time, time) || PyDict_SetItem(ev, s_type, etype)) {
        Py_DECREF(ev);
        return NULL;
    }
    return ev;
}

/* 1: the line passed, *out its event (its hash and count taken); 0: no verdict (nothing taken, no
 * error set: check_line decides); -1: an error. */
static int shortcut(Lines *self, const char *b, Py_ssize_t n, PyObject **out) {
    *out = NULL;
    if (!self->envelope || n < 8 || memcmp(b, DATA_OPEN, 8) != 0) return 0;
    /* the type: the line ends with its tail, b'","type":' + dumps(etype) + b'}' (the last line's
     * type first: runs are mostly one type) */
    PyObject *etype = NULL, *known = NULL, *key, *value;
    Py_ssize_t tn = 0;
    if (self->last_type) {
        value = PyDict_GetItemWithError(self->types, self->last_type);
        if (!value && PyErr_Occurred()) return -1;
        if (value && value == self->last_known) {
            tn = PyBytes_GET_SIZE(PyTuple_GET_ITEM(value, 0));
            if (tn < n - 8 && memcmp(b + n - tn, PyBytes_AS_STRING(PyTuple_GET_ITEM(value, 0)), (size_t)tn) == 0) {
                etype = self->last_type;
                known = value;
            }
        }
    }
    for (Py_ssize_t pos = 0; !etype && PyDict_Next(self->types, &pos, &key, &value);) {
        if (!PyUnicode_CheckExact(key) || !PyTuple_CheckExact(value) || PyTuple_GET_SIZE(value) != 3 ||
            !PyBytes_CheckExact(PyTuple_GET_ITEM(value, 0)) || !PyBytes_CheckExact(PyTuple_GET_ITEM(value, 1)))
            continue;
        PyObject *tail = PyTuple_GET_ITEM(value, 0);
        tn = PyBytes_GET_SIZE(tail);
        if (tn < n - 8 && memcmp(b + n - tn, PyBytes_AS_STRING(tail), (size_t)tn) == 0) {
            etype = key;
            known = value;
            Py_XSETREF(self->last_type, Py_NewRef(key));
            Py_XSETREF(self->last_known, Py_NewRef(value));
        }
    }
    if (!etype || tn < 12 || memcmp(b + n - tn, "\",\"type\":\"", 10) != 0 || memcmp(b + n - 2, "\"}", 2) != 0)
        return 0;
    Py_ssize_t en; /* the type in the tail is the key's own UTF-8 */
    const char *et = PyUnicode_AsUTF8AndSize(etype, &en);
    if (!et) return -1;
    if (en != tn - 12 || memcmp(et, b + n - tn + 10, (size_t)en) != 0 || !plain_text(et, en)) return 0;
    /* T: back from the tail to the quote that opens it (T has none), after ,"time": */
    Py_ssize_t t_end = n - tn;
    const char *q = memrchr(b + 8, '"', (size_t)(t_end - 8));
    if (!q || q - b < 16 + 2 || memcmp(q - 8, ",\"time\":", 8) != 0) return 0;
    Py_ssize_t t_start = q - b + 1, s_end = q - b - 8;
    /* S: back to the quote that opens it (S has none inside), after the constant parts and the
     * seq's digits, which end D */
    if (b[s_end - 1] != '"') return 0;
    q = memrchr(b + 8, '"', (size_t)(s_end - 1 - 8));
    if (!q) return 0;
    Py_ssize_t s_start = q - b;
    char digits[32];
    Py_ssize_t dn = decimal(digits, (long long)self->seq);
    Py_ssize_t d_end = s_start - PyBytes_GET_SIZE(self->before_id) - 2 * dn - PyBytes_GET_SIZE(self->before_seq) -
                       PyBytes_GET_SIZE(self->before_subject);
    Py_ssize_t at = d_end;
    if (d_end <= 8 || !same(b, &at, BYTES(self->before_id)) || !same(b, &at, digits, dn) ||
        !same(b, &at, BYTES(self->before_seq)) || !same(b, &at, digits, dn) ||
        !same(b, &at, BYTES(self->before_subject)) || at != s_start)
        return 0;
    if (!plain_text(b + s_start + 1, s_end - s_start - 2) || !plain_text(b + t_start, t_end - t_start)) return 0;
    Py_INCREF(etype);
    Py_INCREF(known);
    PyObject *subject = NULL, *time = NULL, *dbytes = NULL, *data = NULL, *d = NULL, *id = NULL, *seq = NULL;
    int r = 0;
    subject = utf8(b + s_start + 1, s_end - s_start - 2);
    if (!subject) goto fail;
    time = utf8(b + t_start, t_end - t_start);
    if (!time) goto fail;
    dbytes = PyBytes_FromStringAndSize(b + 8, d_end - 8);
    if (!dbytes) goto fail;
    data = PyObject_CallOneArg(self->loads, dbytes);
    if (!data) goto quietly;
    /* check_line's checks, in its order, with its functions */
    int valid;
    PyObject *spec = PyDict_GetItemWithError(self->specs, etype);
    if (spec) {
        valid = valid_data(spec, data);
        if (valid < 0) goto fail;
    } else if (PyErr_Occurred()) {
        goto fail;
    } else {
        PyObject *why = PyObject_CallOneArg(PyTuple_GET_ITEM(known, 2), data);
        if (!why) goto quietly;
        valid = why == Py_None;
        Py_DECREF(why);
    }
    if (!valid || !PyDict_CheckExact(data)) goto out;
    PyObject *last = PyDict_GetItemWithError(data, s_last_time);
    if (!last && PyErr_Occurred()) goto quietly;
    int eq = last ? PyObject_RichCompareBool(time, last, Py_EQ) : 0;
    if (eq < 0) goto quietly;
    if (!eq) {
        PyObject *m = PyObject_CallOneArg(self->is_time, time);
        if (!m) goto quietly;
        int matched = m != Py_None;
        Py_DECREF(m);
        if (!matched) goto out;
    }
    PyObject *call[2] = {data, self->option};
    d = PyObject_Vectorcall(self->dumps, call, 1, kw_option);
    if (!d) goto quietly;
    if (!PyBytes_CheckExact(d) || PyBytes_GET_SIZE(d) != d_end - 8 || memcmp(PyBytes_AS_STRING(d), b + 8, (size_t)(d_end - 8)) != 0)
        goto out;
    id = event_id(PyTuple_GET_ITEM(self->envelope, 1), digits, dn);
    if (!id) goto fail;
    seq = PyLong_FromSsize_t(self->seq);
    if (!seq) goto fail;
    *out = event(self, data, id, seq, subject, time, etype);
    if (!*out) goto fail;
    if (take(self, etype, b + 8, d_end - 8, b + s_start, s_end - s_start, PyTuple_GET_ITEM(known, 1))) {
        Py_CLEAR(*out);
        goto fail;
    }
    r = 1;
    goto out;
quietly: /* one of `errors`: check_line decides (it meets the same, or not) */
    r = quiet(self);
    goto out;
fail:
    r = PyErr_Occurred() ? -1 : 0;
out:
    Py_XDECREF(subject);
    Py_XDECREF(time);
    Py_XDECREF(dbytes);
    Py_XDECREF(data);
    Py_XDECREF(d);
    Py_XDECREF(id);
    Py_XDECREF(seq);
    Py_DECREF(etype);
    Py_DECREF(known);
    return r;
}

static PyObject *lines_next(Lines *self) {
    if (self->over) return NULL;
    PyObject *line = NULL; /* the line as bytes: the list's item, or made from the piece when needed */
    const char *b;
    Py_ssize_t n, step;
    if (PyBytes_CheckExact(self->lines)) { /* a piece: the lines each end with a newline */
        Py_ssize_t size = PyBytes_GET_SIZE(self->lines);
        const char *at = PyBytes_AS_STRING(self->lines) + self->next;
        const char *nl = self->next < size ? memchr(at, '\n', (size_t)(size - self->next)) : NULL;
        if (!nl) { /* (what follows the last newline is no line, as for piece.split(b"\n")[:-1]) */
            self->over = 1;
            return NULL;
        }
        b = at;
        n = nl - at;
        step = n + 1;
    } else {
        if (self->next >= PyList_GET_SIZE(self->lines)) {
            self->over = 1;
            return NULL;
        }
        line = PyList_GET_ITEM(self->lines, self->next);
        if (!PyBytes_CheckExact(line)) {
            PyErr_SetString(PyExc_TypeError, "lines: bytes each");
            return NULL;
        }
        Py_INCREF(line);
        b = PyBytes_AS_STRING(line);
        n = PyBytes_GET_SIZE(line);
        step = 1;
    }
    PyObject *ev = NULL;
    int r = shortcut(self, b, n, &ev);
    if (r == 0 && !line && !(line = PyBytes_FromStringAndSize(b, n))) r = -1;
    if (r == 0) {
        ev = PyObject_CallOneArg(self->loads, line);
        r = ev ? check_line(self, line, ev) : quiet(self);
    }
    Py_XDECREF(line);
    if (r <= 0) {
        Py_XDECREF(ev);
        self->over = 1;
        return NULL; /* r == 0: the end, quietly; r < 0: the error set */
    }
    self->next += step;
    if (self->seq == PY_SSIZE_T_MAX) /* the next line's seq is past what this counts: the caller's */
        self->over = 1;              /* (fastpath takes such lines in Python) */
    else
        self->seq++;
    return ev;
}

static PyTypeObject LinesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "evidence.bundle._verify.Lines",
    .tp_basicsize = sizeof(Lines),
    .tp_dealloc = (destructor)lines_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)lines_traverse,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)lines_next,
};

static PyObject *lines(PyObject *module, PyObject *args) {
    PyObject *list, *before_id, *before_seq, *before_subject, *middle, *types, *specs, *loads, *dumps, *option,
        *is_time, *hashes, *counts, *errors, *envelope = Py_None;
    Py_ssize_t seq;
    if (!PyArg_ParseTuple(args, "OnSSSSO!O!OOOOO!O!O|O", &list, &seq, &before_id, &before_seq,
                          &before_subject, &middle, &PyDict_Type, &types, &PyDict_Type, &specs, &loads, &dumps,
                          &option, &is_time, &PyList_Type, &hashes, &PyDict_Type, &counts, &errors, &envelope))
        return NULL;
    if (!PyList_Check(list) && !PyBytes_CheckExact(list)) {
        PyErr_SetString(PyExc_TypeError, "lines: a list of bytes, or a piece (bytes) of lines each ending with a newline");
        return NULL;
    }
    if (envelope != Py_None) {
        int ok = PyTuple_CheckExact(envelope) && PyTuple_GET_SIZE(envelope) == 6;
        for (Py_ssize_t k = 0; ok && k < 6; k++) {
            PyObject *v = PyTuple_GET_ITEM(envelope, k);
            ok = PyUnicode_CheckExact(v) || (k == 2 && v == Py_None);
        }
        if (!ok) {
            PyErr_SetString(PyExc_TypeError,
                            "envelope: (datacontenttype, id prefix, labels or None, runid, source, specversion)");
            return NULL;
        }
    }
    if (!PyBytes_CheckExact(before_id) || !PyBytes_CheckExact(before_seq) || !PyBytes_CheckExact(before_subject) ||
        !PyBytes_CheckExact(middle)) {
        PyErr_SetString(PyExc_TypeError, "the constant parts are bytes");
        return NULL;
    }
    Lines *self = PyObject_GC_New(Lines, &LinesType);
    if (!self) return NULL;
    self->next = 0;
    self->seq = seq;
    self->over = 0;
    self->core = (Buf){0};
    self->lines = Py_NewRef(list);
    self->before_id = Py_NewRef(before_id);
    self->before_seq = Py_NewRef(before_seq);
    self->before_subject = Py_NewRef(before_subject);
    self->middle = Py_NewRef(middle);
    self->types = Py_NewRef(types);
    self->specs = Py_NewRef(specs);
    self->loads = Py_NewRef(loads);
    self->dumps = Py_NewRef(dumps);
    self->option = Py_NewRef(option);
    self->is_time = Py_NewRef(is_time);
    self->hashes = Py_NewRef(hashes);
    self->counts = Py_NewRef(counts);
    self->errors = Py_NewRef(errors);
    self->envelope = envelope == Py_None ? NULL : Py_NewRef(envelope);
    self->last_type = self->last_known = NULL;
    self->ctx = EVP_MD_CTX_new();
    PyObject_GC_Track(self);
    if (!self->ctx) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

/* A piece's (lines, the longest line's length): its lines each end with a newline, what follows
 * the last is no line; (len(lines), max(map(len, lines), default=0)) of piece.split(b"\n")[:-1]. */
static PyObject *shape(PyObject *module, PyObject *arg) {
    if (!PyBytes_CheckExact(arg)) {
        PyErr_SetString(PyExc_TypeError, "shape: bytes");
        return NULL;
    }
    const char *p = PyBytes_AS_STRING(arg), *end = p + PyBytes_GET_SIZE(arg);
    Py_ssize_t lines = 0, most = 0;
    for (const char *nl; p < end && (nl = memchr(p, '\n', (size_t)(end - p))); p = nl + 1) {
        lines++;
        if (nl - p > most) most = nl - p;
    }
    return Py_BuildValue("(nn)", lines, most);
}

static PyMethodDef methods[] = {
    {"lines", lines, METH_VARARGS, "An iterator over the events of lines that pass the fast path."},
    {"shape", shape, METH_O, "A piece's (lines, the longest line's length)."},
    {"valid", valid, METH_VARARGS, "Whether data passes a data check's spec (what the fast path checks)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_verify", "The reader's fast path in C.", -1, methods};

PyMODINIT_FUNC PyInit__verify(void) {
    SHA256_MD = EVP_MD_fetch(NULL, "SHA256", NULL);
    if (!SHA256_MD) {
        PyErr_SetString(PyExc_ImportError, "OpenSSL has no SHA256");
        return NULL;
    }
    s_type = PyUnicode_InternFromString("type");
    s_data = PyUnicode_InternFromString("data");
    s_time = PyUnicode_InternFromString("time");
    s_subject = PyUnicode_InternFromString("subject");
    s_last_time = PyUnicode_InternFromString("last_time");
    s_datacontenttype = PyUnicode_InternFromString("datacontenttype");
    s_id = PyUnicode_InternFromString("id");
    s_labels = PyUnicode_InternFromString("labels");
    s_runid = PyUnicode_InternFromString("runid");
    s_seq = PyUnicode_InternFromString("seq");
    s_source = PyUnicode_InternFromString("source");
    s_specversion = PyUnicode_InternFromString("specversion");
    if (!s_datacontenttype || !s_id || !s_labels || !s_runid || !s_seq || !s_source || !s_specversion) return NULL;
    ONE = PyLong_FromLong(1);
    PyObject *option = PyUnicode_InternFromString("option"); /* orjson knows its keywords interned */
    if (!option) return NULL;
    kw_option = PyTuple_Pack(1, option);
    Py_DECREF(option);
    if (!s_type || !s_data || !s_time || !s_subject || !s_last_time || !ONE || !kw_option) return NULL;
    if (PyType_Ready(&LinesType) < 0) return NULL;
    return PyModule_Create(&module);
}
