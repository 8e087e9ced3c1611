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
 *
 * next_usual(...): both, and between them the usual exec of a program the supervisor's rules allow
 * whatever its argv and depth (a set of such names the Python path fills), checked as the Python
 * shortcut checks it and pinned (pin: exec_check.pin_exec's SipHash-2-4 and layout) without a line
 * of Python: ~30 us of the round trip's ~60 (exec_supervisor.ExecSupervisor._serve_usual). The
 * tests hold its pin to pin_exec's (tests/unit/test_exec_in_c.py) and its answers to the kernel's
 * exec check (tests/kernel/test_exec_usual_in_c.py).
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

/* readlink of /proc/self/fd/FD (the name of what FD names), through this process's fd directory
 * opened once (2.4 us a name, against 4.7 us through /proc/self/fd/FD: /proc/self walked each
 * time); opened again in a child this process forked, whose directory it is not. */
static int fd_dir = -1;
static pid_t fd_dir_pid;

static ssize_t name_of_fd(int fd, char *buf, size_t cap) {
    char name[32];
    pid_t me = getpid();
    if (fd_dir < 0 || fd_dir_pid != me) {
        if (fd_dir >= 0) close(fd_dir); /* the parent's copy */
        fd_dir = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        fd_dir_pid = me;
    }
    if (fd_dir < 0) {
        snprintf(name, sizeof name, "/proc/self/fd/%d", fd);
        return readlink(name, buf, cap);
    }
    snprintf(name, sizeof name, "%d", fd);
    return readlinkat(fd_dir, name, buf, cap);
}

static Memory memory; /* one request's pages, reused (the GIL is held throughout) */
static int memory_busy;

/* The caller's root, for the usual request: ours (exec_resolve._our_root_mount), and the cache of
 * heads with its bound (exec_resolve._HEADS, _HEADS_MAX). */
typedef struct {
    unsigned long long dev, ino;
    long long mnt;
    PyObject *heads;
    Py_ssize_t heads_max;
} Ours;

/* read_usual's work: the usual request's tuple, None, or NULL with an exception. */
static PyObject *usual_of(int pid, unsigned long long path_addr, unsigned long long argv_addr, const Ours *ours) {
    unsigned long long root_dev = ours->dev, root_ino = ours->ino;
    long long root_mnt = ours->mnt;
    PyObject *heads = ours->heads;
    Py_ssize_t heads_max = ours->heads_max;
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
    ssize_t ln = name_of_fd(fd, link, sizeof link);
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

static PyObject *read_usual(PyObject *self, PyObject *args) {
    int pid;
    unsigned long long path_addr, argv_addr;
    Ours ours;
    if (!PyArg_ParseTuple(args, "iKKKKLO!n", &pid, &path_addr, &argv_addr, &ours.dev, &ours.ino, &ours.mnt,
                          &PyDict_Type, &ours.heads, &ours.heads_max))
        return NULL;
    return usual_of(pid, path_addr, argv_addr, &ours);
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

/* The wait and the read of next_notification: 1 with `n` and when it was read (CLOCK_MONOTONIC ns),
 * 0 when `stop` is readable or every process of the filter is gone, -1 with an OSError set. */
static int wait_notification(int listener, int stop, struct seccomp_notif *n, long long *received) {
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
                PyErr_SetFromErrno(PyExc_OSError);
                return -1;
            }
            if (PyErr_CheckSignals() < 0) return -1;
            continue;
        }
        if (stop >= 0 && fds[1].revents) return 0;
        if ((fds[0].revents & (POLLHUP | POLLERR)) && !(fds[0].revents & POLLIN)) return 0;
        if (!(fds[0].revents & POLLIN)) continue;
        memset(n, 0, sizeof *n);
        if (ioctl(listener, SECCOMP_IOCTL_NOTIF_RECV, n) < 0) {
            if (errno == ENOENT || errno == EINTR) continue; /* the caller went away before it was read */
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        *received = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
        return 1;
    }
}

/* (id, pid, nr, args, received ns) of a notification, as exec_supervisor.Notification takes them. */
static PyObject *note_tuple(const struct seccomp_notif *n, long long received) {
    return Py_BuildValue("(KIi(KKKKKK)L)", (unsigned long long)n->id, n->pid, n->data.nr,
                         (unsigned long long)n->data.args[0], (unsigned long long)n->data.args[1],
                         (unsigned long long)n->data.args[2], (unsigned long long)n->data.args[3],
                         (unsigned long long)n->data.args[4], (unsigned long long)n->data.args[5], received);
}

/* exec_supervisor.ExecSupervisor.serve's wait: the next notification, (id, pid, nr, args,
 * CLOCK_MONOTONIC ns when read), once the listener has one (poll with the GIL let go, then RECV at
 * once: the caller waits in the kernel meanwhile); None when `stop` is readable or every process
 * of the filter is gone (POLLHUP without POLLIN); OSError when RECV fails but for a caller gone
 * before it was read (ENOENT) or a signal (EINTR), which wait for the next. */
static PyObject *next_notification(PyObject *self, PyObject *args) {
    int listener, stop;
    if (!PyArg_ParseTuple(args, "ii", &listener, &stop)) return NULL;
    struct seccomp_notif n;
    long long received;
    int got = wait_notification(listener, stop, &n, &received);
    if (got < 0) return NULL;
    if (got == 0) Py_RETURN_NONE;
    return note_tuple(&n, received);
}

/* allow's work: 0 answered, 1 not pending, 2 answered as its caller went away, -errno the pin not
 * held (nothing answered); -EXCEPTION_ with an OSError set when the answer failed otherwise. */
#define EXCEPTION_ 100000
static long pin_and_continue(int listener, unsigned long long id, int fd, const void *key, const void *value,
                             long long *sent) {
    __u64 nid = id;
    *sent = 0;
    if (ioctl(listener, SECCOMP_IOCTL_NOTIF_ID_VALID, &nid) < 0) return 1;
    int err = update_elem(fd, key, value);
    if (err) return -err;
    struct seccomp_notif_resp resp = {.id = id, .val = 0, .error = 0, .flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE};
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now); /* the answer lets the caller run on this CPU: timed before */
    *sent = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
    if (ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, &resp) < 0) {
        if (errno == ENOENT) return 2; /* the caller went away meanwhile */
        PyErr_SetFromErrno(PyExc_OSError);
        return -EXCEPTION_;
    }
    return 0;
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
    long long sent;
    long status = pin_and_continue(listener, id, fd, key.buf, value.buf, &sent);
    PyBuffer_Release(&key);
    PyBuffer_Release(&value);
    if (status == -EXCEPTION_) return NULL;
    return Py_BuildValue("(lL)", status, sent);
}

/* ---- The pin (agent/recorder/exec_check.pin_exec, for a program that is no script) */

/* SipHash-2-4 (Aumasson and Bernstein's reference, as probes/abi.siphash24 and siphashc). */
#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                                         \
    do {                                                                                                 \
        v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32);                                        \
        v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                                                           \
        v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                                                           \
        v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32);                                        \
    } while (0)

static uint64_t le64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* x86_64: little-endian */
    return v;
}

static uint64_t siphash24(const unsigned char key[16], const unsigned char *in, size_t n) {
    uint64_t k0 = le64(key), k1 = le64(key + 8);
    uint64_t v0 = 0x736f6d6570736575ULL ^ k0, v1 = 0x646f72616e646f6dULL ^ k1;
    uint64_t v2 = 0x6c7967656e657261ULL ^ k0, v3 = 0x7465646279746573ULL ^ k1;
    const unsigned char *end = in + (n - n % 8);
    for (; in != end; in += 8) {
        uint64_t m = le64(in);
        v3 ^= m;
        SIPROUND;
        SIPROUND;
        v0 ^= m;
    }
    uint64_t b = (uint64_t)(n & 0xff) << 56;
    for (size_t i = 0; i < n % 8; i++) b |= (uint64_t)in[i] << (8 * i);
    v3 ^= b;
    SIPROUND;
    SIPROUND;
    v0 ^= b;
    v2 ^= 0xff;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

#define EXEC_ARGS_MAX 131072 /* probes/abi.EXEC_ARGS_MAX */

/* struct exec_pin (probes/abi.EXEC_PIN: "<QQQII") */
typedef struct {
    uint64_t dev, ino, argv_hash;
    uint32_t args_len, flags;
} Pin;

static unsigned char area[EXEC_ARGS_MAX]; /* the arg area being hashed (the GIL is held) */

/* The pin of an exec of the file (st_dev, st_ino) with `argv` (a list of bytes), no script: 0, or
 * -1 when it cannot be pinned (an arg area past EXEC_ARGS_MAX: the Python path refuses it). */
static int pin_of(const unsigned char key[16], unsigned long long st_dev, unsigned long long st_ino,
                  PyObject *argv, Pin *pin) {
    size_t n = 0;
    Py_ssize_t argc = PyList_GET_SIZE(argv);
    if (argc == 0) { /* an empty argv counts as one empty argument (abi.arg_area) */
        area[n++] = 0;
    }
    for (Py_ssize_t i = 0; i < argc; i++) {
        PyObject *a = PyList_GET_ITEM(argv, i);
        size_t len = (size_t)PyBytes_GET_SIZE(a);
        if (len + 1 > EXEC_ARGS_MAX - n) return -1;
        memcpy(area + n, PyBytes_AS_STRING(a), len);
        n += len;
        area[n++] = 0;
    }
    pin->dev = ((uint64_t)major(st_dev) << 20) | minor(st_dev); /* abi.kernel_dev */
    pin->ino = st_ino;
    pin->argv_hash = siphash24(key, area, n);
    pin->args_len = (uint32_t)n;
    pin->flags = 0;
    return 0;
}

/* pin(key, st_dev, st_ino, argv) -> the map value (bytes), or None: pin_of, for the tests that hold
 * it equal to exec_check.pin_exec(...).pack(). */
static PyObject *pin(PyObject *self, PyObject *args) {
    Py_buffer key;
    unsigned long long dev, ino;
    PyObject *argv;
    if (!PyArg_ParseTuple(args, "y*KKO!", &key, &dev, &ino, &PyList_Type, &argv)) return NULL;
    Pin p;
    int ok = key.len == 16;
    for (Py_ssize_t i = 0; ok && i < PyList_GET_SIZE(argv); i++) ok = PyBytes_Check(PyList_GET_ITEM(argv, i));
    if (!ok) {
        PyBuffer_Release(&key);
        PyErr_SetString(PyExc_ValueError, "a 16-byte key and a list of bytes");
        return NULL;
    }
    int got = pin_of(key.buf, dev, ino, argv, &p);
    PyBuffer_Release(&key);
    if (got < 0) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)&p, sizeof p);
}

/* ---- The usual exec the rules simply allow, answered in C (exec_supervisor.ExecSupervisor.serve) */

#define NR_EXECVE 59

/* next_usual(listener, stop, pins_fd, key, outright, root_dev, root_ino, root_mnt, heads, heads_max):
 * next_notification's wait and read, then what ExecSupervisor.answer does for the usual exec that
 * `_allowed_outright` allows, when this one surely is: an execve that read_usual reads (else
 * None for it), of a file with no `#!` line, whose name (read_usual's `named`) is in `outright`
 * (a set of the names the supervisor's rules allow whatever the argv and the depth, never the
 * loader's: ExecSupervisor._outright) and leads here to the same file (stat, as
 * exec_resolve.identity), its argv pinnable; pinned and let go on as `allow` does.
 * Returns None (stopped, or every process of the filter is gone: as next_notification); an int
 * when it answered: the round trip in ns (read to response sent), or -1 when there was nothing to
 * answer any more or the caller went away meanwhile (allow's 1 and 2); else (id, pid, nr, args,
 * received ns, usual or None, status) for the Python path: status 0, decide it (`usual`: read
 * already); 1, read it again (its read failed here: out of memory, say) and decide it; -errno, the
 * rules allow it but its pin was not held: refuse it. OSError as
 * next_notification's and allow's. */
static PyObject *next_usual(PyObject *self, PyObject *args) {
    int listener, stop, pins_fd;
    Py_buffer key;
    PyObject *outright;
    Ours ours;
    if (!PyArg_ParseTuple(args, "iiiy*O!KKLO!n", &listener, &stop, &pins_fd, &key, &PySet_Type, &outright,
                          &ours.dev, &ours.ino, &ours.mnt, &PyDict_Type, &ours.heads, &ours.heads_max))
        return NULL;
    PyObject *usual = NULL, *result = NULL;
    long status = 0;
    struct seccomp_notif n;
    long long received;
    if (key.len != 16) {
        PyErr_SetString(PyExc_ValueError, "the check key is 16 bytes");
        goto done;
    }
    int got = wait_notification(listener, stop, &n, &received);
    if (got < 0) goto done;
    if (got == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (n.data.nr != NR_EXECVE) { /* exec_resolve.read_usual's None */
        usual = Py_NewRef(Py_None);
        goto python;
    }
    usual = usual_of((int)n.pid, n.data.args[0], n.data.args[1], &ours);
    if (!usual) { /* the notification is still Python's to answer: it reads the request again */
        PyErr_Clear();
        usual = Py_NewRef(Py_None);
        status = 1;
        goto python;
    }
    if (usual == Py_None) goto python;
    PyObject *argv = PyTuple_GET_ITEM(usual, 1), *named = PyTuple_GET_ITEM(usual, 2);
    PyObject *head = PyTuple_GET_ITEM(usual, 5);
    unsigned long long dev = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(usual, 3));
    unsigned long long ino = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(usual, 4));
    if (PyErr_Occurred()) { /* cannot be (read_usual made them): the notification is Python's */
        PyErr_Clear();
        goto python;
    }
    if (PyBytes_GET_SIZE(head) >= 2 && !memcmp(PyBytes_AS_STRING(head), "#!", 2)) goto python;
    int in = PySet_Contains(outright, named);
    if (in <= 0) { /* -1 cannot be (a bytes object hashes): Python's then */
        PyErr_Clear();
        goto python;
    }
    struct stat here;
    if (stat(PyBytes_AS_STRING(named), &here) < 0 || (unsigned long long)here.st_dev != dev ||
        (unsigned long long)here.st_ino != ino)
        goto python; /* `foreign`, or nothing: the Python path says which */
    Pin p;
    if (pin_of(key.buf, dev, ino, argv, &p) < 0) goto python;
    uint32_t tid = n.pid;
    long long sent;
    status = pin_and_continue(listener, n.id, pins_fd, &tid, &p, &sent);
    if (status == -EXCEPTION_) goto done;
    if (status < 0) goto python; /* the pin not held: refused there */
    result = PyLong_FromLongLong(status == 0 ? sent - received : -1);
    goto done;
python:;
    PyObject *note = note_tuple(&n, received);
    if (note) {
        result = Py_BuildValue("(OOl)", note, usual, status);
        Py_DECREF(note);
    }
done:
    PyBuffer_Release(&key);
    Py_XDECREF(usual);
    return result;
}

static PyMethodDef methods[] = {
    {"read_usual", read_usual, METH_VARARGS,
     "The usual exec request read and resolved (exec_resolve.read_request's), or None."},
    {"next_notification", next_notification, METH_VARARGS,
     "(listener, stop): the next notification (id, pid, nr, args, monotonic ns), or None: stopped or gone."},
    {"next_usual", next_usual, METH_VARARGS,
     "next_notification, the usual exec the rules allow answered at once: None, an int, or what Python decides."},
    {"pin", pin, METH_VARARGS, "(key, st_dev, st_ino, argv): exec_check.pin_exec's map value, or None."},
    {"allow", allow, METH_VARARGS,
     "(listener, id, pins_fd, key, value): pin and go on while pending: (status, sent ns)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_exec", NULL, -1, methods};

PyMODINIT_FUNC PyInit__exec(void) { return PyModule_Create(&module); }
