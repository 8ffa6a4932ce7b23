/*
 * sandlot-limit: run a helper program on a sandbox's behalf (ripgrep), bounded in time
 * and tied to the server that reads its output.
 *
 *   sandlot-limit [--ids UID:GID] MILLISECONDS PROGRAM [ARG...]
 *
 * Forks PROGRAM (an absolute path) with the same stdio and waits for it. PROGRAM is
 * killed (SIGKILL), and this process exits, when the first of these happens:
 *   - MILLISECONDS have passed (exit status 124, as timeout(1));
 *   - nobody can read its output any more: the read end of the pipe on fd 1 is closed,
 *     because the server died or gave up on the request (poll reports POLLERR on the
 *     write end; exit status 141, as SIGPIPE);
 *   - this process's parent dies (PR_SET_PDEATHSIG; the parent is the server when the
 *     runtime is a plain process, the sandbox's init otherwise).
 * None of these needs the server to be alive. PROGRAM itself dies with this process
 * (PR_SET_PDEATHSIG) and, as a last resort, by SIGALRM a second after the deadline.
 * Otherwise the exit status is PROGRAM's (128 + the signal number if a signal ended it).
 *
 * --ids: drop to UID:GID (no supplementary groups) first; for a server that runs as root
 * and acts as another user without a sandbox around the program.
 *
 * Statically linked (it runs in any rootfs image). Build: cc -O2 -static.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int usage(void) {
    fputs("usage: sandlot-limit [--ids UID:GID] MILLISECONDS PROGRAM [ARG...]\n", stderr);
    return 2;
}

static int status_of(int raw) {
    if (WIFEXITED(raw)) return WEXITSTATUS(raw);
    if (WIFSIGNALED(raw)) return 128 + WTERMSIG(raw);
    return 1;
}

static int stop(pid_t pid, int code) {
    int raw;
    kill(pid, SIGKILL);
    while (waitpid(pid, &raw, 0) < 0 && errno == EINTR) {
    }
    return code;
}

int main(int argc, char **argv) {
    int i = 1;
    if (i + 1 < argc && strcmp(argv[i], "--ids") == 0) {
        char *end;
        unsigned long uid = strtoul(argv[i + 1], &end, 10);
        if (*end != ':') return usage();
        unsigned long gid = strtoul(end + 1, &end, 10);
        if (*end != '\0') return usage();
        if (setgroups(0, NULL) != 0 || setgid((gid_t)gid) != 0 || setuid((uid_t)uid) != 0 ||
            getuid() != (uid_t)uid || getgid() != (gid_t)gid) {
            perror("sandlot-limit: cannot switch user");
            return 126;
        }
        i += 2;
    }
    if (argc - i < 2) return usage();
    char *end;
    long long ms = strtoll(argv[i], &end, 10);
    if (*end != '\0' || ms <= 0) return usage();
    char **program = argv + i + 1;

    /* Whatever the starter blocked or ignored (an init blocks SIGCHLD, a server
     * ignores SIGPIPE), the program gets the defaults. */
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    int reset[] = {SIGPIPE, SIGALRM, SIGTERM, SIGINT, SIGHUP, SIGCHLD, SIGXCPU};
    for (size_t k = 0; k < sizeof reset / sizeof reset[0]; k++) signal(reset[k], SIG_DFL);

    prctl(PR_SET_PDEATHSIG, SIGKILL);
    long long deadline = now_ms() + ms;
    pid_t self = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        perror("sandlot-limit: fork");
        return 126;
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != self) _exit(137); /* the watcher is gone already */
        alarm((unsigned)(ms / 1000 + 2));
        execv(program[0], program);
        fprintf(stderr, "sandlot-limit: %s: %s\n", program[0], strerror(errno));
        _exit(errno == ENOENT ? 127 : 126);
    }

    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    struct pollfd fds[2] = {{.fd = pidfd, .events = POLLIN}, {.fd = 1, .events = 0}};
    for (;;) {
        int raw;
        pid_t got = waitpid(pid, &raw, WNOHANG);
        if (got == pid) return status_of(raw);
        long long left = deadline - now_ms();
        if (left <= 0) return stop(pid, 124);
        /* Without a pidfd (a kernel before 5.3), look again every 50 ms. */
        int wait_ms = pidfd < 0 && left > 50 ? 50 : (int)(left > 60000 ? 60000 : left);
        int n = poll(pidfd < 0 ? fds + 1 : fds, pidfd < 0 ? 1 : 2, wait_ms);
        if (n < 0 && errno != EINTR) return stop(pid, 126);
        if (fds[1].revents & POLLERR) return stop(pid, 141);
        if (fds[1].revents & POLLNVAL) fds[1].fd = -1; /* no stdout: nothing to watch */
    }
}
