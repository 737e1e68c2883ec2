/* tests/multinode/mn_forward.c — a TCP forwarder for the storage node of
 * the multi-node tests: it listens on the storage node's address and passes
 * each connection through to the S3 server that listens on that node's own
 * loopback. Client-to-server bytes can be rate-limited per connection, so
 * that a checkpoint upload lasts long enough to be cut in the middle, and
 * the first line of every request and response is logged with its time:
 *
 *   1796070405.502 conn 3 > PUT /bucket/prefix/step-00000010/state.h5 HTTP/1.1
 *   1796070406.871 conn 3 < HTTP/1.1 200 OK
 *
 * With --refuse FILE, while FILE exists, a request whose first line contains
 * one of FILE's lines is answered "503 Service Unavailable" by the forwarder
 * itself (logged "conn N ! refused ...") and its connection closed: the
 * store is away for those keys only, for as long as the test keeps FILE.
 *
 * usage: spotune-mn-forward LISTEN_IP:PORT TARGET_IP:PORT [--rate BYTES_PER_S] [--log FILE]
 *        [--refuse FILE]
 * Writes "listening" to the log once it accepts connections. One process per
 * connection; it runs until killed. */
#define _POSIX_C_SOURCE 200809L
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int log_fd = -1;
static double rate; /* bytes per second client -> server, 0: unlimited */
static const char *refuse_file; /* --refuse */

static double wall(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double mono(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* One line, written whole (O_APPEND: lines of several connections never mix). */
__attribute__((format(printf, 1, 2))) static void logf_line(const char *fmt, ...)
{
    if (log_fd < 0)
        return;
    char line[1024];
    int n = snprintf(line, sizeof line, "%.3f ", wall());
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof line - 2)
        n = (int)sizeof line - 2;
    line[n++] = '\n';
    if (write(log_fd, line, (size_t)n) < 0) {
    }
}

static int parse_addr(const char *s, struct sockaddr_in *a)
{
    char host[64];
    const char *colon = strrchr(s, ':');
    if (!colon || colon - s >= (long)sizeof host)
        return -1;
    memcpy(host, s, (size_t)(colon - s));
    host[colon - s] = 0;
    memset(a, 0, sizeof *a);
    a->sin_family = AF_INET;
    a->sin_port = htons((unsigned short)atoi(colon + 1));
    return inet_pton(AF_INET, host, &a->sin_addr) == 1 ? 0 : -1;
}

/* The first line of a chunk that starts a request ("PUT /...") or a
 * response ("HTTP/1.1 200 OK"), else nothing. Returns 1 for a request. */
static int log_start(int conn, char dir, const char *buf, size_t n)
{
    size_t i = 0;
    while (i < n && i < 16 && buf[i] >= 'A' && buf[i] <= 'Z')
        i++;
    int request = i > 0 && i < n && buf[i] == ' ' && i + 1 < n && buf[i + 1] == '/';
    int response = n > 5 && !memcmp(buf, "HTTP/", 5);
    if (!request && !response)
        return 0;
    size_t len = 0;
    while (len < n && len < 300 && buf[len] != '\r' && buf[len] != '\n')
        len++;
    logf_line("conn %d %c %.*s", conn, dir, (int)len, buf);
    return request;
}

/* Whether the request that buf starts (its first line, up to n bytes)
 * contains a line of the --refuse file. */
static int refused(const char *buf, size_t n)
{
    FILE *f = refuse_file ? fopen(refuse_file, "r") : NULL;
    if (!f)
        return 0;
    char first[1024], pat[512];
    size_t len = 0;
    while (len < n && len < sizeof first - 1 && buf[len] != '\r' && buf[len] != '\n')
        len++;
    memcpy(first, buf, len);
    first[len] = 0;
    int hit = 0;
    while (!hit && fgets(pat, sizeof pat, f)) {
        pat[strcspn(pat, "\r\n")] = 0;
        hit = pat[0] && strstr(first, pat) != NULL;
    }
    fclose(f);
    return hit;
}

static int write_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Relays one connection until either side closes. */
static void relay(int conn, int client, const struct sockaddr_in *target)
{
    int server = socket(AF_INET, SOCK_STREAM, 0);
    if (server < 0 || connect(server, (const struct sockaddr *)target, sizeof *target) != 0) {
        logf_line("conn %d cannot reach the server: %s", conn, strerror(errno));
        return;
    }
    int one = 1;
    setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    static char buf[1 << 16];
    double t0 = mono(), sent = 0;
    for (;;) {
        /* client -> server: only as fast as the rate allows */
        int wait_ms = -1, may_read_client = 1;
        size_t cap = sizeof buf;
        if (rate > 0) {
            double allowed = rate * (mono() - t0) + rate / 20; /* 50 ms of burst */
            if (sent >= allowed) {
                may_read_client = 0;
                wait_ms = (int)((sent - allowed) / rate * 1000) + 1;
            } else if (allowed - sent < (double)cap) {
                cap = (size_t)(allowed - sent) + 1;
            }
        }
        struct pollfd p[2] = {{client, may_read_client ? POLLIN : 0, 0}, {server, POLLIN, 0}};
        int r = poll(p, 2, wait_ms);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            break;
        if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) {
            ssize_t n = read(client, buf, cap);
            if (n <= 0)
                break;
            if (log_start(conn, '>', buf, (size_t)n) && refused(buf, (size_t)n)) {
                static const char no[] = "HTTP/1.1 503 Service Unavailable\r\n"
                                         "Content-Length: 0\r\nConnection: close\r\n\r\n";
                logf_line("conn %d ! refused (503)", conn);
                write_all(client, no, sizeof no - 1);
                break;
            }
            if (write_all(server, buf, (size_t)n))
                break;
            sent += (double)n;
        }
        if (p[1].revents & (POLLIN | POLLHUP | POLLERR)) {
            ssize_t n = read(server, buf, sizeof buf);
            if (n <= 0)
                break;
            log_start(conn, '<', buf, (size_t)n);
            if (write_all(client, buf, (size_t)n))
                break;
        }
    }
    close(server);
}

int main(int argc, char **argv)
{
    struct sockaddr_in listen_at, target;
    if (argc < 3 || parse_addr(argv[1], &listen_at) || parse_addr(argv[2], &target)) {
        fprintf(stderr, "usage: spotune-mn-forward LISTEN_IP:PORT TARGET_IP:PORT "
                        "[--rate BYTES_PER_S] [--log FILE] [--refuse FILE]\n");
        return 2;
    }
    for (int i = 3; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--rate"))
            rate = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--refuse"))
            refuse_file = argv[i + 1];
        else if (!strcmp(argv[i], "--log"))
            log_fd = open(argv[i + 1], O_WRONLY | O_CREAT | O_APPEND, 0644);
    }
    signal(SIGCHLD, SIG_IGN); /* connections' processes reap themselves */
    signal(SIGPIPE, SIG_IGN);
    int s = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (s < 0 || bind(s, (struct sockaddr *)&listen_at, sizeof listen_at) != 0 ||
        listen(s, 64) != 0) {
        fprintf(stderr, "spotune-mn-forward: %s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    logf_line("listening on %s, forwarding to %s%s", argv[1], argv[2],
              rate > 0 ? " (rate-limited)" : "");
    for (int conn = 1;; conn++) {
        int c = accept(s, NULL, NULL);
        if (c < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            return 1;
        }
        pid_t pid = fork();
        if (pid == 0) {
            close(s);
            relay(conn, c, &target);
            _exit(0);
        }
        close(c);
    }
}
