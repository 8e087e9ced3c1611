// Benchmark workloads for bench/bench.py. Each prints one line on stdout: its own loop time in ns
// (so the in-loop ratios compare the work itself, not the recorder's start-up) and the
// CLOCK_REALTIME ns at which all its work was done (its children waited for), from which bench
// takes the tail: how long `evidence run` still ran after the command's work ended.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

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

int main(int argc, char **argv) {
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
        fprintf(stderr, "usage: %s open|exec|connect|distinct N [PATH...] | run CMD [ARGS...]\n", argv[0]);
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
