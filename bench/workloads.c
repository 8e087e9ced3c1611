// Benchmark workloads for bench/bench.py. Each prints one line on stdout: its own loop time in ns
// (so the in-loop ratios compare the work itself, not the recorder's start-up) and the
// CLOCK_REALTIME ns at which all its work was done (its children waited for), from which bench
// takes the tail: how long `evidence run` still ran after the command's work ended.
#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <netinet/in.h>
#include <poll.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SECCOMP_IOCTL_NOTIF_SET_FLAGS
#define SECCOMP_IOCTL_NOTIF_SET_FLAGS SECCOMP_IOW(4, __u64)
#define SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP 1
#endif

static long long clock_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static long long now_ns(void) { return clock_ns(CLOCK_MONOTONIC); }

static void done(long long t0) {
    long long loop = now_ns() - t0;
    printf("%lld %lld\n", loop, clock_ns(CLOCK_REALTIME));
}

static int send_fd(int sock, int fd) {
    char c = 0, buf[CMSG_SPACE(sizeof(int))];
    struct iovec io = {&c, 1};
    struct msghdr m = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = buf, .msg_controllen = sizeof buf};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    return sendmsg(sock, &m, 0) < 0 ? -1 : 0;
}

static int recv_fd(int sock) {
    char c, buf[CMSG_SPACE(sizeof(int))];
    struct iovec io = {&c, 1};
    struct msghdr m = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = buf, .msg_controllen = sizeof buf};
    if (recvmsg(sock, &m, 0) <= 0 || !CMSG_FIRSTHDR(&m)) return -1;
    int fd;
    memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&m)), sizeof(int));
    return fd;
}

// notify WORK_US CMD [ARGS...]: CMD under the least exec supervisor there is, the floor of what
// command rules cost on this machine: execve and execveat go to a seccomp user-notification
// listener, as `evidence run`'s launcher sends them (the same wake-up flag its supervisor sets),
// and this process answers each "go on" after WORK_US microseconds of busy work (0: at once; the
// supervisor's measured round trip: what that much work costs the job here, wake-ups included).
static int notify(long work_us, char **cmd) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) return 125;
    pid_t job = fork();
    if (job == 0) {
        struct sock_filter f[] = {
            BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
            BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_execve, 1, 0),
            BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_execveat, 0, 1),
            BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_USER_NOTIF),
            BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        };
        struct sock_fprog prog = {sizeof f / sizeof f[0], f};
        char c;
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) _exit(125);
        int l = (int)syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, &prog);
        if (l < 0 || send_fd(sv[1], l) < 0) _exit(125);
        close(l);
        if (read(sv[1], &c, 1) != 1) _exit(125); // the supervisor is ready
        execvp(cmd[0], cmd);
        _exit(127);
    }
    int l = job > 0 ? recv_fd(sv[0]) : -1;
    if (l < 0) return 125;
    ioctl(l, SECCOMP_IOCTL_NOTIF_SET_FLAGS, SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP);
    if (write(sv[0], "g", 1) != 1) return 125;
    for (;;) {
        struct pollfd p = {l, POLLIN, 0};
        if (poll(&p, 1, -1) < 0) continue;
        if (!(p.revents & POLLIN)) break; // every process under the filter is gone
        struct seccomp_notif n;
        memset(&n, 0, sizeof n);
        if (ioctl(l, SECCOMP_IOCTL_NOTIF_RECV, &n) < 0) continue;
        for (long long end = now_ns() + work_us * 1000; now_ns() < end;)
            ;
        struct seccomp_notif_resp r = {.id = n.id, .flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE};
        ioctl(l, SECCOMP_IOCTL_NOTIF_SEND, &r);
    }
    int st = 0;
    if (waitpid(job, &st, 0) < 0) return 125;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

// rss FILE CMD [ARGS...]: CMD's peak RSS in KiB (ru_maxrss: it and the descendants it waited for)
// written to FILE, its exit status passed on. CMD is forked from this small process, not spawned
// by bench.py: a process starts with the high-water mark of the memory it was started from (exec
// counts the old memory's), and Python spawns with vfork, so bench.py's child would report at
// least bench.py's own peak (~40 MB for a loop of opens that needs 1).
static int rss(const char *file, char **cmd) {
    pid_t p = fork();
    if (p == 0) {
        execvp(cmd[0], cmd);
        perror(cmd[0]);
        _exit(127);
    }
    int st = 0;
    struct rusage ru;
    if (p < 0 || wait4(p, &st, 0, &ru) < 0) return 125;
    FILE *f = fopen(file, "w");
    if (!f || fprintf(f, "%ld\n", ru.ru_maxrss) < 0 || fclose(f) != 0) return 125;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

int main(int argc, char **argv) {
    if (argc >= 4 && !strcmp(argv[1], "notify")) return notify(atol(argv[2]), argv + 3);
    if (argc >= 4 && !strcmp(argv[1], "rss")) return rss(argv[2], argv + 3);
    if (argc >= 3 && !strcmp(argv[1], "run")) {
        // run CMD [ARGS...]: the command's own wall, its exit status passed on
        long long t0 = now_ns();
        pid_t p = fork();
        if (p == 0) {
            execvp(argv[2], argv + 2);
            perror(argv[2]);
            _exit(127);
        }
        int st = 0;
        if (p < 0 || waitpid(p, &st, 0) < 0)
            return 125;
        fflush(stdout);  // the command's output (same stdout) comes first
        done(t0);
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    if (argc < 3) {
        fprintf(stderr, "usage: %s open|exec|connect|distinct N [PATH...] | run CMD [ARGS...] | notify WORK_US CMD [ARGS...] | rss FILE CMD [ARGS...]\n", argv[0]);
        return 2;
    }
    long n = atol(argv[2]);
    long long t0 = now_ns();
    if (!strcmp(argv[1], "open")) {
        // N opens cycling over the PATHs given (default: /etc/hostname)
        char *dflt[] = {"/etc/hostname"};
        char **paths = argc > 3 ? argv + 3 : dflt;
        int np = argc > 3 ? argc - 3 : 1;
        for (long i = 0; i < n; i++) {
            int fd = open(paths[i % np], O_RDONLY);
            if (fd >= 0)
                close(fd);
        }
    } else if (!strcmp(argv[1], "distinct")) {
        // 2 processes x N opens of distinct paths (none exists: ENOENT), side by side
        for (int k = 0; k < 2; k++) {
            if (fork() == 0) {
                char path[64];
                for (long i = 0; i < n; i++) {
                    snprintf(path, sizeof(path), "/nonexistent/p%d/%ld", k, i);
                    int fd = open(path, O_RDONLY);
                    if (fd >= 0)
                        close(fd);
                }
                _exit(0);
            }
        }
        int st;
        while (wait(&st) > 0)
            ;
    } else if (!strcmp(argv[1], "exec")) {
        for (long i = 0; i < n; i++) {
            pid_t p = fork();
            if (p == 0) {
                char *args[] = {"/bin/true", "bench-arg", NULL};
                execv("/bin/true", args);
                _exit(127);
            }
            int st;
            waitpid(p, &st, 0);
        }
    } else if (!strcmp(argv[1], "connect")) {
        int srv = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        int one = 1;
        setsockopt(srv, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        bind(srv, (struct sockaddr *)&a, sizeof(a));
        listen(srv, 128);
        socklen_t len = sizeof(a);
        getsockname(srv, (struct sockaddr *)&a, &len);
        t0 = now_ns();
        for (long i = 0; i < n; i++) {
            int c = socket(AF_INET, SOCK_STREAM, 0);
            if (connect(c, (struct sockaddr *)&a, sizeof(a)) == 0) {
                int s = accept(srv, NULL, NULL);
                if (s >= 0)
                    close(s);
            }
            close(c);
        }
    } else {
        fprintf(stderr, "%s: unknown mode %s\n", argv[0], argv[1]);
        return 2;
    }
    done(t0);
    return 0;
}
