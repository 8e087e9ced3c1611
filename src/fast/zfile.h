/* ZFile: a file written as one zstandard frame by a thread of its own that never takes the GIL
 * (bundle/premade.py _File: full detail's premade lines and their content hashes). Included by
 * _fast.c after hash_run and ends_fit.
 *
 * Why: the Python thread that compressed the premade lines took the GIL four times a piece (the
 * queue, the join, back from the compression, back from the write), each time from a correlator
 * that holds it all the while it works; in a 2 x 1M distinct flood it waited 2.5 s for the GIL to
 * do 0.8 s of work, and the correlator waited 1.6 s for it to take the next piece. Here the
 * correlator's `put` hands a piece over under the GIL (a tuple of its parts, referenced until
 * written) and the thread does the rest alone: the deferred content hashes (opens' and repeats'
 * (cores, ends), as hash_cores makes them), the compression (libzstd, the level given), the
 * writes. What the thread is done with is let go by the next call that holds the GIL.
 *
 * ZFile(fd, level): written through a descriptor of its own (a dup of `fd`, closed by end or close:
 *   the caller's may close, and its number be reused by another file, without a byte going there).
 * put(pieces): a list of bytes and of (cores, ends) pairs, written in order after what came before;
 *   waits (the GIL let go) while a piece is still queued: one at most, as the Python thread's
 *   queue held. An error of the thread's (OSError: the write; RuntimeError: zstd or OpenSSL) is
 *   raised by the next put or end, and nothing more is written after it.
 * flush(): what was put before it compressed and written as far as zstandard can without ending
 *   the frame (a flushed block: a reader of the file sees it all), waited for with the GIL let go
 *   (the spool's flush, bundle/spool.py, once a second: a recovery reads what it holds).
 * end(): everything written and the frame ended; the thread is gone. Nothing is put after.
 * close(): the thread stopped, what it held let go (what was not written is not).
 */
#include <fcntl.h>
#include <pthread.h>
#include <zstd.h>

typedef struct ZPiece {
    const char *a, *b; /* bytes: a; deferred hashes: the cores a, their ends b */
    size_t an, bn;
    int deferred;
} ZPiece;

typedef struct ZJob {
    PyObject *held; /* a tuple of the pieces' objects: alive until the thread is done */
    Py_ssize_t n;
    ZPiece *pieces;
    uint64_t flush; /* a flush's number (from 1), after its pieces; 0: none */
    struct ZJob *next; /* on the done list */
} ZJob;

typedef struct {
    PyObject_HEAD
    int fd;
    ZSTD_CCtx *cctx;
    EVP_MD_CTX *md;
    pthread_t thread;
    int started, joined;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ZJob *queued, *working, *done;
    int stop;
    int err;          /* errno of a failed write, or -1: zstd or OpenSSL failed */
    char *out, *hex;  /* the compressed bytes' buffer; the hashes' */
    size_t out_cap, hex_cap;
    int ended;
    int ready; /* the mutex and the condition made (tp_init got that far) */
    uint64_t flushes, flushed; /* flushes asked for, and the last done */
} ZFile;

static void zjob_free(ZJob *j) { /* with the GIL */
    Py_XDECREF(j->held);
    free(j->pieces);
    free(j);
}

/* the jobs the thread is done with, let go (with the GIL) */
static void zfile_reap(ZFile *z) {
    pthread_mutex_lock(&z->mu);
    ZJob *j = z->done;
    z->done = NULL;
    pthread_mutex_unlock(&z->mu);
    while (j) {
        ZJob *next = j->next;
        zjob_free(j);
        j = next;
    }
}

static int zfile_write_all(ZFile *z, const char *p, size_t n) { /* 0, or -1 with z->err set */
    while (n) {
        ssize_t w = write(z->fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            z->err = errno;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* compress `n` bytes at `p` into the frame (mode: ZSTD_e_continue, or ZSTD_e_end with nothing) */
static int zfile_compress(ZFile *z, const char *p, size_t n, ZSTD_EndDirective mode) {
    ZSTD_inBuffer in = {p, n, 0};
    for (;;) {
        ZSTD_outBuffer out = {z->out, z->out_cap, 0};
        size_t left = ZSTD_compressStream2(z->cctx, &out, &in, mode);
        if (ZSTD_isError(left)) {
            z->err = -1;
            return -1;
        }
        if (out.pos && zfile_write_all(z, z->out, out.pos)) return -1;
        if (mode == ZSTD_e_end ? left == 0 : in.pos == in.size) return 0;
    }
}

static int zfile_piece(ZFile *z, const ZPiece *pc) { /* without the GIL: 0, or -1 with z->err set */
    if (!pc->deferred) return zfile_compress(z, pc->a, pc->an, ZSTD_e_continue);
    size_t count = pc->bn / sizeof(size_t);
    if (65 * count > z->hex_cap) {
        char *h = realloc(z->hex, 65 * count);
        if (!h) {
            z->err = ENOMEM;
            return -1;
        }
        z->hex = h;
        z->hex_cap = 65 * count;
    }
    if (!hash_run(z->hex, z->md, pc->a, pc->b, count)) {
        z->err = -1;
        return -1;
    }
    return zfile_compress(z, z->hex, 65 * count, ZSTD_e_continue);
}

static void *zfile_run(void *arg) {
    ZFile *z = arg;
    pthread_setname_np(pthread_self(), "evidence-zfile"); /* (else the correlator's name, in /proc) */
    pthread_mutex_lock(&z->mu);
    for (;;) {
        while (!z->queued && !z->stop) pthread_cond_wait(&z->cv, &z->mu);
        if (!z->queued) break;
        ZJob *j = z->queued;
        z->queued = NULL;
        z->working = j;
        pthread_cond_broadcast(&z->cv); /* a put waiting for room */
        int failed = z->err != 0;
        pthread_mutex_unlock(&z->mu);
        for (Py_ssize_t k = 0; k < j->n && !failed; k++) failed = zfile_piece(z, &j->pieces[k]) != 0;
        if (j->flush && !failed) failed = zfile_compress(z, NULL, 0, ZSTD_e_flush) != 0;
        pthread_mutex_lock(&z->mu);
        if (j->flush) z->flushed = j->flush;
        z->working = NULL;
        j->next = z->done;
        z->done = j;
        pthread_cond_broadcast(&z->cv); /* an end waiting for the last */
    }
    pthread_mutex_unlock(&z->mu);
    return NULL;
}

static int zfile_raise(ZFile *z) { /* -1 with the thread's error set as Python's, or 0 */
    if (!z->err) return 0;
    if (z->err > 0) {
        errno = z->err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        PyErr_SetString(PyExc_RuntimeError, "the premade file could not be compressed");
    }
    return -1;
}

static void zfile_close_fd(ZFile *z) { /* (once the thread is gone) */
    if (z->fd >= 0) close(z->fd);
    z->fd = -1;
}

/* the thread told to stop and joined, the GIL let go while it finishes its piece */
static void zfile_join(ZFile *z) {
    if (!z->started || z->joined) return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&z->mu);
    z->stop = 1;
    pthread_cond_broadcast(&z->cv);
    pthread_mutex_unlock(&z->mu);
    pthread_join(z->thread, NULL);
    Py_END_ALLOW_THREADS
    z->joined = 1;
}

static int zfile_init(ZFile *z, PyObject *args, PyObject *kw) {
    int fd, level;
    if (!PyArg_ParseTuple(args, "ii", &fd, &level)) return -1;
    if (z->ready) {
        PyErr_SetString(PyExc_TypeError, "a ZFile is made once");
        return -1;
    }
    z->fd = -1;
    pthread_mutex_init(&z->mu, NULL);
    pthread_cond_init(&z->cv, NULL);
    z->ready = 1;
    z->cctx = ZSTD_createCCtx();
    z->md = EVP_MD_CTX_new();
    z->out_cap = ZSTD_CStreamOutSize();
    z->out = malloc(z->out_cap);
    if (!z->cctx || !z->md || !z->out) {
        PyErr_NoMemory();
        return -1;
    }
    z->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (z->fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (level < ZSTD_minCLevel() || level > ZSTD_maxCLevel() ||
        ZSTD_isError(ZSTD_CCtx_setParameter(z->cctx, ZSTD_c_compressionLevel, level))) {
        PyErr_SetString(PyExc_ValueError, "not a zstandard level");
        return -1;
    }
    return 0;
}

static PyObject *zfile_queue(ZFile *z, ZJob *j);

static PyObject *zfile_put(ZFile *z, PyObject *arg) {
    if (!z->out || z->ended) {
        PyErr_SetString(PyExc_ValueError, "written after its end");
        return NULL;
    }
    zfile_reap(z);
    if (zfile_raise(z)) return NULL;
    if (!PyList_CheckExact(arg)) {
        PyErr_SetString(PyExc_TypeError, "put takes a list");
        return NULL;
    }
    ZJob *j = calloc(1, sizeof *j);
    if (!j) return PyErr_NoMemory();
    j->held = PySequence_Tuple(arg); /* (the list may change after: its items may not go) */
    j->n = j->held ? PyTuple_GET_SIZE(j->held) : 0;
    j->pieces = j->held ? calloc((size_t)j->n + 1, sizeof(ZPiece)) : NULL;
    if (!j->pieces) {
        if (j->held) PyErr_NoMemory();
        zjob_free(j);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < j->n; k++) {
        PyObject *p = PyTuple_GET_ITEM(j->held, k);
        ZPiece *pc = &j->pieces[k];
        if (PyBytes_CheckExact(p)) {
            pc->a = PyBytes_AS_STRING(p), pc->an = (size_t)PyBytes_GET_SIZE(p);
            continue;
        }
        PyObject *c = PyTuple_CheckExact(p) && PyTuple_GET_SIZE(p) == 2 ? PyTuple_GET_ITEM(p, 0) : NULL;
        PyObject *e = c ? PyTuple_GET_ITEM(p, 1) : NULL;
        if (!c || !PyBytes_CheckExact(c) || !PyBytes_CheckExact(e)) {
            PyErr_SetString(PyExc_TypeError, "a piece is bytes or (cores, ends)");
            zjob_free(j);
            return NULL;
        }
        pc->deferred = 1;
        pc->a = PyBytes_AS_STRING(c), pc->an = (size_t)PyBytes_GET_SIZE(c);
        pc->b = PyBytes_AS_STRING(e), pc->bn = (size_t)PyBytes_GET_SIZE(e);
        if (!ends_fit(pc->b, pc->bn, pc->an)) { /* (as hash_cores checks them) */
            PyErr_SetString(PyExc_ValueError, "the cores' ends are not theirs");
            zjob_free(j);
            return NULL;
        }
    }
    return zfile_queue(z, j);
}

/* `j` handed to the thread (its thread started with the first): None, or NULL with the thread's
 * error set (j let go) */
static PyObject *zfile_queue(ZFile *z, ZJob *j) {
    if (!z->started) {
        int r = pthread_create(&z->thread, NULL, zfile_run, z);
        if (r) {
            zjob_free(j);
            errno = r;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        z->started = 1;
    }
    /* handed over at once when nothing is queued (the GIL kept: letting it go would wait to take it
     * back from whoever took it meanwhile); else waited for with the GIL let go */
    int failed;
    /* (the mutex is never held while the GIL is waited for: a thread holding the GIL may want it) */
    pthread_mutex_lock(&z->mu);
    while (z->queued && !z->err && !z->stop) {
        pthread_mutex_unlock(&z->mu);
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&z->mu);
        while (z->queued && !z->err && !z->stop) pthread_cond_wait(&z->cv, &z->mu);
        pthread_mutex_unlock(&z->mu);
        Py_END_ALLOW_THREADS
        pthread_mutex_lock(&z->mu);
    }
    /* (stopped meanwhile: ended or closed by another thread, which nothing is written after) */
    int stopped = z->stop;
    failed = z->err != 0 || stopped;
    if (!failed) {
        z->queued = j;
        pthread_cond_broadcast(&z->cv);
    }
    pthread_mutex_unlock(&z->mu);
    if (failed) {
        zjob_free(j);
        if (stopped && !z->err) {
            PyErr_SetString(PyExc_ValueError, "written after its end");
            return NULL;
        }
        return zfile_raise(z), NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *zfile_flush(ZFile *z, PyObject *unused) {
    if (!z->out || z->ended) {
        PyErr_SetString(PyExc_ValueError, "flushed after its end");
        return NULL;
    }
    zfile_reap(z);
    if (zfile_raise(z)) return NULL;
    ZJob *j = calloc(1, sizeof *j);
    if (!j) return PyErr_NoMemory();
    uint64_t mine = j->flush = ++z->flushes;
    PyObject *queued = zfile_queue(z, j);
    if (!queued) return NULL;
    Py_DECREF(queued);
    int failed;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&z->mu);
    while (z->flushed < mine && !z->err) pthread_cond_wait(&z->cv, &z->mu);
    failed = z->err != 0;
    pthread_mutex_unlock(&z->mu);
    Py_END_ALLOW_THREADS
    zfile_reap(z);
    if (failed) return zfile_raise(z), NULL;
    Py_RETURN_NONE;
}

static PyObject *zfile_fileno(ZFile *z, PyObject *unused) {
    return PyLong_FromLong(z->fd);
}

static PyObject *zfile_end(ZFile *z, PyObject *unused) {
    if (!z->out) {
        PyErr_SetString(PyExc_ValueError, "not made");
        return NULL;
    }
    if (z->ended) Py_RETURN_NONE;
    z->ended = 1;
    zfile_join(z); /* (it takes what is queued before it stops) */
    zfile_reap(z);
    if (zfile_raise(z)) return NULL;
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = zfile_compress(z, NULL, 0, ZSTD_e_end);
    Py_END_ALLOW_THREADS
    zfile_close_fd(z);
    if (failed) return zfile_raise(z), NULL;
    Py_RETURN_NONE;
}

static PyObject *zfile_close(ZFile *z, PyObject *unused) {
    if (!z->ready) Py_RETURN_NONE;
    z->ended = 1;
    zfile_join(z);
    if (z->queued) { /* never taken: the thread stopped before it */
        zjob_free(z->queued);
        z->queued = NULL;
    }
    zfile_reap(z);
    zfile_close_fd(z);
    Py_RETURN_NONE;
}

static void zfile_dealloc(ZFile *z) {
    if (z->ready) {
        PyObject *r = zfile_close(z, NULL);
        Py_XDECREF(r);
        pthread_mutex_destroy(&z->mu);
        pthread_cond_destroy(&z->cv);
    }
    ZSTD_freeCCtx(z->cctx);
    EVP_MD_CTX_free(z->md);
    free(z->out);
    free(z->hex);
    Py_TYPE(z)->tp_free((PyObject *)z);
}

static PyMethodDef zfile_methods[] = {
    {"put", (PyCFunction)zfile_put, METH_O, "Pieces written after those before (see above)."},
    {"flush", (PyCFunction)zfile_flush, METH_NOARGS, "What was put written, a block flushed (see above)."},
    {"fileno", (PyCFunction)zfile_fileno, METH_NOARGS, "Its own descriptor (-1 once closed)."},
    {"end", (PyCFunction)zfile_end, METH_NOARGS, "Everything written, the frame ended (see above)."},
    {"close", (PyCFunction)zfile_close, METH_NOARGS, "The thread stopped (see above)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ZFileType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "evidence.bundle._fast.ZFile",
    .tp_basicsize = sizeof(ZFile),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A file written as one zstandard frame by a thread without the GIL (see src/fast/zfile.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)zfile_init,
    .tp_dealloc = (destructor)zfile_dealloc,
    .tp_methods = zfile_methods,
};
