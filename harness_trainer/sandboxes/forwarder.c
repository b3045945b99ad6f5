/* The in-trial half of forwarder.py, compiled: a TCP port on the trial's loopback relayed to the capture proxy's
 * Unix socket. Same arguments, same behaviour (forwarder.py's docstring); it exists because a Python process per
 * trial costs ~6 MB of memory and ~30 ms of CPU to start, this one ~0.3 MB and ~1 ms: 1,024 trials at once.
 *
 *     forwarder --port PORT --socket PATH --watch PID [--background]
 *
 * One process accepts; each connection is relayed by a child of its own (a failure ends that connection only).
 * Every process exits once PID is gone, checked each second, as the Python half does. */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define CHUNK 65536
#define USAGE "usage: forwarder --port PORT --socket PATH --watch PID [--background]\n"

static pid_t watched;

static int gone(void) { return kill(watched, 0) != 0 && errno == ESRCH; }

/* One direction of a relay: bytes read from `from` and not yet written to `to`. */
struct leg {
    int from, to, eof;
    size_t len, off;
    char buf[CHUNK];
};

/* Read when the leg's buffer is empty, write what it holds; at the source's end, pass the half-close on.
 * Returns 1 when bytes moved or the end was seen, 0 when nothing could be done, and -1 when the connection is
 * broken (either side reset): the child then exits, closing both. */
static int step(struct leg *leg, short revents_from, short revents_to) {
    if (leg->len == leg->off && !leg->eof && (revents_from & (POLLIN | POLLHUP | POLLERR))) {
        ssize_t n = read(leg->from, leg->buf, CHUNK);
        if (n < 0)
            return errno == EINTR || errno == EAGAIN ? 0 : -1;
        if (n == 0) {
            leg->eof = 1;
            shutdown(leg->to, SHUT_WR);
            return 1;
        }
        leg->len = (size_t)n, leg->off = 0;
        return 1;
    }
    if (leg->len > leg->off && (revents_to & (POLLOUT | POLLERR | POLLHUP))) {
        ssize_t n = write(leg->to, leg->buf + leg->off, leg->len - leg->off);
        if (n < 0)
            return errno == EINTR || errno == EAGAIN ? 0 : -1;
        leg->off += (size_t)n;
        return 1;
    }
    return 0;
}

/* What the agent gets when the next hop cannot be reached: a 502 in the OpenAI error shape, which agents retry or
 * report as an API failure (a connection closed without a word reads as the model saying nothing). */
static void refuse(int client, const char *why) {
    char body[512], head[160];
    int n = snprintf(body, sizeof body, "{\"error\": {\"message\": \"the trial's forwarder could not reach the "
                     "capture proxy: %s\", \"type\": \"forwarder_error\", \"code\": 502}}", why);
    int h = snprintf(head, sizeof head, "HTTP/1.1 502 Bad Gateway\r\ncontent-type: application/json\r\n"
                     "content-length: %d\r\nconnection: close\r\n\r\n", n);
    if (write(client, head, (size_t)h) != h || write(client, body, (size_t)n) != n || shutdown(client, SHUT_WR))
        return;
    /* the request read to its end (or 5 s): closed unread, the connection would be reset under the answer */
    struct pollfd in = {client, POLLIN, 0};
    while (poll(&in, 1, 5000) > 0 && read(client, body, sizeof body) > 0)
        continue;
}

static void relay(int client, const char *path) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    int upstream = socket(AF_UNIX, SOCK_STREAM, 0);
    strncpy(addr.sun_path, path, sizeof addr.sun_path - 1);
    if (upstream < 0 || connect(upstream, (struct sockaddr *)&addr, sizeof addr) < 0) {
        refuse(client, strerror(errno));
        _exit(0);
    }
    fcntl(client, F_SETFL, O_NONBLOCK);
    fcntl(upstream, F_SETFL, O_NONBLOCK);
    static struct leg out, back;  /* static: 128 KB off the stack */
    out.from = client, out.to = upstream, back.from = upstream, back.to = client;
    while (!(out.eof && back.eof && out.len == out.off && back.len == back.off) && !gone()) {
        struct pollfd fds[2] = {{client, 0, 0}, {upstream, 0, 0}};
        if (out.len == out.off && !out.eof) fds[0].events |= POLLIN;
        if (back.len == back.off && !back.eof) fds[1].events |= POLLIN;
        if (out.len > out.off) fds[1].events |= POLLOUT;
        if (back.len > back.off) fds[0].events |= POLLOUT;
        /* A socket asked for nothing is left out: poll reports a hangup whether asked or not, and a peer that has
         * closed after its last bytes (the proxy's answer sent) must not wake the relay while the other side is
         * still reading what is held for it, nor end it (that truncated answers to a slow reader). */
        for (int i = 0; i < 2; i++)
            if (!fds[i].events) fds[i].fd = -1;
        int ready = poll(fds, 2, 1000);
        if (ready < 0 && errno != EINTR)
            break;
        if (ready <= 0)
            continue;
        int moved = step(&out, fds[0].revents, fds[1].revents);
        int back_moved = moved < 0 ? -1 : step(&back, fds[1].revents, fds[0].revents);
        if (moved < 0 || back_moved < 0)
            break;
        /* A hangup on a socket asked for something that neither leg could act on: a peer gone for good. Staying
         * would spin the core until the watched process ends (a reset fails the read or write first, so no flow
         * here was seen to reach it; it is the guard). */
        if (!moved && !back_moved && ((fds[0].revents | fds[1].revents) & (POLLHUP | POLLERR)))
            break;
    }
    _exit(0);
}

static int listen_on(int port) {
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((unsigned short)port),
                               .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int one = 1, fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 ||
        bind(fd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(fd, 64) < 0) {
        fprintf(stderr, "forwarder: cannot listen on 127.0.0.1:%d: %s\n", port, strerror(errno));
        exit(1);
    }
    return fd;
}

int main(int argc, char **argv) {
    const char *path = NULL;
    long port = -1, watch = -1;
    int background = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--background")) background = 1;
        else if (i + 1 < argc && !strcmp(argv[i], "--port")) port = strtol(argv[++i], NULL, 10);
        else if (i + 1 < argc && !strcmp(argv[i], "--watch")) watch = strtol(argv[++i], NULL, 10);
        else if (i + 1 < argc && !strcmp(argv[i], "--socket")) path = argv[++i];
        else { fprintf(stderr, "forwarder: unknown argument '%s'\n" USAGE, argv[i]); return 2; }
    }
    if (!path || !*path || port <= 0 || port > 65535 || watch <= 0) { fputs(USAGE, stderr); return 2; }
    watched = (pid_t)watch;
    int listener = listen_on((int)port);
    signal(SIGPIPE, SIG_IGN);
    signal(SIGCHLD, SIG_IGN);  /* children are reaped by the kernel */
    if (background) {
        if (fork() > 0) _exit(0);  /* the caller goes on only once the port listens */
        int devnull = open("/dev/null", O_RDWR);
        for (int fd = 0; fd < 3; fd++) dup2(devnull, fd);  /* out of the agent's own output */
    } else {
        puts("listening");
        fflush(stdout);
    }
    for (;;) {
        struct pollfd fds = {listener, POLLIN, 0};
        int ready = poll(&fds, 1, 1000);
        if (gone())
            return 0;
        if (ready <= 0)
            continue;
        int client = accept(listener, NULL, NULL);
        if (client < 0)
            continue;
        pid_t child = fork();
        for (int tries = 0; child < 0 && errno == EAGAIN && tries < 5; tries++) {  /* a moment short of processes */
            usleep(20000u << tries);
            child = fork();
        }
        if (child == 0) {
            close(listener);
            relay(client, path);
        }
        if (child < 0)
            refuse(client, strerror(errno));
        close(client);
    }
}
