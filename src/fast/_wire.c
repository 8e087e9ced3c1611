/* The fleet publisher's per-event framing in C (issue 25): what bundle/fleet/binding.py
 * `encode_many` and agent/daemon/fleet_wire.py `build` do together for a batch of live events,
 * for the common case, byte for byte. The Python path is the reference and does everything else:
 * tests/unit/test_wire_fast.py holds both byte-identical on generated events (hypothesis).
 * Built by `make setup` (setup.py) as evidence.agent.daemon._wire; EVIDENCE_PURE_PYTHON=1 leaves it
 * unused.
 *
 * frames(subjects, events, prefix, dumps, option) -> (data, offsets, sizes) | None
 *   subjects: a list of bytes, events: a list of dicts (as many); or subjects a dict of session id
 *   to bytes, each event's subject that of its `sessionid` (fleet_wire.frame_known): then the
 *   1-tuple (session id,) of the first event whose session is not in it, nothing made (the caller
 *   names it and calls again); prefix: the segment's reply prefix (fleet_wire.reply_prefix); dumps:
 *   orjson.dumps, option: orjson.OPT_SORT_KEYS.
 *   Event k becomes
 *     HPUB <subject> <prefix><k> <header bytes> <total bytes>\r\n<headers><payload>\r\n
 *   with the headers `NATS/1.0`, `Nats-Msg-Id: <id>`, then each attribute but `data` in the dict's
 *   order as `ce-<name>: <value>` (`datacontenttype` as `Content-Type`), an empty line; the payload
 *   is dumps(event.get("data"), option=option). data is the frames back to back, offsets where
 *   each begins (and the end), sizes each message's header and payload bytes.
 *   None (nothing made) unless the whole batch is the case binding.encode_many's template takes:
 *   every value but data's an exact str or int, all printable ASCII without `%` or `"`; every name
 *   printable ASCII; an `id`; and a payload dumps makes. The caller then takes the Python path,
 *   which encodes such a batch event by event (or raises as it raises).
 *
 * stored(buf, end, inbox, seg, answers, place, mark) -> int
 *   What fleet_wire.py's _Conn._parse and EventWire.stored do with a read that is nothing but plain
 *   PubAcks: if buf[:end] is a run of
 *     MSG <inbox>.<digits>.<digits> <digits> <digits>\r\n{"stream":"<s>",["domain":"<d>",]"seq":<digits>}\r\n
 *   (<s>, <d>: no '"', CR or LF; the regular expression of fleet_wire._acks, exactly), each one whose
 *   segment is `seg` (the same digits) marks answers[k] = mark where k is its token (through `place`,
 *   a dict of token to place, when not None) if 0 <= k < len(answers) and answers[k] is None; returns
 *   how many it marked. -1 (nothing marked) when buf[:end] is not such a run: the caller reads it
 *   message by message.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "buf.h"



#define PUT_LIT(b, s) put((b), (s), sizeof(s) - 1)

static inline int put_ssize(Buf *b, Py_ssize_t v) {
    char tmp[32];
    return put(b, tmp, (size_t)decimal(tmp, (long long)v));
}

/* printable ASCII (what str.isascii() and str.isprintable() both take) */
static inline int printable(const char *s, Py_ssize_t n, int value) {
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c > 0x7e) return 0;
        if (value && (c == '%' || c == '"')) return 0;
    }
    return 1;
}

/* 1: put str(value) (a plain value); 0: not the template's case; -1: an error (memory) */
static int put_value(Buf *b, PyObject *v) {
    if (PyUnicode_CheckExact(v)) {
        if (!PyUnicode_IS_ASCII(v)) return 0;
        const char *s = (const char *)PyUnicode_DATA(v);
        Py_ssize_t n = PyUnicode_GET_LENGTH(v);
        if (!printable(s, n, 1)) return 0;
        return put(b, s, (size_t)n) ? -1 : 1;
    }
    if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (x == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        if (!overflow) {
            char tmp[32];
            return put(b, tmp, (size_t)decimal(tmp, x)) ? -1 : 1;
        }
        PyObject *s = PyObject_Str(v); /* str(int): digits and a sign, printable */
        if (!s) {
            PyErr_Clear();
            return 0;
        }
        Py_ssize_t n;
        const char *u = PyUnicode_AsUTF8AndSize(s, &n);
        int r = u ? (put(b, u, (size_t)n) ? -1 : 1) : 0;
        if (!u) PyErr_Clear();
        Py_DECREF(s);
        return r;
    }
    return 0;
}

static PyObject *s_id, *s_data, *s_datacontenttype, *s_sessionid, *kw_option;

/* the header block of one event into h; 1 done, 0 not the case, -1 an error */
static int headers(Buf *h, PyObject *ev) {
    PyObject *id = PyDict_GetItemWithError(ev, s_id); /* borrowed */
    if (!id) {
        PyErr_Clear();
        return 0;
    }
    if (PUT_LIT(h, "NATS/1.0\r\nNats-Msg-Id: ")) return -1;
    int r = put_value(h, id);
    if (r <= 0) return r;
    if (PUT_LIT(h, "\r\n")) return -1;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(ev, &pos, &k, &v)) {
        if (!PyUnicode_CheckExact(k) || !PyUnicode_IS_ASCII(k)) return 0;
        const char *name = (const char *)PyUnicode_DATA(k);
        Py_ssize_t n = PyUnicode_GET_LENGTH(k);
        if (n == 4 && memcmp(name, "data", 4) == 0) continue;
        if (!printable(name, n, 0)) return 0;
        if (n == 15 && memcmp(name, "datacontenttype", 15) == 0) {
            if (PUT_LIT(h, "Content-Type: ")) return -1;
        } else if (PUT_LIT(h, "ce-") || put(h, name, (size_t)n) || PUT_LIT(h, ": ")) {
            return -1;
        }
        r = put_value(h, v);
        if (r <= 0) return r;
        if (PUT_LIT(h, "\r\n")) return -1;
    }
    return PUT_LIT(h, "\r\n") ? -1 : 1;
}

static PyObject *frames(PyObject *self, PyObject *args) {
    PyObject *subjects, *events, *dumps, *option;
    const char *prefix;
    Py_ssize_t prefix_n;
    if (!PyArg_ParseTuple(args, "OO!y#OO", &subjects, &PyList_Type, &events, &prefix, &prefix_n, &dumps,
                          &option))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(events);
    int by_session = PyDict_CheckExact(subjects);
    if (!by_session && !PyList_CheckExact(subjects)) {
        PyErr_SetString(PyExc_TypeError, "subjects: a list, or a dict of session id to subject");
        return NULL;
    }
    if (!by_session && PyList_GET_SIZE(subjects) != count) {
        PyErr_SetString(PyExc_ValueError, "as many subjects as events");
        return NULL;
    }
    Buf out = {0}, h = {0};
    PyObject *offsets = PyList_New(count + 1), *sizes = PyList_New(count), *result = NULL;
    PyObject *held = NULL; /* the event's subject, held while it is used */
    if (!offsets || !sizes) goto done;
    PyObject *call_args[2] = {NULL, option};
    for (Py_ssize_t k = 0; by_session && k < count; k++) { /* every session named, before any work */
        PyObject *ev = PyList_GET_ITEM(events, k), *sid;
        if (!PyDict_CheckExact(ev) || !(sid = PyDict_GetItemWithError(ev, s_sessionid))) {
            PyErr_Clear();
            goto fallback;
        }
        if (!PyDict_GetItemWithError(subjects, sid)) {
            if (PyErr_Occurred()) { /* a session id that does not hash: the Python path's */
                PyErr_Clear();
                goto fallback;
            }
            result = PyTuple_Pack(1, sid);
            goto done;
        }
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *ev = PyList_GET_ITEM(events, k), *subject;
        if (!PyDict_CheckExact(ev)) goto fallback;
        if (by_session) { /* subjects.get(ev.get("sessionid")) */
            PyObject *sid = PyDict_GetItemWithError(ev, s_sessionid);
            subject = sid ? PyDict_GetItemWithError(subjects, sid) : NULL;
            if (!subject) {
                PyErr_Clear(); /* none, or a session id that does not hash: the Python path's */
                goto fallback;
            }
        } else {
            subject = PyList_GET_ITEM(subjects, k);
        }
        if (!PyBytes_CheckExact(subject)) goto fallback;
        Py_XSETREF(held, Py_NewRef(subject));
        h.n = 0;
        int r = headers(&h, ev);
        if (r < 0) goto done;
        if (r == 0) goto fallback;
        PyObject *data = PyDict_GetItemWithError(ev, s_data);
        if (!data) {
            if (PyErr_Occurred()) PyErr_Clear();
            data = Py_None;
        }
        call_args[0] = data;
        PyObject *payload = PyObject_Vectorcall(dumps, call_args, 1, kw_option);
        if (!payload) {
            PyErr_Clear();
            goto fallback;
        }
        if (!PyBytes_CheckExact(payload)) {
            Py_DECREF(payload);
            goto fallback;
        }
        Py_ssize_t pn = PyBytes_GET_SIZE(payload);
        Py_ssize_t total = (Py_ssize_t)h.n + pn;
        PyObject *at = PyLong_FromSize_t(out.n), *size = PyLong_FromSsize_t(total);
        if (!at || !size) {
            Py_XDECREF(at);
            Py_XDECREF(size);
            Py_DECREF(payload);
            goto done;
        }
        PyList_SET_ITEM(offsets, k, at);
        PyList_SET_ITEM(sizes, k, size);
        if (PUT_LIT(&out, "HPUB ") || put(&out, PyBytes_AS_STRING(subject), PyBytes_GET_SIZE(subject)) ||
            PUT_LIT(&out, " ") || put(&out, prefix, (size_t)prefix_n) || put_ssize(&out, k) ||
            PUT_LIT(&out, " ") || put_ssize(&out, (Py_ssize_t)h.n) || PUT_LIT(&out, " ") ||
            put_ssize(&out, total) || PUT_LIT(&out, "\r\n") || put(&out, h.p, h.n) ||
            put(&out, PyBytes_AS_STRING(payload), (size_t)pn) || PUT_LIT(&out, "\r\n")) {
            Py_DECREF(payload);
            goto done;
        }
        Py_DECREF(payload);
    }
    {
        PyObject *end = PyLong_FromSize_t(out.n);
        if (!end) goto done;
        PyList_SET_ITEM(offsets, count, end);
        PyObject *data = PyBytes_FromStringAndSize(out.p ? out.p : "", (Py_ssize_t)out.n);
        if (!data) goto done;
        result = PyTuple_Pack(3, data, offsets, sizes);
        Py_DECREF(data);
    }
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    free(out.p);
    free(h.p);
    Py_XDECREF(held);
    Py_XDECREF(offsets);
    Py_XDECREF(sizes);
    return result;
}

/* the length of a run of digits at p (at most up to e) */
static inline Py_ssize_t digits(const char *p, const char *e) {
    const char *q = p;
    while (q < e && *q >= '0' && *q <= '9') q++;
    return q - p;
}

/* p past `lit` if it is there, else NULL */
static inline const char *lit(const char *p, const char *e, const char *s, size_t n) {
    return (size_t)(e - p) >= n && memcmp(p, s, n) == 0 ? p + n : NULL;
}

/* p past "[^"\r\n]*" and the quote that ends it, else NULL */
static inline const char *quoted(const char *p, const char *e) {
    while (p < e && *p != '"') {
        if (*p == '\r' || *p == '\n') return NULL;
        p++;
    }
    return p < e ? p + 1 : NULL;
}

/* one plain PubAck at p: its end, its segment's and token's digits; NULL if it is not one */
static const char *pub_ack(const char *p, const char *e, const Py_buffer *inbox, const char **s,
                           Py_ssize_t *sn, const char **t, Py_ssize_t *tn) {
    const char *q;
    Py_ssize_t n;
    if (!(q = lit(p, e, "MSG ", 4)) || !(q = lit(q, e, inbox->buf, (size_t)inbox->len)) || !(q = lit(q, e, ".", 1)))
        return NULL;
    *s = q;
    if (!(*sn = digits(q, e)) || !(q = lit(q + *sn, e, ".", 1))) return NULL;
    *t = q;
    if (!(*tn = digits(q, e)) || !(q = lit(q + *tn, e, " ", 1))) return NULL;
    if (!(n = digits(q, e)) || !(q = lit(q + n, e, " ", 1))) return NULL;
    if (!(n = digits(q, e)) || !(q = lit(q + n, e, "\r\n{\"stream\":\"", 13))) return NULL;
    if (!(q = quoted(q, e)) || !(q = lit(q, e, ",", 1))) return NULL;
    const char *d = lit(q, e, "\"domain\":\"", 10);
    if (d) { /* optional: taken when "seq" follows it, as the regular expression backtracks */
        const char *after = quoted(d, e);
        if (after && (after = lit(after, e, ",", 1)) && lit(after, e, "\"seq\":", 6)) q = after;
    }
    if (!(q = lit(q, e, "\"seq\":", 6))) return NULL;
    if (!(n = digits(q, e))) return NULL;
    return lit(q + n, e, "}\r\n", 3);
}

static PyObject *stored(PyObject *self, PyObject *args) {
    Py_buffer buf, inbox, seg;
    Py_ssize_t end;
    PyObject *answers, *place, *mark;
    if (!PyArg_ParseTuple(args, "y*ny*y*O!OO", &buf, &end, &inbox, &seg, &PyList_Type, &answers, &place, &mark))
        return NULL;
    PyObject *result = NULL;
    const char *s, *t;
    Py_ssize_t sn, tn;
    if (end < 0 || end > buf.len || (place != Py_None && !PyDict_Check(place))) {
        PyErr_SetString(PyExc_ValueError, "an end past the buffer, or a place that is not a dict");
        goto out;
    }
    const char *e = (const char *)buf.buf + end;
    /* the whole run first: nothing is marked unless all of it is plain PubAcks */
    for (const char *p = buf.buf; p < e;) {
        if (!(p = pub_ack(p, e, &inbox, &s, &sn, &t, &tn))) {
            result = PyLong_FromLong(-1);
            goto out;
        }
    }
    Py_ssize_t size = PyList_GET_SIZE(answers), got = 0;
    for (const char *p = buf.buf; p < e;) {
        p = pub_ack(p, e, &inbox, &s, &sn, &t, &tn);
        if (sn != seg.len || memcmp(s, seg.buf, (size_t)sn) != 0) continue;
        Py_ssize_t k = -1;
        if (place == Py_None) {
            if (tn <= 18) { /* a longer token is past any place */
                k = 0;
                for (Py_ssize_t j = 0; j < tn; j++) k = k * 10 + (t[j] - '0');
            }
        } else { /* place.get(int(token), -1) */
            PyObject *digits_str = PyUnicode_FromStringAndSize(t, tn);
            PyObject *key = digits_str ? PyLong_FromUnicodeObject(digits_str, 10) : NULL;
            Py_XDECREF(digits_str);
            if (!key) goto out;
            PyObject *v = PyDict_GetItemWithError(place, key);
            Py_DECREF(key);
            if (!v && PyErr_Occurred()) goto out;
            k = v ? PyLong_AsSsize_t(v) : -1;
            if (k == -1 && PyErr_Occurred()) {
                PyErr_Clear(); /* a place past Py_ssize_t: past the answers */
                k = -1;
            }
        }
        if (k >= 0 && k < size && PyList_GET_ITEM(answers, k) == Py_None) {
            Py_INCREF(mark);
            PyList_SET_ITEM(answers, k, mark);
            Py_DECREF(Py_None);
            got++;
        }
    }
    result = PyLong_FromSsize_t(got);
out:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&inbox);
    PyBuffer_Release(&seg);
    return result;
}

static PyMethodDef methods[] = {
    {"stored", stored, METH_VARARGS, "Plain PubAcks of a read, marked in the answers; -1 if not all plain."},
    {"frames", frames, METH_VARARGS, "A batch of live events as HPUB frames, or None (the Python path)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wire(void) {
    s_id = PyUnicode_InternFromString("id");
    s_data = PyUnicode_InternFromString("data");
    s_datacontenttype = PyUnicode_InternFromString("datacontenttype");
    s_sessionid = PyUnicode_InternFromString("sessionid");
    PyObject *option = PyUnicode_InternFromString("option"); /* orjson knows its keywords interned */
    if (!option) return NULL;
    kw_option = PyTuple_Pack(1, option);
    Py_DECREF(option);
    if (!s_id || !s_data || !s_datacontenttype || !s_sessionid || !kw_option) return NULL;
    return PyModule_Create(&module);
}
