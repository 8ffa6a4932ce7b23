/* Calls each syscall the sandbox denies and prints "name errno" (0: it was allowed).
 * "i386" and "x32" make a syscall through those ABIs instead (the filter kills it). */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/sched.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <termios.h>
#include <unistd.h>

static void probe(const char *name, long nr, long a0, long a1, long a2) {
    errno = 0;
    long rc = syscall(nr, a0, a1, a2, 0, 0, 0);
    printf("%s %d\n", name, rc < 0 ? errno : 0);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "i386") == 0) {
        long ret;
        __asm__ volatile("int $0x80" : "=a"(ret) : "a"(20L) : "memory"); /* getpid */
        printf("i386 allowed %ld\n", ret);
        return 0;
    }
    if (argc > 1 && strcmp(argv[1], "x32") == 0) {
        long ret = syscall(0x40000000L | SYS_getpid);
        printf("x32 allowed %ld\n", ret);
        return 0;
    }
    probe("ptrace", SYS_ptrace, 0 /* PTRACE_TRACEME */, 0, 0);
    probe("process_vm_readv", SYS_process_vm_readv, 1, 0, 0);
    probe("mount", SYS_mount, (long)"none", (long)"/tmp", (long)"tmpfs");
    probe("umount2", SYS_umount2, (long)"/tmp", 0, 0);
    probe("pivot_root", SYS_pivot_root, (long)"/", (long)"/", 0);
    probe("fsopen", SYS_fsopen, (long)"tmpfs", 0, 0);
    probe("open_tree", SYS_open_tree, -100, (long)"/", 0);
    probe("unshare_user", SYS_unshare, CLONE_NEWUSER, 0, 0);
    probe("unshare_ns", SYS_unshare, CLONE_NEWNS, 0, 0);
    probe("setns", SYS_setns, 0, 0, 0);
    probe("clone_newuser", SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0);
    probe("clone3", SYS_clone3, 0, 0, 0);
    probe("bpf", SYS_bpf, 0, 0, 0);
    probe("keyctl", SYS_keyctl, 0, 0, 0);
    probe("add_key", SYS_add_key, (long)"user", (long)"k", 0);
    probe("request_key", SYS_request_key, (long)"user", (long)"k", 0);
    probe("perf_event_open", SYS_perf_event_open, 0, 0, -1);
    probe("kexec_load", SYS_kexec_load, 0, 0, 0);
    probe("init_module", SYS_init_module, 0, 0, 0);
    probe("finit_module", SYS_finit_module, -1, 0, 0);
    probe("delete_module", SYS_delete_module, (long)"x", 0, 0);
    probe("open_by_handle_at", SYS_open_by_handle_at, -1, 0, 0);
    probe("userfaultfd", SYS_userfaultfd, 0, 0, 0);
    probe("io_uring_setup", SYS_io_uring_setup, 1, 0, 0);
    probe("tiocsti", SYS_ioctl, 0, TIOCSTI, (long)"x");
    probe("tiocsti_high", SYS_ioctl, 0, 0x100000000L | TIOCSTI, (long)"x");
    probe("tioclinux", SYS_ioctl, 0, TIOCLINUX, (long)"x");
    probe("getpid", SYS_getpid, 0, 0, 0);
    return 0;
}
