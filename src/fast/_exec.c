/* The exec supervisor's usual request in C (issue 24's cost): agent/recorder/exec_resolve.py's
 * read_request for an execve by a caller whose root is the supervisor's (the same directory on the
 * same mount), naming its program by an absolute name, with an argv read whole. Every exec of a
 * job with command rules waits in the kernel while this runs, so its time is the job's.
 *
 * read_usual(pid, path_addr, argv_addr, root_dev, root_ino, root_mnt, heads, heads_max) returns
 * (path, argv, named, st_dev, st_ino, head): the path and argv as read from the caller's memory
 * (bytes), the name of the file the path leads to for the caller (readlink of the descriptor
 * openat2 gave: bytes), its identity and its first HEAD bytes (through the `heads` cache, a dict
 * shared with the Python path) -- or None for anything else: a page process_vm_readv cannot read,
 * a path or argv that would be cut, a relative name, a caller elsewhere, a name that leads to no
 * file or to one without a name of its own. The Python path (exec_resolve.read_request), which
 * stays the reference, then does it all, errors included: tests/unit/test_exec_fast.py holds the
 * two equal on generated names and arguments.
 *
 * next_notification(listener, stop) and allow(...): exec_supervisor.py's notification read (after
 * its wait), and its answer to an exec the rules allow (still pending? pinned, then let go on) in
 * one call: no Python runs while the caller waits for either. Their Python counterparts (serve's
 * loop, receive, still_pending, publish, respond) are the path without the compiled module.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/bpf.h>
#include <linux/openat2.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <time.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#define PAGE 4096
#define PATH_MAX_ 4096        /* exec_resolve.PATH_MAX */
#define MAX_ARGC 1000         /* exec_resolve.MAX_ARGC */
#define MAX_ARGV_BYTES 65536  /* exec_resolve.MAX_ARGV_BYTES */
#define HEAD 256              /* exec_resolve.HEAD */
#define PAGES_KEPT 8

/* One request's view of the caller's memory: pages read whole, each once (exec_resolve.CallerMemory). */
typedef struct {
    pid_t pid;
    int n;
    uint64_t base[PAGES_KEPT];
    char data[PAGES_KEPT][PAGE];
    int next; /* the slot reused when all are taken */
} Memory;

static const char *page_of(Memory *m, uint64_t addr) {
    uint64_t base = addr & ~(uint64_t)(PAGE - 1);
    for (int i = 0; i < m->n; i++)
        if (m->base[i] == base) return m->data[i];
    int slot;
    if (m->n < PAGES_KEPT) {
        slot = m->n++;
    } else {
        slot = m->next;
        m->next = (m->next + 1) % PAGES_KEPT;
    }
    struct iovec local = {m->data[slot], PAGE}, remote = {(void *)(uintptr_t)base, PAGE};
    if (process_vm_readv(m->pid, &local, 1, &remote, 1, 0) != PAGE) {
        m->base[slot] = UINT64_MAX; /* no page has that base: the slot is free again */
        return NULL;
    }
    m->base[slot] = base;
    return m->data[slot];
}

/* Both first pages at once, as CallerMemory.prefetch (one system call for most requests). */
static void prefetch(Memory *m, uint64_t a, uint64_t b) {
    uint64_t pa = a & ~(uint64_t)(PAGE - 1), pb = b & ~(uint64_t)(PAGE - 1);
    if (!a || !b || pa == pb) return;
    struct iovec local[2] = {{m->data[0], PAGE}, {m->data[1], PAGE}};
    struct iovec remote[2] = {{(void *)(uintptr_t)pa, PAGE}, {(void *)(uintptr_t)pb, PAGE}};
    if (process_vm_readv(m->pid, local, 2, remote, 2, 0) != 2 * PAGE) return;
    m->base[0] = pa;
    m->base[1] = pb;
    m->n = 2;
}

/* A NUL-terminated string of at most `limit` bytes before its NUL, appended to `out` (a bytes
 * object made from it); 0 when done, -1 when a page cannot be read or the string is longer. */
static PyObject *string_at(Memory *m, uint64_t addr, size_t limit) {
    {   /* most strings end in their first page: made from it at once */
        const char *page = page_of(m, addr);
        if (!page) Py_RETURN_NONE;
        size_t off = addr & (PAGE - 1), take = PAGE - off;
        if (take > limit) take = limit;
        const char *end = memchr(page + off, 0, take);
        if (end) return PyBytes_FromStringAndSize(page + off, (Py_ssize_t)(end - (page + off)));
    }
    char *buf = PyMem_Malloc(limit + 1);
    if (!buf) return PyErr_NoMemory();
    size_t got = 0;
    while (got < limit) {
        uint64_t at = addr + got;
        const char *page = page_of(m, at);
        if (!page) break;
        size_t off = at & (PAGE - 1), take = PAGE - off;
        if (take > limit - got) take = limit - got;
        const char *end = memchr(page + off, 0, take);
        if (end) {
            size_t n = (size_t)(end - (page + off));
            memcpy(buf + got, page + off, n);
            PyObject *s = PyBytes_FromStringAndSize(buf, (Py_ssize_t)(got + n));
            PyMem_Free(buf);
            return s;
        }
        memcpy(buf + got, page + off, take);
        got += take;
    }
    PyMem_Free(buf);
    Py_RETURN_NONE; /* unreadable or cut: the Python path says which */
}

static int pointer_at(Memory *m, uint64_t addr, uint64_t *out) {
    size_t off = addr & (PAGE - 1);
    const char *page = page_of(m, addr);
    if (!page) return -1;
    if (off + 8 <= PAGE) {
        memcpy(out, page + off, 8);
        return 0;
    }
    unsigned char raw[8];
    size_t first = PAGE - off;
    memcpy(raw, page + off, first);
    const char *next = page_of(m, addr + 8 - 1);
    if (!next) return -1;
    memcpy(raw + first, next, 8 - first);
    memcpy(out, raw, 8);
    return 0;
}

/* argv, or None when it cannot be read whole (the Python path then reads it, cut or failing). */
static PyObject *argv_at(Memory *m, uint64_t addr) {
    PyObject *argv = PyList_New(0);
    if (!argv || addr == 0) return argv;
    size_t total = 0;
    for (int i = 0; i <= MAX_ARGC; i++) {
        uint64_t ptr;
        if (pointer_at(m, addr + 8 * (uint64_t)i, &ptr) < 0) break;
        if (ptr == 0) return argv;
        if (i == MAX_ARGC) break;
        size_t limit = MAX_ARGV_BYTES - total;
        if (limit > PATH_MAX_ * 32) limit = PATH_MAX_ * 32;
        PyObject *arg = string_at(m, ptr, limit);
        if (!arg) {
            Py_DECREF(argv);
            return NULL;
        }
        if (arg == Py_None) {
            Py_DECREF(arg);
            break;
        }
        total += (size_t)PyBytes_GET_SIZE(arg) + 1;
        int failed = PyList_Append(argv, arg);
        Py_DECREF(arg);
        if (failed) {
            Py_DECREF(argv);
            return NULL;
        }
        if (total >= MAX_ARGV_BYTES) break; /* the Python path calls this truncated */
    }
    Py_DECREF(argv);
    Py_RETURN_NONE;
}

/* exec_resolve._caller_path on bytes, for the names it leaves as they are: `//x` is `/x`; a name
 * under /proc/ (/proc/self/, /proc/thread-self/: the caller's process and thread) is Python's. */
static int caller_path(const char *path, size_t n, char *out, size_t cap) {
    if (n >= 2 && path[0] == '/' && path[1] == '/') {
        while (n && *path == '/') path++, n--;
        path--, n++; /* keep one */
    }
    if (n >= 6 && !memcmp(path, "/proc/", 6)) return -1;
    if (n + 1 > cap) return -1;
    memcpy(out, path, n);
    out[n] = 0;
    return 0;
}

/* A time in nanoseconds as Python's st_mtime_ns: 0 when it does not fit in 64 bits (a job can
 * set any mtime; Python's integers have no bound). */
static int ns_of(const struct timespec *t, long long *out) {
    long long ns;
    if (__builtin_mul_overflow((long long)t->tv_sec, 1000000000LL, &ns) ||
        __builtin_add_overflow(ns, (long long)t->tv_nsec, out))
        return 0;
    return 1;
}

/* exec_resolve._head_of: the file's first HEAD bytes through the `heads` cache (b"" for a file
 * that is not regular or cannot be read, not kept). A new reference; NULL with an exception, or
 * NULL without one for a time past 64 bits of nanoseconds (the Python path then reads it). */
static PyObject *head_of(int fd, const struct stat *st, PyObject *heads, Py_ssize_t heads_max) {
    if (!S_ISREG(st->st_mode)) return PyBytes_FromStringAndSize("", 0);
    long long mtime, ctime;
    if (!ns_of(&st->st_mtim, &mtime) || !ns_of(&st->st_ctim, &ctime)) return NULL; /* Python's */
    PyObject *key = Py_BuildValue("(KKLLL)", (unsigned long long)st->st_dev, (unsigned long long)st->st_ino,
                                  (long long)st->st_size, mtime, ctime);
    if (!key) return NULL;
    PyObject *got = PyDict_GetItemWithError(heads, key);
    if (got) {
        Py_DECREF(key);
        Py_INCREF(got);
        return got;
    }
    if (PyErr_Occurred()) {
        Py_DECREF(key);
        return NULL;
    }
    char proc[64], buf[HEAD];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    int readable = open(proc, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (readable < 0) {
        Py_DECREF(key);
        return PyBytes_FromStringAndSize("", 0);
    }
    ssize_t n = read(readable, buf, HEAD);
    close(readable);
    if (n < 0) {
        Py_DECREF(key);
        return PyBytes_FromStringAndSize("", 0);
    }
    PyObject *head = PyBytes_FromStringAndSize(buf, n);
    if (!head) {
        Py_DECREF(key);
        return NULL;
    }
    if (PyDict_GET_SIZE(heads) >= heads_max) PyDict_Clear(heads);
    int failed = PyDict_SetItem(heads, key, head);
    Py_DECREF(key);
    if (failed) {
        Py_DECREF(head);
        return NULL;
    }
    return head;
}

static Memory memory; /* one request's pages, reused (the GIL is held throughout) */
static int memory_busy;

static PyObject *read_usual(PyObject *self, PyObject *args) {
    int pid;
    unsigned long long path_addr, argv_addr, root_dev, root_ino;
    long long root_mnt;
    PyObject *heads;
    Py_ssize_t heads_max;
    if (!PyArg_ParseTuple(args, "iKKKKLO!n", &pid, &path_addr, &argv_addr, &root_dev, &root_ino, &root_mnt,
                          &PyDict_Type, &heads, &heads_max))
        return NULL;
    /* a call made while one runs (by code a Python object's finalizer runs, say) gets its own */
    Memory *m = memory_busy ? PyMem_Malloc(sizeof(Memory)) : &memory;
    if (!m) return PyErr_NoMemory();
    if (m == &memory) memory_busy = 1;
    m->pid = pid;
    m->n = m->next = 0;
    PyObject *path = NULL, *argv = NULL, *named = NULL, *head = NULL, *result = NULL;
    int fd = -1;
    prefetch(m, path_addr, argv_addr);
    path = string_at(m, path_addr, PATH_MAX_);
    if (!path || path == Py_None) goto done;
    argv = argv_at(m, argv_addr);
    if (!argv || argv == Py_None) goto done;
    const char *p = PyBytes_AS_STRING(path);
    size_t pn = (size_t)PyBytes_GET_SIZE(path);
    if (pn == 0 || p[0] != '/') goto done; /* a relative name: the Python path */

    char proc[64];
    struct stat st;
    /* the caller's root: ours, the same directory on the same mount (exec_resolve.root_mount) */
    struct statx sx;
    snprintf(proc, sizeof proc, "/proc/%d/root", pid);
    if (statx(AT_FDCWD, proc, 0, STATX_INO | STATX_MNT_ID, &sx) < 0 || !(sx.stx_mask & STATX_MNT_ID)) goto done;
    if ((unsigned long long)makedev(sx.stx_dev_major, sx.stx_dev_minor) != root_dev ||
        (unsigned long long)sx.stx_ino != root_ino || (long long)sx.stx_mnt_id != root_mnt)
        goto done;

    char name[PATH_MAX_ + 64];
    if (caller_path(p, pn, name, sizeof name) < 0) goto done;
    /* no magic link (/proc/PID/exe, /proc/PID/fd/N, /dev/fd/N): read for the caller, by Python */
    struct open_how how = {.flags = O_PATH | O_CLOEXEC, .mode = 0, .resolve = RESOLVE_NO_MAGICLINKS};
    /* an absolute name walks from this process's root, which is the caller's (checked above) */
    fd = (int)syscall(SYS_openat2, AT_FDCWD, name, &how, sizeof how);
    if (fd < 0 || fstat(fd, &st) < 0) goto done;
    char link[PATH_MAX_ + 64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    ssize_t ln = readlink(proc, link, sizeof link);
    static const char deleted[] = " (deleted)";
    size_t dn = sizeof deleted - 1;
    if (ln <= 0 || ln >= (ssize_t)sizeof link || link[0] != '/') goto done;
    if ((size_t)ln >= dn && !memcmp(link + ln - dn, deleted, dn)) goto done;
    named = PyBytes_FromStringAndSize(link, ln);
    if (!named) goto done;
    head = head_of(fd, &st, heads, heads_max);
    if (!head) goto done;
    result = Py_BuildValue("(OOOKKO)", path, argv, named, (unsigned long long)st.st_dev,
                           (unsigned long long)st.st_ino, head);

done:
    if (fd >= 0) close(fd);
    Py_XDECREF(path);
    Py_XDECREF(argv);
    Py_XDECREF(named);
    Py_XDECREF(head);
    if (m == &memory)
        memory_busy = 0;
    else
        PyMem_Free(m);
    if (!result && !PyErr_Occurred()) Py_RETURN_NONE;
    return result;
}

/* bpf(BPF_MAP_UPDATE_ELEM, BPF_ANY) of one element: 0, or the errno the kernel gave. */
static int update_elem(int fd, const void *key, const void *value) {
    union bpf_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.map_fd = (uint32_t)fd;
    attr.key = (uint64_t)(uintptr_t)key;
    attr.value = (uint64_t)(uintptr_t)value;
    attr.flags = BPF_ANY;
    return syscall(SYS_bpf, BPF_MAP_UPDATE_ELEM, &attr, sizeof attr) < 0 ? errno : 0;
}

/* exec_supervisor.ExecSupervisor.serve's wait: the next notification, (id, pid, nr, args,
 * CLOCK_MONOTONIC ns when read), once the listener has one (poll with the GIL let go, then RECV at
 * once: the caller waits in the kernel meanwhile); None when `stop` is readable or every process
 * of the filter is gone (POLLHUP without POLLIN); OSError when RECV fails but for a caller gone
 * before it was read (ENOENT) or a signal (EINTR), which wait for the next. */
static PyObject *next_notification(PyObject *self, PyObject *args) {
    int listener, stop;
    if (!PyArg_ParseTuple(args, "ii", &listener, &stop)) return NULL;
    for (;;) {
        struct pollfd fds[2] = {{listener, POLLIN, 0}, {stop, POLLIN, 0}};
        int ready, err = 0;
        Py_BEGIN_ALLOW_THREADS
        ready = poll(fds, stop >= 0 ? 2 : 1, -1);
        if (ready < 0) err = errno;
        Py_END_ALLOW_THREADS
        if (ready < 0) {
            if (err != EINTR) {
                errno = err;
                return PyErr_SetFromErrno(PyExc_OSError);
            }
            if (PyErr_CheckSignals() < 0) return NULL;
            continue;
        }
        if (stop >= 0 && fds[1].revents) Py_RETURN_NONE;
        if ((fds[0].revents & (POLLHUP | POLLERR)) && !(fds[0].revents & POLLIN)) Py_RETURN_NONE;
        if (!(fds[0].revents & POLLIN)) continue;
        struct seccomp_notif n;
        memset(&n, 0, sizeof n);
        if (ioctl(listener, SECCOMP_IOCTL_NOTIF_RECV, &n) < 0) {
            if (errno == ENOENT || errno == EINTR) continue; /* the caller went away before it was read */
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        return Py_BuildValue("(KIi(KKKKKK)L)", (unsigned long long)n.id, n.pid, n.data.nr,
                             (unsigned long long)n.data.args[0], (unsigned long long)n.data.args[1],
                             (unsigned long long)n.data.args[2], (unsigned long long)n.data.args[3],
                             (unsigned long long)n.data.args[4], (unsigned long long)n.data.args[5],
                             (long long)now.tv_sec * 1000000000LL + now.tv_nsec);
    }
}

/* An allowed exec answered at once (exec_supervisor.ExecSupervisor._finish's usual case): while the
 * notification `id` is still pending (NOTIF_ID_VALID), its pin goes into the map (`key`, `value`:
 * the caller sizes them as the map's), then the kernel goes on with the call (NOTIF_SEND, CONTINUE). (status, when the
 * answer was sent, CLOCK_MONOTONIC ns, 0 if it was not); status 0: answered; 1: not pending any more
 * (nothing done); 2: answered, but its caller went away meanwhile; -errno: the pin was not held
 * (nothing answered: the caller refuses it); OSError: the answer failed otherwise. */
static PyObject *allow(PyObject *self, PyObject *args) {
    int listener, fd;
    unsigned long long id;
    Py_buffer key, value;
    if (!PyArg_ParseTuple(args, "iKiy*y*", &listener, &id, &fd, &key, &value)) return NULL;
    long status = 0;
    long long sent = 0;
    __u64 nid = id;
    if (ioctl(listener, SECCOMP_IOCTL_NOTIF_ID_VALID, &nid) < 0) {
        status = 1;
        goto done;
    }
    int err = update_elem(fd, key.buf, value.buf);
    if (err) {
        status = -err;
        goto done;
    }
    struct seccomp_notif_resp resp = {.id = id, .val = 0, .error = 0, .flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE};
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now); /* the answer lets the caller run on this CPU: timed before */
    sent = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
    if (ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, &resp) < 0) {
        if (errno == ENOENT) {
            status = 2; /* the caller went away meanwhile */
        } else {
            PyBuffer_Release(&key);
            PyBuffer_Release(&value);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
done:
    PyBuffer_Release(&key);
    PyBuffer_Release(&value);
    return Py_BuildValue("(lL)", status, sent);
}

static PyMethodDef methods[] = {
    {"read_usual", read_usual, METH_VARARGS,
     "The usual exec request read and resolved (exec_resolve.read_request's), or None."},
    {"next_notification", next_notification, METH_VARARGS,
     "(listener, stop): the next notification (id, pid, nr, args, monotonic ns), or None: stopped or gone."},
    {"allow", allow, METH_VARARGS,
     "(listener, id, pins_fd, key, value): pin and go on while pending: (status, sent ns)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_exec", NULL, -1, methods};

PyMODINIT_FUNC PyInit__exec(void) { return PyModule_Create(&module); }
