/* The heartbeat: a native thread per process that pings the control planes it watches over UDP,
 * answers every ping it gets, and reports a watched peer silent when nothing came from it for
 * `timeout_ns`. It runs without the GIL and without any Python thread: a process whose Python
 * is busy (or holds the GIL in a long native call) still answers; one that is stopped (SIGSTOP),
 * hung in the kernel or cut off does not.
 *
 * Packet (16 bytes): magic u32 | kind u32 | token[8]. The token is derived from the job's key
 * (only the job's processes know it): anything else is dropped unread.
 *   PING   "are you there": answered with PONG, or with FENCED when the sender was found silent
 *          here before (it was excluded: it must not come back into the job it left);
 *   PONG   "here";
 *   BYE    "this plane closes": stop watching it (its connections tell the rest);
 *   FENCED "you were excluded": the receiver's planes must not take part any more.
 *
 * A watcher that was itself stopped (or starved of CPU) for longer than half the timeout judges
 * nobody for that gap: it restarts every peer's clock, since it could not have heard them. */
#ifndef DDL_HEARTBEAT_H
#define DDL_HEARTBEAT_H

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define DDL_HB_MAGIC 0xDDC7BEA7u
#define DDL_HB_PING 1u
#define DDL_HB_PONG 2u
#define DDL_HB_BYE 3u
#define DDL_HB_FENCED 4u
#define DDL_HB_MAX_PEERS 65536 /* addresses remembered: watched ones and those that pinged */

typedef struct {
    uint32_t ip;   /* network order */
    uint16_t port; /* network order */
    int watchers;  /* how many watch it; 0: only remembered (it pinged us) */
    int silent;    /* reported silent: final */
    int bye;       /* it said goodbye: not judged any more */
    int64_t heard_ns;
} ddl_hb_peer;

typedef struct {
    int fd; /* the bound UDP socket (owned by the caller) */
    uint8_t token[8];
    int64_t interval_ns, timeout_ns;
    pthread_mutex_t mu;
    pthread_cond_t cond; /* signalled when a peer goes silent, when fenced, and at stop */
    ddl_hb_peer *peers;
    int npeers, cap;
    int *reports; /* indices of peers gone silent, not yet taken */
    int nreports, reports_cap;
    int fenced;     /* a peer told us we were excluded */
    uint32_t fenced_ip;
    uint16_t fenced_port;
    int stop;
    int wake[2]; /* a pipe: stop wakes the thread's poll */
    pthread_t thread;
    int running;
} ddl_hb;

static inline int64_t ddl_hb_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int ddl_hb_find(ddl_hb *hb, uint32_t ip, uint16_t port) {
    for (int i = 0; i < hb->npeers; i++)
        if (hb->peers[i].ip == ip && hb->peers[i].port == port) return i;
    return -1;
}

/* The slot of (ip, port), added if new; -1 when the table is full (mu held). */
static int ddl_hb_slot(ddl_hb *hb, uint32_t ip, uint16_t port, int64_t now) {
    int i = ddl_hb_find(hb, ip, port);
    if (i >= 0) return i;
    if (hb->npeers == hb->cap) {
        if (hb->cap >= DDL_HB_MAX_PEERS) return -1;
        int cap = hb->cap ? hb->cap * 2 : 16;
        ddl_hb_peer *p = (ddl_hb_peer *)realloc(hb->peers, (size_t)cap * sizeof(*p));
        if (!p) return -1;
        hb->peers = p;
        hb->cap = cap;
    }
    i = hb->npeers++;
    memset(&hb->peers[i], 0, sizeof(hb->peers[i]));
    hb->peers[i].ip = ip;
    hb->peers[i].port = port;
    hb->peers[i].heard_ns = now;
    return i;
}

static void ddl_hb_send(ddl_hb *hb, uint32_t ip, uint16_t port, uint32_t kind) {
    uint8_t pkt[16];
    uint32_t magic = DDL_HB_MAGIC;
    memcpy(pkt, &magic, 4);
    memcpy(pkt + 4, &kind, 4);
    memcpy(pkt + 8, hb->token, 8);
    struct sockaddr_in to;
    memset(&to, 0, sizeof(to));
    to.sin_family = AF_INET;
    to.sin_addr.s_addr = ip;
    to.sin_port = port;
    /* Best effort: a full buffer or an unreachable peer is what the timeout is for. */
    (void)sendto(hb->fd, pkt, sizeof(pkt), MSG_DONTWAIT, (struct sockaddr *)&to, sizeof(to));
}

static void ddl_hb_report(ddl_hb *hb, int i) {
    if (hb->nreports == hb->reports_cap) {
        int cap = hb->reports_cap ? hb->reports_cap * 2 : 16;
        int *r = (int *)realloc(hb->reports, (size_t)cap * sizeof(int));
        if (!r) return; /* reported again at the next check: `silent` stays 0 */
        hb->reports = r;
        hb->reports_cap = cap;
    }
    hb->peers[i].silent = 1;
    hb->reports[hb->nreports++] = i;
    pthread_cond_broadcast(&hb->cond);
}

static void ddl_hb_receive(ddl_hb *hb) {
    for (;;) {
        uint8_t pkt[16];
        struct sockaddr_in from;
        socklen_t len = sizeof(from);
        ssize_t n = recvfrom(hb->fd, pkt, sizeof(pkt), MSG_DONTWAIT, (struct sockaddr *)&from, &len);
        if (n < 0) {
            if (errno == EINTR) continue;
            return; /* EAGAIN: drained; anything else: the next poll tells */
        }
        uint32_t magic, kind;
        if (n != 16 || from.sin_family != AF_INET) continue;
        memcpy(&magic, pkt, 4);
        memcpy(&kind, pkt + 4, 4);
        if (magic != DDL_HB_MAGIC || memcmp(pkt + 8, hb->token, 8) != 0) continue;
        uint32_t ip = from.sin_addr.s_addr;
        uint16_t port = from.sin_port;
        int64_t now = ddl_hb_now();
        pthread_mutex_lock(&hb->mu);
        int i = ddl_hb_slot(hb, ip, port, now);
        int excluded = i >= 0 && hb->peers[i].silent;
        if (i >= 0 && !excluded) hb->peers[i].heard_ns = now;
        if (kind == DDL_HB_BYE && i >= 0) hb->peers[i].bye = 1;
        if (kind == DDL_HB_FENCED && !hb->fenced) {
            hb->fenced = 1;
            hb->fenced_ip = ip;
            hb->fenced_port = port;
            pthread_cond_broadcast(&hb->cond);
        }
        pthread_mutex_unlock(&hb->mu);
        if (kind == DDL_HB_PING) ddl_hb_send(hb, ip, port, excluded ? DDL_HB_FENCED : DDL_HB_PONG);
    }
}

static void *ddl_hb_main(void *arg) {
    ddl_hb *hb = (ddl_hb *)arg;
    int64_t last = ddl_hb_now(), next = last;
    for (;;) {
        int64_t now = ddl_hb_now();
        pthread_mutex_lock(&hb->mu);
        if (hb->stop) {
            pthread_mutex_unlock(&hb->mu);
            return NULL;
        }
        int paused = now - last > hb->timeout_ns / 2;
        last = now;
        if (now >= next) {
            for (int i = 0; i < hb->npeers; i++) {
                ddl_hb_peer *p = &hb->peers[i];
                if (p->watchers <= 0 || p->silent || p->bye) continue;
                if (paused)
                    p->heard_ns = now; /* we were not running: we could not have heard it */
                else if (now - p->heard_ns > hb->timeout_ns)
                    ddl_hb_report(hb, i);
                if (!p->silent) ddl_hb_send(hb, p->ip, p->port, DDL_HB_PING);
            }
            next = now + hb->interval_ns;
        }
        pthread_mutex_unlock(&hb->mu);
        struct pollfd fds[2] = {{hb->fd, POLLIN, 0}, {hb->wake[0], POLLIN, 0}};
        int wait_ms = (int)((next - now + 999999) / 1000000);
        if (poll(fds, 2, wait_ms > 0 ? wait_ms : 0) > 0 && (fds[0].revents & POLLIN))
            ddl_hb_receive(hb);
    }
}

/* Start the thread on the bound UDP socket `fd`; 0, or an errno. */
static int ddl_hb_start(ddl_hb *hb, int fd, const uint8_t *token, int64_t interval_ns,
                        int64_t timeout_ns) {
    memset(hb, 0, sizeof(*hb));
    hb->fd = fd;
    memcpy(hb->token, token, 8);
    hb->interval_ns = interval_ns;
    hb->timeout_ns = timeout_ns;
    if (pipe(hb->wake) != 0) return errno;
    pthread_mutex_init(&hb->mu, NULL);
    pthread_cond_init(&hb->cond, NULL);
    int rc = pthread_create(&hb->thread, NULL, ddl_hb_main, hb);
    if (rc != 0) {
        close(hb->wake[0]);
        close(hb->wake[1]);
        return rc;
    }
    hb->running = 1;
    return 0;
}

/* Watch (delta = 1) or stop watching (delta = -1) the plane at ip:port (network order). */
static void ddl_hb_watch(ddl_hb *hb, uint32_t ip, uint16_t port, int delta) {
    if (!hb->running) return; /* stopped: its table is gone */
    pthread_mutex_lock(&hb->mu);
    int64_t now = ddl_hb_now();
    int i = ddl_hb_slot(hb, ip, port, now);
    if (i >= 0) {
        if (delta > 0 && hb->peers[i].watchers == 0) hb->peers[i].heard_ns = now;
        hb->peers[i].watchers += delta;
    }
    pthread_mutex_unlock(&hb->mu);
}

/* Wait up to `timeout_ns` for a silent peer or a fence. Returns the number of silent peers
 * written to ips/ports (at most `max`), or -1 when fenced (the fencer in ips[0]/ports[0]), or
 * -2 once stopped. */
static int ddl_hb_wait(ddl_hb *hb, int64_t timeout_ns, uint32_t *ips, uint16_t *ports, int max) {
    if (!hb->running) return -2;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    int64_t ns = until.tv_nsec + timeout_ns;
    until.tv_sec += ns / 1000000000LL;
    until.tv_nsec = ns % 1000000000LL;
    pthread_mutex_lock(&hb->mu);
    while (!hb->stop && !hb->fenced && hb->nreports == 0)
        if (pthread_cond_timedwait(&hb->cond, &hb->mu, &until) == ETIMEDOUT) break;
    int n;
    if (hb->stop) {
        n = -2;
    } else if (hb->fenced) {
        ips[0] = hb->fenced_ip;
        ports[0] = hb->fenced_port;
        n = -1;
    } else {
        n = hb->nreports < max ? hb->nreports : max;
        for (int k = 0; k < n; k++) {
            ips[k] = hb->peers[hb->reports[k]].ip;
            ports[k] = hb->peers[hb->reports[k]].port;
        }
        memmove(hb->reports, hb->reports + n, (size_t)(hb->nreports - n) * sizeof(int));
        hb->nreports -= n;
    }
    pthread_mutex_unlock(&hb->mu);
    return n;
}

/* Say goodbye to every peer heard from or watched, then stop the thread and free. */
static void ddl_hb_stop(ddl_hb *hb, int goodbye) {
    if (!hb->running) return;
    pthread_mutex_lock(&hb->mu);
    if (goodbye)
        for (int i = 0; i < hb->npeers; i++)
            if (!hb->peers[i].silent) ddl_hb_send(hb, hb->peers[i].ip, hb->peers[i].port, DDL_HB_BYE);
    hb->stop = 1;
    pthread_cond_broadcast(&hb->cond);
    pthread_mutex_unlock(&hb->mu);
    char one = 1;
    (void)!write(hb->wake[1], &one, 1);
    pthread_join(hb->thread, NULL);
    close(hb->wake[0]);
    close(hb->wake[1]);
    pthread_mutex_lock(&hb->mu);
    free(hb->peers);
    free(hb->reports);
    hb->peers = NULL;
    hb->reports = NULL;
    hb->npeers = hb->cap = hb->nreports = hb->reports_cap = 0;
    hb->running = 0;
    pthread_mutex_unlock(&hb->mu);
}

#endif
