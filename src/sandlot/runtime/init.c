/*
 * sandlot-init: the one process that runs per sandbox, plus its host-side helpers.
 *
 *   sandlot-init init LISTEN_FD READY_FD
 *       pid 1 of the sandbox (bwrap --as-pid-1). Accepts SOCK_SEQPACKET
 *       connections from the server on LISTEN_FD, forks the requested commands
 *       (they inherit namespaces, cgroup, seccomp filter and the dropped
 *       capabilities), reports their pid and exit status, reaps every zombie.
 *   sandlot-init launch UID GID BWRAP ARGS_FD NKEEP FD... NPROCS PROCS_PATH...
 *                       NSTAGE (SRC NAME)... COMMAND...
 *       run on the host by the server: joins the sandbox cgroups, forks, and
 *       the child drops to UID/GID and execs bwrap with an empty environment,
 *       its options on ARGS_FD and COMMAND (bwrap does not read it from ARGS_FD).
 *       When run as root, each SRC is first bound at STAGE_DIR/NAME in a private
 *       mount namespace of the launcher: bwrap, running as UID, resolves its
 *       sources by path, and the server's data directory may not be
 *       traversable by UID (a 0700 home, say). The parent exits once bwrap is exec'd, so
 *       bwrap is nobody's child in the server and survives a server crash.
 *   sandlot-init seccomp
 *       writes the sandbox's seccomp filter (classic BPF) to stdout.
 *
 * Wire format (native byte order, one request per connection):
 *   request:  struct request + payload "cwd\0argv...\0env...\0" + record, split
 *             in messages of at most CHUNK bytes; pipe mode carries stdin, stdout,
 *             stderr fds as SCM_RIGHTS on the first message, then NHOLD more.
 *             SIGNAL and RELEASE requests may follow on the same connection.
 *   response: struct response; STARTED carries the pty master in PTY mode,
 *             then EXIT (raw wait status) when the process ends.
 *
 * Kept processes (a non-zero tag) outlive the server that started them: the
 * init keeps the record the server gave (its own bookkeeping, opaque here),
 * the NHOLD fds (the server's ends of the stdio pipes, so that neither the
 * command nor its unread output dies with the server) and, once it exits,
 * its wait status. A restarted server LISTs them (one JOB response each,
 * tag and record after the header, then END), ADOPTs each by tag on a new
 * connection (STARTED with the held fds, then EXIT as above, at once if it
 * has exited meanwhile), RELEASEs held fds it no longer needs (signo: the
 * index, -1 for all; on its own connection, with the tag) and FORGETs a
 * process once it has no more use for it.
 * RECORD replaces a kept process's record (the header, then the record).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/sched.h>
#include <poll.h>
#include <seccomp.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#define MAGIC 0x32544c53u /* "SLT2" */
#define REQ_SPAWN 1u
#define REQ_SIGNAL 2u
#define REQ_LIST 3u
#define REQ_ADOPT 4u
#define REQ_RELEASE 5u
#define REQ_FORGET 6u
#define REQ_RECORD 7u
#define FLAG_PTY 1u
#define RESP_STARTED 1u
#define RESP_ERROR 2u
#define RESP_EXIT 3u
#define RESP_JOB 4u
#define RESP_END 5u
#define MAX_HELD 6
#define MAX_RECORD 16384u
#define MAX_JOBS 4096
#define CHUNK 32768
#define MAX_PAYLOAD (8u << 20)
#define STAGE_DIR "/tmp"

struct request {
    uint32_t magic, type, flags;
    uint16_t cols, rows;
    int32_t signo;
    uint32_t nargv, nenv, len;
    uint64_t tag;
    uint32_t record_len, nhold;
};

struct response {
    uint32_t type;
    int32_t pid, err, status;
};

/* ------------------------------------------------------------------ seccomp */

static int add_errno(scmp_filter_ctx ctx, int err, const char *name) {
    int nr = seccomp_syscall_resolve_name(name);
    if (nr == __NR_SCMP_ERROR) return 0; /* not on this architecture */
    return seccomp_rule_add(ctx, SCMP_ACT_ERRNO(err), nr, 0);
}

static int build_filter(scmp_filter_ctx *out) {
    /* Denied outright with EPERM: debugging other processes, mounting,
     * namespaces, kernel keyrings, BPF, perf, kernel images and modules,
     * file handles (bypass path checks), userfaultfd and io_uring (kernel
     * attack surface that has carried many local privilege escalations). */
    static const char *const eperm[] = {
        "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
        "mount", "umount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree",
        "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
        "unshare", "setns",
        "bpf", "keyctl", "add_key", "request_key", "perf_event_open",
        "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
        "open_by_handle_at", "name_to_handle_at", "userfaultfd",
        "io_uring_setup", "io_uring_enter", "io_uring_register",
        "swapon", "swapoff", "reboot", "acct", "quotactl", "syslog", "lookup_dcookie",
        "uselib", "personality", "vhangup",
        NULL,
    };
    /* Namespace flags of clone(); clone3 passes them in memory the filter cannot
     * read, so it reports ENOSYS and libc falls back to clone. */
    static const uint64_t ns_flags[] = {
        CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET,
        CLONE_NEWIPC, CLONE_NEWUTS, CLONE_NEWCGROUP,
    };
    scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);
    if (!ctx) return -ENOMEM;
    int rc = seccomp_attr_set(ctx, SCMP_FLTATR_ACT_BADARCH, SCMP_ACT_KILL_PROCESS);
    for (int i = 0; rc == 0 && eperm[i]; i++) rc = add_errno(ctx, EPERM, eperm[i]);
    for (size_t i = 0; rc == 0 && i < sizeof ns_flags / sizeof ns_flags[0]; i++)
        rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(clone), 1,
                              SCMP_A0(SCMP_CMP_MASKED_EQ, ns_flags[i], ns_flags[i]));
    if (rc == 0) rc = add_errno(ctx, ENOSYS, "clone3");
    /* The kernel compares ioctl numbers as 32-bit values: compare the low 32
     * bits only, or 0x100005412 would slip past an equality rule. */
    if (rc == 0)
        rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(ioctl), 1,
                              SCMP_A1(SCMP_CMP_MASKED_EQ, 0xffffffffu, TIOCSTI));
    if (rc == 0)
        rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(ioctl), 1,
                              SCMP_A1(SCMP_CMP_MASKED_EQ, 0xffffffffu, TIOCLINUX));
    if (rc != 0) {
        seccomp_release(ctx);
        return rc;
    }
    *out = ctx;
    return 0;
}

static int cmd_seccomp(void) {
    scmp_filter_ctx ctx;
    int rc = build_filter(&ctx);
    if (rc == 0) rc = seccomp_export_bpf(ctx, STDOUT_FILENO);
    if (rc != 0) {
        fprintf(stderr, "sandlot-init: building the seccomp filter failed: %s\n", strerror(-rc));
        return 1;
    }
    seccomp_release(ctx);
    return 0;
}

/* ------------------------------------------------------------------- launch */

static int keep_only(const int *keep, int nkeep) {
    /* Close every fd above 2 that is not in keep (keep is small; fds are few). */
    int sorted[64], n = 0;
    for (int i = 0; i < nkeep && n < 64; i++) sorted[n++] = keep[i];
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && sorted[j - 1] > sorted[j]; j--) {
            int t = sorted[j];
            sorted[j] = sorted[j - 1];
            sorted[j - 1] = t;
        }
    unsigned int lo = 3;
    for (int i = 0; i < n; i++) {
        if (sorted[i] < (int)lo) continue;
        if ((unsigned int)sorted[i] > lo && syscall(SYS_close_range, lo, sorted[i] - 1, 0) != 0)
            return -1;
        lo = (unsigned int)sorted[i] + 1;
    }
    return (int)syscall(SYS_close_range, lo, ~0u, 0);
}

/* Bind each source under a fresh tmpfs at STAGE_DIR, in a mount namespace of our own
 * (private: nothing propagates to the host; it vanishes with bwrap's setup). */
static int stage(char **pairs, int n) {
    int fds[64];
    if (n > 64) return E2BIG;
    if (unshare(CLONE_NEWNS) != 0) return errno;
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) return errno;
    /* Opened in the new namespace (a bind needs its source there) and before the
     * tmpfs goes over STAGE_DIR (sources may live under it). */
    for (int i = 0; i < n; i++) {
        fds[i] = open(pairs[2 * i], O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (fds[i] < 0) {
            int err = errno;
            fprintf(stderr, "sandlot-init launch: staging %s: %s\n", pairs[2 * i], strerror(err));
            return err;
        }
    }
    if (mount("sandlot-stage", STAGE_DIR, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0711") != 0)
        return errno;
    char dest[PATH_MAX], src[64];
    for (int i = 0; i < n; i++) {
        const char *name = pairs[2 * i + 1];
        if (strchr(name, '/') || snprintf(dest, sizeof dest, STAGE_DIR "/%s", name) >= PATH_MAX)
            return EINVAL;
        snprintf(src, sizeof src, "/proc/self/fd/%d", fds[i]);
        if (mkdir(dest, 0711) != 0 || mount(src, dest, NULL, MS_BIND | MS_REC, NULL) != 0) {
            int err = errno;
            fprintf(stderr, "sandlot-init launch: staging %s: %s\n", pairs[2 * i], strerror(err));
            return err;
        }
        close(fds[i]);
    }
    return 0;
}

static int cmd_launch(int argc, char **argv) {
    if (argc < 8) {
        fprintf(stderr, "usage: sandlot-init launch UID GID BWRAP ARGS_FD NKEEP FD... NPROCS "
                        "PROCS... COMMAND...\n");
        return 2;
    }
    uid_t uid = (uid_t)strtoul(argv[2], NULL, 10);
    gid_t gid = (gid_t)strtoul(argv[3], NULL, 10);
    const char *bwrap = argv[4];
    const char *args_fd = argv[5];
    int nkeep = atoi(argv[6]);
    if (nkeep < 0 || nkeep > 60 || 8 + nkeep > argc) {
        fprintf(stderr, "sandlot-init launch: bad fd count\n");
        return 2;
    }
    int nprocs = atoi(argv[7 + nkeep]);
    int first_procs = 8 + nkeep, nstage_at = first_procs + nprocs;
    if (nprocs < 0 || nstage_at >= argc) {
        fprintf(stderr, "sandlot-init launch: bad cgroup count\n");
        return 2;
    }
    int nstage = atoi(argv[nstage_at]);
    int first_stage = nstage_at + 1, command = first_stage + 2 * nstage;
    if (nstage < 0 || command >= argc) {
        fprintf(stderr, "sandlot-init launch: bad stage count or no command\n");
        return 2;
    }
    int keep[64];
    keep[0] = atoi(args_fd);
    for (int i = 0; i < nkeep; i++) keep[i + 1] = atoi(argv[7 + i]);

    char pid[32];
    int len = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
    for (int i = first_procs; i < nstage_at; i++) {
        int fd = open(argv[i], O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, pid, (size_t)len) != len) {
            fprintf(stderr, "sandlot-init launch: joining cgroup %s: %s\n", argv[i], strerror(errno));
            return 3;
        }
        close(fd);
    }

    int errpipe[2];
    if (pipe2(errpipe, O_CLOEXEC) != 0) return 4;
    keep[nkeep + 1] = errpipe[1];
    pid_t child = fork();
    if (child < 0) {
        fprintf(stderr, "sandlot-init launch: fork: %s\n", strerror(errno));
        return 4;
    }
    if (child == 0) {
        int err = 0;
        if (geteuid() == 0 && nstage > 0) err = stage(argv + first_stage, nstage);
        if (err) {
            /* reported below */
        } else if (geteuid() == 0) {
            if (uid == 0) err = EPERM; /* never start bwrap as host root */
            else if (setgroups(0, NULL) != 0 || setresgid(gid, gid, gid) != 0 ||
                     setresuid(uid, uid, uid) != 0)
                err = errno;
        } else if (uid != geteuid()) {
            err = EPERM;
        }
        if (!err && keep_only(keep, nkeep + 2) != 0) err = errno;
        if (!err) {
            int n = argc - command;
            char **bargv = calloc((size_t)n + 5, sizeof *bargv);
            char *const envp[] = {NULL};
            if (bargv) {
                bargv[0] = "bwrap";
                bargv[1] = "--args";
                bargv[2] = (char *)args_fd;
                bargv[3] = "--";
                memcpy(bargv + 4, argv + command, (size_t)n * sizeof *bargv);
                execve(bwrap, bargv, envp);
            }
            err = errno;
        }
        ssize_t w = write(errpipe[1], &err, sizeof err);
        (void)w;
        _exit(127);
    }
    close(errpipe[1]);
    int err = 0;
    ssize_t n;
    do n = read(errpipe[0], &err, sizeof err);
    while (n < 0 && errno == EINTR);
    if (n > 0) {
        fprintf(stderr, "sandlot-init launch: starting %s as uid %u: %s\n", bwrap, (unsigned)uid,
                strerror(err));
        waitpid(child, NULL, 0);
        return 5;
    }
    return 0;
}

/* --------------------------------------------------------------------- init */

struct conn {
    int fd;           /* -1: free slot */
    pid_t pid;        /* running child, 0 before spawn, -1 after its exit */
    struct request req;
    char *buf;
    uint32_t got;
    int fds[3 + MAX_HELD];
    int nfds;
    int job;          /* index in jobs of the kept process served, or -1 */
};

/* A kept process: see the wire format above. */
struct job {
    uint64_t tag;     /* 0: free slot */
    pid_t pid;
    int exited, status;
    int held[MAX_HELD + 1];
    int nheld;
    char *record;
    uint32_t record_len;
    int conn;         /* slot of the connection serving it, or -1 */
};
static struct job *jobs;
static int njobs;

static struct conn *conns;
static int nconns;
static int epfd;
static char rxbuf[CHUNK + 64];

/* How long one reply waits for room in the connection's buffer (ms): the server reads
 * its replies as they come, and a list of thousands of kept processes is more than the
 * buffer holds at once. */
#define SEND_WAIT_MS 5000

static int send_full(struct conn *c, uint32_t type, int pid, int err, int status,
                     const int *fds, int nfds, const void *extra, size_t extra_len) {
    struct response r = {type, pid, err, status};
    struct iovec iov[2] = {{&r, sizeof r}, {(void *)extra, extra_len}};
    union {
        char buf[CMSG_SPACE((MAX_HELD + 1) * sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = extra_len ? 2 : 1};
    int live[MAX_HELD + 1], n = 0;
    for (int i = 0; i < nfds && n <= MAX_HELD; i++)
        if (fds[i] >= 0) live[n++] = fds[i];
    if (n > 0) {
        memset(&u, 0, sizeof u);
        msg.msg_control = u.buf;
        msg.msg_controllen = CMSG_SPACE((size_t)n * sizeof(int));
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN((size_t)n * sizeof(int));
        memcpy(CMSG_DATA(cm), live, (size_t)n * sizeof(int));
    }
    for (;;) {
        if (sendmsg(c->fd, &msg, MSG_NOSIGNAL) >= 0) return 0;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
        /* The buffer is full: wait for the server to read (a server that does not
         * read for that long loses this reply, and with it this connection). */
        struct pollfd p = {.fd = c->fd, .events = POLLOUT};
        int ready;
        while ((ready = poll(&p, 1, SEND_WAIT_MS)) < 0 && errno == EINTR) {
        }
        if (ready <= 0 || !(p.revents & POLLOUT)) return -1;
    }
}

static int send_response(struct conn *c, uint32_t type, int pid, int err, int status, int fd) {
    return send_full(c, type, pid, err, status, &fd, 1, NULL, 0);
}

static void close_received(struct conn *c) {
    for (int i = 0; i < c->nfds; i++) close(c->fds[i]);
    c->nfds = 0;
}

static void drop_conn(struct conn *c) {
    /* Server gone: a kept process keeps running, and keeps what it was given. */
    if (c->job >= 0 && jobs[c->job].conn == (int)(c - conns)) jobs[c->job].conn = -1;
    epoll_ctl(epfd, EPOLL_CTL_DEL, c->fd, NULL);
    /* Unread requests would make the close a reset that loses our last answer. */
    char sink[64];
    while (recv(c->fd, sink, sizeof sink, MSG_DONTWAIT) > 0) {
    }
    close(c->fd);
    close_received(c);
    free(c->buf);
    memset(c, 0, sizeof *c);
    c->fd = -1;
    c->job = -1;
}

static struct job *grow_jobs(void);

static struct job *find_job(uint64_t tag) {
    for (int i = 0; tag && i < njobs; i++)
        if (jobs[i].tag == tag) return &jobs[i];
    return NULL;
}

static void release_held(struct job *j, int index) {
    for (int i = 0; i < j->nheld; i++)
        if ((index < 0 || i == index) && j->held[i] >= 0) {
            close(j->held[i]);
            j->held[i] = -1;
        }
}

static void forget_job(struct job *j) {
    release_held(j, -1);
    if (j->conn >= 0) conns[j->conn].job = -1;
    free(j->record);
    memset(j, 0, sizeof *j);
}

static struct job *new_job(uint64_t tag) {
    if (find_job(tag)) return NULL; /* a tag names one process */
    struct job *j = NULL;
    for (int i = 0; !j && i < njobs; i++)
        if (jobs[i].tag == 0 && !jobs[i].record) j = &jobs[i];
    if (!j) j = grow_jobs();
    if (j) j->conn = -1;
    return j;
}

static struct job *grow_jobs(void) {
    if (njobs >= MAX_JOBS) return NULL;
    int grown = njobs ? njobs * 2 : 16;
    struct job *more = realloc(jobs, (size_t)grown * sizeof *jobs);
    if (!more) return NULL;
    jobs = more;
    memset(jobs + njobs, 0, (size_t)(grown - njobs) * sizeof *jobs);
    int first = njobs;
    njobs = grown;
    return &jobs[first];
}

static const char *env_lookup(char **envp, const char *name) {
    size_t n = strlen(name);
    for (; *envp; envp++)
        if (strncmp(*envp, name, n) == 0 && (*envp)[n] == '=') return *envp + n + 1;
    return NULL;
}

/* execvpe's search, but with the PATH of the command's own environment. */
static int resolve(const char *file, char **envp, char *out, size_t outlen) {
    if (strchr(file, '/')) {
        if (strlen(file) >= outlen) return ENAMETOOLONG;
        strcpy(out, file);
        return 0;
    }
    const char *path = env_lookup(envp, "PATH");
    if (!path) path = "/usr/local/bin:/usr/bin:/bin";
    int err = ENOENT;
    while (*path) {
        const char *end = strchrnul(path, ':');
        size_t dlen = (size_t)(end - path);
        if (dlen == 0) dlen = 1, path = "."; /* empty entry means the cwd */
        if (dlen + 1 + strlen(file) < outlen) {
            memcpy(out, path, dlen);
            out[dlen] = '/';
            strcpy(out + dlen + 1, file);
            struct stat st;
            if (stat(out, &st) == 0 && S_ISREG(st.st_mode)) {
                if (access(out, X_OK) == 0) return 0;
                err = EACCES;
            }
        }
        path = *end ? end + 1 : end;
    }
    return err;
}

static void do_spawn(struct conn *c) {
    struct request *q = &c->req;
    int pty = (q->flags & FLAG_PTY) != 0;
    int nchild = pty ? 0 : 3;
    char *p = c->buf, *end = c->buf + q->len - q->record_len;
    char *cwd = p;
    struct job *job = NULL;
    if (q->tag) {
        job = new_job(q->tag);
        if (!job) {
            send_response(c, RESP_ERROR, 0, find_job(q->tag) ? EEXIST : EAGAIN, 0, -1);
            drop_conn(c);
            return;
        }
    }
    char **argv = calloc(q->nargv + 1, sizeof *argv);
    char **envp = calloc(q->nenv + 1, sizeof *envp);
    int err = (!argv || !envp) ? ENOMEM : 0;
    p += strnlen(p, (size_t)(end - p)) + 1;
    for (uint32_t i = 0; !err && i < q->nargv + q->nenv; i++) {
        if (p >= end) {
            err = EINVAL;
            break;
        }
        if (i < q->nargv) argv[i] = p;
        else envp[i - q->nargv] = p;
        p += strnlen(p, (size_t)(end - p)) + 1;
    }
    if (!err && (q->nargv == 0 || p > end || end[-1] != '\0')) err = EINVAL;
    if (!err && c->nfds != nchild + (int)q->nhold) err = EINVAL;

    char path[PATH_MAX];
    if (!err) err = resolve(argv[0], envp, path, sizeof path);
    if (!err && job && !(job->record = malloc(q->record_len ? q->record_len : 1))) err = ENOMEM;

    int master = -1;
    char slave[64];
    if (!err && pty) {
        master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
        struct winsize ws = {.ws_row = q->rows, .ws_col = q->cols};
        if (master < 0 || unlockpt(master) != 0 || ptsname_r(master, slave, sizeof slave) != 0 ||
            ioctl(master, TIOCSWINSZ, &ws) != 0)
            err = errno ? errno : EIO;
    }

    pid_t pid = 0;
    if (!err) {
        posix_spawn_file_actions_t fa;
        posix_spawnattr_t at;
        sigset_t none, all;
        sigemptyset(&none);
        sigfillset(&all);
        posix_spawn_file_actions_init(&fa);
        posix_spawnattr_init(&at);
        posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGMASK |
                                          POSIX_SPAWN_SETSIGDEF);
        posix_spawnattr_setsigmask(&at, &none);
        posix_spawnattr_setsigdefault(&at, &all);
        if (pty) {
            /* Opened after setsid without O_NOCTTY: becomes the controlling tty. */
            posix_spawn_file_actions_addopen(&fa, 0, slave, O_RDWR, 0);
            posix_spawn_file_actions_adddup2(&fa, 0, 1);
            posix_spawn_file_actions_adddup2(&fa, 0, 2);
        } else {
            for (int i = 0; i < 3; i++) posix_spawn_file_actions_adddup2(&fa, c->fds[i], i);
        }
        /* Held fds are close-on-exec (received with MSG_CMSG_CLOEXEC): the child gets none. */
        posix_spawn_file_actions_addchdir_np(&fa, cwd);
        err = posix_spawn(&pid, path, &fa, &at, argv, envp);
        posix_spawn_file_actions_destroy(&fa);
        posix_spawnattr_destroy(&at);
    }
    free(argv);
    free(envp);
    if (err) {
        if (job) forget_job(job);
        free(c->buf);
        c->buf = NULL;
        close_received(c);
        send_response(c, RESP_ERROR, 0, err, 0, -1);
        if (master >= 0) close(master);
        drop_conn(c);
        /* The child, if spawned, is reaped as nobody's. */
        return;
    }
    if (job) {
        job->tag = q->tag;
        job->pid = pid;
        memcpy(job->record, end, q->record_len);
        job->record_len = q->record_len;
        for (int i = nchild; i < c->nfds; i++) job->held[job->nheld++] = c->fds[i];
        c->nfds = nchild; /* the held ones are the job's now */
        if (master >= 0) job->held[job->nheld++] = fcntl(master, F_DUPFD_CLOEXEC, 0);
        job->conn = (int)(c - conns);
        c->job = (int)(job - jobs);
    }
    free(c->buf);
    c->buf = NULL;
    close_received(c);
    c->pid = pid;
    send_response(c, RESP_STARTED, pid, 0, 0, master);
    if (master >= 0) close(master);
}

static void do_list(struct conn *c) {
    for (int i = 0; i < njobs; i++) {
        struct job *j = &jobs[i];
        if (!j->tag) continue;
        char head[8 + MAX_RECORD];
        memcpy(head, &j->tag, 8);
        memcpy(head + 8, j->record, j->record_len);
        /* A list cut short must not end as a whole one: its end is not sent (the
         * caller closes the connection). */
        if (send_full(c, RESP_JOB, j->pid, j->exited, j->status, NULL, 0, head,
                      8 + j->record_len) != 0)
            return;
    }
    send_response(c, RESP_END, 0, 0, 0, -1);
}

static void do_adopt(struct conn *c, uint64_t tag) {
    struct job *j = find_job(tag);
    if (!j) {
        send_response(c, RESP_ERROR, 0, ESRCH, 0, -1);
        drop_conn(c);
        return;
    }
    if (j->conn >= 0 && j->conn != (int)(c - conns)) drop_conn(&conns[j->conn]);
    j->conn = (int)(c - conns);
    c->job = (int)(j - jobs);
    c->pid = j->exited ? -1 : j->pid;
    int present = 0; /* which held fds come, in order: the server maps them by index */
    for (int i = 0; i < j->nheld; i++)
        if (j->held[i] >= 0) present |= 1 << i;
    send_full(c, RESP_STARTED, j->pid, present, 0, j->held, j->nheld, NULL, 0);
    if (j->exited) send_response(c, RESP_EXIT, j->pid, 0, j->status, -1);
}

static void on_message(struct conn *c) {
    union {
        char buf[CMSG_SPACE((3 + MAX_HELD) * sizeof(int))];
        struct cmsghdr align;
    } u;
    struct iovec iov = {rxbuf, sizeof rxbuf};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                         .msg_controllen = sizeof u.buf};
    ssize_t n = recvmsg(c->fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (n < 0) {
        /* A failed recvmsg leaves msg_controllen as it was: the buffer holds stale fds
         * (of an earlier message, now held for a kept process) that are not ours to close. */
        drop_conn(c);
        return;
    }
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
        int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        int *fds = (int *)CMSG_DATA(cm);
        for (int i = 0; i < k; i++) {
            if (c->nfds < 3 + MAX_HELD && c->pid == 0) c->fds[c->nfds++] = fds[i];
            else close(fds[i]);
        }
    }
    if (n <= 0 || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        /* Server gone: the process keeps running, as a detached job would. */
        drop_conn(c);
        return;
    }
    if (c->buf == NULL && c->pid == 0 && c->got == 0) {
        struct request *q = (struct request *)rxbuf;
        if ((size_t)n < sizeof *q || q->magic != MAGIC) {
            drop_conn(c);
            return;
        }
        if (q->type == REQ_SIGNAL) return; /* nothing started yet */
        if (q->type == REQ_LIST) {
            do_list(c);
            drop_conn(c);
            return;
        }
        if (q->type == REQ_ADOPT) {
            do_adopt(c, q->tag);
            return;
        }
        if (q->type == REQ_RECORD) {
            struct job *j = find_job(q->tag);
            uint32_t len = q->record_len;
            char *copy = NULL;
            if (j && len <= MAX_RECORD && (size_t)n == sizeof *q + len &&
                (copy = malloc(len ? len : 1))) {
                memcpy(copy, rxbuf + sizeof *q, len);
                free(j->record);
                j->record = copy;
                j->record_len = len;
            }
            send_response(c, copy ? RESP_END : RESP_ERROR, 0, copy ? 0 : ESRCH, 0, -1);
            drop_conn(c);
            return;
        }
        if (q->type == REQ_RELEASE && q->tag) {
            struct job *j = find_job(q->tag);
            if (j) release_held(j, q->signo);
            send_response(c, RESP_END, 0, 0, 0, -1);
            drop_conn(c);
            return;
        }
        if (q->type == REQ_FORGET) {
            struct job *j = find_job(q->tag);
            if (j) forget_job(j);
            send_response(c, RESP_END, 0, 0, 0, -1);
            drop_conn(c);
            return;
        }
        if (q->type != REQ_SPAWN || q->len == 0 || q->len > MAX_PAYLOAD ||
            q->record_len > MAX_RECORD || q->record_len >= q->len || q->nhold > MAX_HELD) {
            send_response(c, RESP_ERROR, 0, EINVAL, 0, -1);
            drop_conn(c);
            return;
        }
        c->req = *q;
        c->buf = malloc(q->len);
        if (!c->buf) {
            send_response(c, RESP_ERROR, 0, ENOMEM, 0, -1);
            drop_conn(c);
            return;
        }
        n -= (ssize_t)sizeof *q;
        memmove(rxbuf, rxbuf + sizeof *q, (size_t)n);
    } else if (c->buf == NULL) {
        struct request *q = (struct request *)rxbuf;
        if ((size_t)n >= sizeof *q && q->magic == MAGIC && q->type == REQ_SIGNAL && c->pid > 0) {
            if (kill(-c->pid, q->signo) != 0) kill(c->pid, q->signo);
        }
        if ((size_t)n >= sizeof *q && q->magic == MAGIC && q->type == REQ_RELEASE && c->job >= 0)
            release_held(&jobs[c->job], q->signo);
        return;
    }
    if ((uint64_t)c->got + (uint64_t)n > c->req.len) {
        send_response(c, RESP_ERROR, 0, EINVAL, 0, -1);
        drop_conn(c);
        return;
    }
    memcpy(c->buf + c->got, rxbuf, (size_t)n);
    c->got += (uint32_t)n;
    if (c->got == c->req.len) do_spawn(c);
}

static void reap(void) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int i = 0; i < njobs; i++) {
            if (jobs[i].tag && jobs[i].pid == pid && !jobs[i].exited) {
                jobs[i].exited = 1;
                jobs[i].status = status;
            }
        }
        for (int i = 0; i < nconns; i++) {
            struct conn *c = &conns[i];
            if (c->fd >= 0 && c->pid == pid) {
                send_response(c, RESP_EXIT, pid, 0, status, -1);
                /* A socket closed with requests unread resets the connection, and the
                 * server would lose this answer: a kept process's server closes first. */
                if (c->job >= 0) c->pid = -1;
                else drop_conn(c);
                break;
            }
        }
    }
}

static int add_conn(int fd) {
    int slot = -1;
    for (int i = 0; i < nconns; i++)
        if (conns[i].fd < 0) {
            slot = i;
            break;
        }
    if (slot < 0) {
        int grown = nconns ? nconns * 2 : 16;
        struct conn *more = realloc(conns, (size_t)grown * sizeof *conns);
        if (!more) return -1;
        conns = more;
        for (int i = nconns; i < grown; i++) {
            memset(&conns[i], 0, sizeof conns[i]);
            conns[i].fd = -1;
            conns[i].job = -1;
        }
        slot = nconns;
        nconns = grown;
    }
    conns[slot].fd = fd;
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)slot + 2};
    return epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev);
}

static int cmd_init(int argc, char **argv) {
    if (argc != 4) return 2;
    /* Same-uid sandbox code must not read our memory, fds or environment. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    int lfd = atoi(argv[2]), rfd = atoi(argv[3]);
    int keep[2] = {lfd, rfd};
    if (keep_only(keep, 2) != 0) return 3;
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null < 0 || dup2(null, 0) < 0 || dup2(null, 1) < 0) return 3;
    close(null);
    fcntl(lfd, F_SETFD, FD_CLOEXEC);
    /* accept() runs until EAGAIN; the socket is shared with nobody else. */
    fcntl(lfd, F_SETFL, fcntl(lfd, F_GETFL) | O_NONBLOCK);
    signal(SIGPIPE, SIG_IGN);
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    epfd = epoll_create1(EPOLL_CLOEXEC);
    if (sfd < 0 || epfd < 0 || listen(lfd, 512) != 0) {
        fprintf(stderr, "sandlot-init: setup failed: %s\n", strerror(errno));
        return 3;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = 0};
    epoll_ctl(epfd, EPOLL_CTL_ADD, lfd, &ev);
    ev.data.u32 = 1;
    epoll_ctl(epfd, EPOLL_CTL_ADD, sfd, &ev);
    char ok = 'R';
    if (write(rfd, &ok, 1) != 1) return 3;
    close(rfd);

    struct epoll_event evs[64];
    for (;;) {
        int n = epoll_wait(epfd, evs, 64, -1);
        if (n < 0) continue;
        for (int i = 0; i < n; i++) {
            uint32_t k = evs[i].data.u32;
            if (k == 0) {
                int fd;
                while ((fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK)) >= 0)
                    if (add_conn(fd) != 0) close(fd);
            } else if (k == 1) {
                struct signalfd_siginfo si;
                while (read(sfd, &si, sizeof si) > 0) {
                }
                reap();
            } else if ((int)(k - 2) < nconns && conns[k - 2].fd >= 0) {
                on_message(&conns[k - 2]);
            }
        }
    }
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "init") == 0) return cmd_init(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "launch") == 0) return cmd_launch(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "seccomp") == 0) return cmd_seccomp();
    fprintf(stderr, "usage: sandlot-init init|launch|seccomp ...\n");
    return 2;
}
