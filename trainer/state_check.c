/* Reading a checkpoint's state.h5 behind a check in a process of its own. */
#define _GNU_SOURCE
#include "state_check.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* Reading the structure takes well under a second; a checker that runs this
 * long is stuck in a loop of the damaged file. */
#define CHECK_TIMEOUT_S 120.0

/* Reads the child's output into buf (up to n-1 bytes, the rest discarded)
 * until it closes it or the deadline passes; returns 0, or -1 on timeout. */
static int read_output(int fd, char *buf, size_t n, double timeout_s)
{
    size_t len = 0;
    double end = sp_now() + timeout_s;
    for (;;) {
        double left = end - sp_now();
        if (left <= 0)
            return -1;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, (int)(left * 1000.0) + 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return r == 0 ? -1 : 0;
        char tmp[4096];
        ssize_t got = read(fd, tmp, sizeof tmp);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        size_t take = (size_t)got < n - 1 - len ? (size_t)got : n - 1 - len;
        memcpy(buf + len, tmp, take);
        len += take;
    }
    buf[len] = 0;
    return 0;
}

/* The child's error message: its "spotune: error: " line, without the prefix. */
static const char *child_message(char *out)
{
    char *e = strstr(out, "error: ");
    if (!e)
        return out;
    e += strlen("error: ");
    e[strcspn(e, "\n")] = 0;
    return e;
}

int state_check_isolated(const char *dir, sp_err *err)
{
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0)
        return sp_fail(err, SP_EXIT_OTHER, "cannot check %s: pipe: %s", dir, strerror(errno));
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&fa, fds[1], STDERR_FILENO);
    char *argv[] = {"spotune", "ckpt", "check", (char *)dir, NULL};
    pid_t pid;
    int rc = posix_spawn(&pid, "/proc/self/exe", &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(fds[1]);
    if (rc != 0) {
        close(fds[0]);
        return sp_fail(err, SP_EXIT_OTHER, "cannot check %s: cannot start a checker: %s", dir,
                       strerror(rc));
    }
    char out[2048];
    int timed_out = read_output(fds[0], out, sizeof out, CHECK_TIMEOUT_S) != 0;
    close(fds[0]);
    if (timed_out)
        kill(pid, SIGKILL);
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    if (timed_out)
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s/%s is damaged: reading its structure did not finish in %.0f s",
                       dir, CKPT_STATE_FILE, CHECK_TIMEOUT_S);
    if (WIFSIGNALED(st))
        return sp_fail(err, SP_EXIT_INPUT,
                       "%s/%s is damaged: reading its structure crashed the HDF5 library "
                       "(signal %d, %s) in the process that checks it",
                       dir, CKPT_STATE_FILE, WTERMSIG(st), strsignal(WTERMSIG(st)));
    if (WEXITSTATUS(st) == 0)
        return 0;
    if (WEXITSTATUS(st) == SP_EXIT_INPUT)
        return sp_fail(err, SP_EXIT_INPUT, "%s", child_message(out));
    return sp_fail(err, SP_EXIT_INPUT,
                   "%s/%s is damaged: the process that checks it exited %d (sanitizer or "
                   "library error)",
                   dir, CKPT_STATE_FILE, WEXITSTATUS(st));
}

int state_read_checked(const char *dir, int shards_in_store, ckpt_snapshot *s, sp_err *err)
{
    ckpt_manifest m;
    ckpt_snapshot_init(s);
    int rc = ckpt_verify_ex(dir, &m, shards_in_store, err);
    if (!rc)
        rc = state_check_isolated(dir, err);
    if (!rc)
        rc = ckpt_read_verified(dir, &m, s, err);
    ckpt_manifest_free(&m);
    return rc;
}
