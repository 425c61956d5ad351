/* Collectives among the ranks of one host through shared "boards" (transports/shm/boards.py).
 *
 * Every rank owns one board, a shared-memory segment every other local rank maps:
 *
 *   board:  [header: magic, epoch, doorbell, abort note, 2 entries | slot 0 | slot 1]
 *   entry:  what the owner published at an epoch: check word, call (kind, dtype, op, root,
 *           count), and for direct reads the addresses of its input and output in its process
 *
 * A sync point is: publish (write the entry of parity epoch & 1, then store-release the new
 * epoch, ring the peers' doorbells), then wait until every peer's epoch reached ours (acquire
 * loads). Every rank takes the same number of sync points per call, so epochs agree. Everything
 * a rank reads of a peer's epoch-e entry or slot it reads between its wait(e) and its
 * publish(e + 1); a peer overwrites that parity only at e + 2, after waiting for our e + 1.
 * So two entries and two slots per board suffice.
 *
 * Small messages go through the slots: one sync, then every rank reduces all slots in rank
 * order (the same operations on every rank: bit-identical results). Large messages move with
 * process_vm_readv/writev (one copy, kernel to kernel): rank r reduces slice r of the result,
 * reading it from every rank's input chunk by chunk, and writes each reduced chunk, still in
 * cache, into every rank's output; two syncs (addresses published; everybody done writing).
 * An allreduce split around network phases (mdring across hosts) runs as its two halves, each
 * with the same two syncs: DDL_K_RS_PART (reduce our part, write nobody else's output) and
 * DDL_K_AG_PART (read every peer's final part out of its output).
 *
 * Every wait has a deadline, watches the peers' abort notes and their pidfds (a dead peer is a
 * named failure within milliseconds), and spins briefly, yields, then sleeps on the futex.
 * All of it runs with the GIL released. The large messages' path is ddl_arena_direct.h. */
#ifndef DDL_ARENA_H
#define DDL_ARENA_H

#include <poll.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>

#include "ddl_kernels.h"
#include "ddl_shm.h"

#define DDL_ARENA_MAX 64

/* Board layout (bytes). */
#define DDL_A_MAGIC 0
#define DDL_A_VERSION 8
#define DDL_A_SIZE 12
#define DDL_A_SLOT 16
#define DDL_A_PID 24
#define DDL_A_CMA_OK 28
#define DDL_A_SELF 32          /* the board's address in its owner, for the CMA probe */
#define DDL_A_PROBE 40         /* peers write here to show process_vm_writev works */
#define DDL_A_EPOCH 64
#define DDL_A_BELL 128
#define DDL_A_ABORT_CODE 192
#define DDL_A_ABORT_LEN 196
#define DDL_A_ABORT 256        /* up to 1024 bytes of reason */
#define DDL_A_ENTRY 2048       /* two entries of 64 bytes */
#define DDL_A_HEADER 4096
/* Entry layout. */
#define DDL_E_CHECK 0
#define DDL_E_IN 8
#define DDL_E_OUT 16
#define DDL_E_COUNT 24
#define DDL_E_KIND 32
#define DDL_E_DTYPE 36
#define DDL_E_OP 40
#define DDL_E_ROOT 44

/* Statuses. */
#define DDL_A_OK 0
#define DDL_A_TIMEOUT 1
#define DDL_A_DEAD 2
#define DDL_A_ABORTED 3
#define DDL_A_MISMATCH 4
#define DDL_A_CMA_FAILED 5
#define DDL_A_BAD_ARGS 6

/* Collective kinds (transports/shm/board_calls.py's BoardKind). */
#define DDL_K_ALLREDUCE 1
#define DDL_K_REDUCE_SCATTER 2
#define DDL_K_ALLGATHER 3
#define DDL_K_BROADCAST 4
#define DDL_K_BARRIER 5
/* The two halves of an allreduce whose middle runs elsewhere (mdring across hosts): rank r
 * reduces part r (ddl_part) of every rank's input into part r of its output; later, every rank
 * copies part q of rank q's output into part q of its own (the input is not used). */
#define DDL_K_RS_PART 6
#define DDL_K_AG_PART 7

/* Spin with `pause` this long, then yield the CPU (ranks may outnumber cores) until
 * DDL_A_YIELD_NS, then sleep on the doorbell in slices of at most DDL_A_SLEEP_NS, looking at the
 * peers' pidfds between slices. */
#define DDL_A_PAUSE_NS 2000
#define DDL_A_YIELD_NS 100000
#define DDL_A_SLEEP_NS 5000000

typedef struct {
    int rank, size;
    uint8_t *boards[DDL_ARENA_MAX];
    int pids[DDL_ARENA_MAX];
    int pidfds[DDL_ARENA_MAX];
    uint64_t slot_bytes;     /* bytes per slot (two per board) */
    uint64_t epoch;          /* the last epoch this rank published */
    uint64_t chunk;          /* bytes per direct-read chunk */
    uint8_t *temp[3];        /* direct-read staging: chunks, cache resident (temp[2]: our own
                                input chunk, saved when reducing in place) */
    uint64_t exposed;        /* epoch from which peers may touch our buffers (0: none) */
    int saved;               /* the current chunk of our input is in temp[2] */
    /* What went wrong: the peer concerned and, for CMA, -errno. */
    int bad_rank;
    int64_t err;
} ddl_arena;

typedef struct {
    int kind, dtype, op;     /* op: kernel code (SUM for avg) */
    int root;
    int64_t count;           /* input elements */
    int itemsize;
    int64_t divisor;         /* avg: divide the reduced values by this; 0: no division */
    uint64_t check;
    uint8_t *in, *out;
    int64_t deadline_ns;     /* CLOCK_MONOTONIC */
} ddl_call;

static inline int64_t ddl_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void ddl_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline uint8_t *ddl_entry(const ddl_arena *a, int q, uint64_t epoch) {
    return a->boards[q] + DDL_A_ENTRY + (epoch & 1) * 64;
}

static inline uint8_t *ddl_slot(const ddl_arena *a, int q, uint64_t epoch) {
    return a->boards[q] + DDL_A_HEADER + (epoch & 1) * a->slot_bytes;
}

static inline void ddl_put_u64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static inline void ddl_put_u32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline uint64_t ddl_get_u64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* Write our entry for the next epoch (addresses may be NULL), publish the epoch, wake peers. */
static inline void ddl_arena_publish(ddl_arena *a, const ddl_call *c, const void *in,
                                     const void *out) {
    uint64_t e = a->epoch + 1;
    uint8_t *ent = ddl_entry(a, a->rank, e);
    ddl_put_u64(ent + DDL_E_CHECK, c->check);
    ddl_put_u64(ent + DDL_E_IN, (uint64_t)(uintptr_t)in);
    ddl_put_u64(ent + DDL_E_OUT, (uint64_t)(uintptr_t)out);
    ddl_put_u64(ent + DDL_E_COUNT, (uint64_t)c->count);
    ddl_put_u32(ent + DDL_E_KIND, (uint32_t)c->kind);
    ddl_put_u32(ent + DDL_E_DTYPE, (uint32_t)c->dtype);
    ddl_put_u32(ent + DDL_E_OP, (uint32_t)c->op);
    ddl_put_u32(ent + DDL_E_ROOT, (uint32_t)c->root);
    a->epoch = e;
    ddl_store_release_u64(a->boards[a->rank] + DDL_A_EPOCH, e);
    for (int q = 0; q < a->size; q++)
        if (q != a->rank) ddl_bell_ring(a->boards[q] + DDL_A_BELL);
}

/* Before touching a peer's buffers: has anyone left an abort note? A failed rank may already
 * have returned its buffers to its program (see ddl_arena_settle). */
static inline int ddl_arena_check_notes(ddl_arena *a) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int q = 0; q < a->size; q++)
        if (q != a->rank && ddl_load_acquire_u32(a->boards[q] + DDL_A_ABORT_CODE)) {
            a->bad_rank = q;
            return DDL_A_ABORTED;
        }
    return DDL_A_OK;
}

/* A peer that aborted or died: DDL_A_ABORTED / DDL_A_DEAD with a->bad_rank set, else OK. */
static inline int ddl_arena_peers_failed(ddl_arena *a) {
    /* Our own note too: close() on another thread ends a wait in progress. */
    if (ddl_load_acquire_u32(a->boards[a->rank] + DDL_A_ABORT_CODE)) {
        a->bad_rank = a->rank;
        return DDL_A_ABORTED;
    }
    int st = ddl_arena_check_notes(a);
    if (st != DDL_A_OK) return st;
    struct pollfd fds[DDL_ARENA_MAX];
    int idx[DDL_ARENA_MAX], n = 0;
    for (int q = 0; q < a->size; q++)
        if (q != a->rank && a->pidfds[q] >= 0) {
            fds[n].fd = a->pidfds[q];
            fds[n].events = POLLIN;
            fds[n].revents = 0;
            idx[n++] = q;
        }
    if (n && poll(fds, (nfds_t)n, 0) > 0)
        for (int i = 0; i < n; i++)
            if (fds[i].revents) {
                a->bad_rank = idx[i];
                return DDL_A_DEAD;
            }
    return DDL_A_OK;
}

/* Wait until every peer published our epoch; then compare their check words with ours. */
static inline int ddl_arena_all_reached(const ddl_arena *a, uint64_t e) {
    for (int q = 0; q < a->size; q++)
        if (q != a->rank && ddl_load_acquire_u64(a->boards[q] + DDL_A_EPOCH) < e) return 0;
    return 1;
}

static inline int ddl_arena_wait(ddl_arena *a, const ddl_call *c) {
    uint64_t e = a->epoch;
    uint8_t *bell = a->boards[a->rank] + DDL_A_BELL;
    int64_t start = 0, next_look = 0;
    int q = 0;
    for (;;) {
        uint32_t seen = ddl_bell_seq(bell);
        for (; q < a->size; q++)
            if (q != a->rank && ddl_load_acquire_u64(a->boards[q] + DDL_A_EPOCH) < e) break;
        if (q == a->size) break;
        int64_t now = ddl_now_ns();
        if (!start) start = now;
        /* A peer that arrived, then closed or exited, did finish this sync: look at the epochs
         * again after seeing a note or an exit (both come after the peer's epoch store). */
        if (now >= c->deadline_ns) {
            int st = ddl_arena_peers_failed(a);
            if (ddl_arena_all_reached(a, e)) continue;
            if (st != DDL_A_OK) return st;
            a->bad_rank = q;
            return DDL_A_TIMEOUT;
        }
        int64_t waited = now - start;
        if (waited < DDL_A_PAUSE_NS) { ddl_cpu_relax(); continue; }
        if (now >= next_look) {
            int st = ddl_arena_peers_failed(a);
            if (st != DDL_A_OK && !ddl_arena_all_reached(a, e)) return st;
            next_look = now + DDL_A_SLEEP_NS;
        }
        if (waited < DDL_A_YIELD_NS) { sched_yield(); continue; }
        int64_t left = c->deadline_ns - now;
        ddl_bell_wait(bell, seen, left < DDL_A_SLEEP_NS ? left : DDL_A_SLEEP_NS);
    }
    for (int p = 0; p < a->size; p++)
        if (p != a->rank && ddl_get_u64(ddl_entry(a, p, e) + DDL_E_CHECK) != c->check) {
            a->bad_rank = p;
            return DDL_A_MISMATCH;
        }
    return DDL_A_OK;
}

static inline int ddl_arena_sync(ddl_arena *a, const ddl_call *c, const void *in, const void *out) {
    ddl_arena_publish(a, c, in, out);
    return ddl_arena_wait(a, c);
}

/* Element range [*off, *off + *len) of part `i` of `count` split in `parts`, the first
 * count % parts parts one longer (as ddlcore.algorithms.schedule.split). */
static inline void ddl_part(int64_t count, int parts, int i, int64_t *off, int64_t *len) {
    int64_t base = count / parts, extra = count % parts;
    *off = base * i + (i < extra ? i : extra);
    *len = base + (i < extra ? 1 : 0);
}

/* --- small messages: through the slots --------------------------------------------------- */

/* out[0:n] = slot_0[boff:] OP slot_1[boff:] OP ... in rank order (then / divisor). */
static inline void ddl_reduce_slots(ddl_arena *a, const ddl_call *c, uint8_t *out, int64_t n,
                                    uint64_t boff) {
    uint64_t e = a->epoch;
    if (n == 0) return;
    ddl_reduce(out, ddl_slot(a, 0, e) + boff, ddl_slot(a, 1, e) + boff, n, c->dtype, c->op);
    for (int q = 2; q < a->size; q++)
        ddl_reduce(out, out, ddl_slot(a, q, e) + boff, n, c->dtype, c->op);
    if (c->divisor) ddl_divide(out, n, c->dtype, c->divisor);
}

static inline int ddl_arena_small(ddl_arena *a, const ddl_call *c) {
    uint64_t nbytes = (uint64_t)c->count * (uint64_t)c->itemsize;
    uint64_t e = a->epoch + 1;
    if (nbytes > a->slot_bytes) return DDL_A_BAD_ARGS;
    if (c->kind == DDL_K_AG_PART) {  /* only our part is news to the peers */
        int64_t off, len;
        ddl_part(c->count, a->size, a->rank, &off, &len);
        if (len)
            memcpy(ddl_slot(a, a->rank, e) + off * c->itemsize, c->out + off * c->itemsize,
                   (size_t)(len * c->itemsize));
    } else if (nbytes && (c->kind != DDL_K_BROADCAST || c->root == a->rank)) {
        memcpy(ddl_slot(a, a->rank, e), c->in, nbytes);
    }
    int st = ddl_arena_sync(a, c, NULL, NULL);
    if (st != DDL_A_OK) return st;
    switch (c->kind) {
    case DDL_K_ALLREDUCE:
        ddl_reduce_slots(a, c, c->out, c->count, 0);
        break;
    case DDL_K_REDUCE_SCATTER: {
        int64_t k = c->count / a->size;
        ddl_reduce_slots(a, c, c->out, k, (uint64_t)(a->rank * k * c->itemsize));
        break;
    }
    case DDL_K_RS_PART: {
        int64_t off, len;
        ddl_part(c->count, a->size, a->rank, &off, &len);
        ddl_reduce_slots(a, c, c->out + off * c->itemsize, len, (uint64_t)(off * c->itemsize));
        break;
    }
    case DDL_K_AG_PART:
        for (int q = 0; q < a->size; q++) {
            int64_t off, len;
            ddl_part(c->count, a->size, q, &off, &len);
            if (len && q != a->rank)
                memcpy(c->out + off * c->itemsize, ddl_slot(a, q, e) + off * c->itemsize,
                       (size_t)(len * c->itemsize));
        }
        break;
    case DDL_K_ALLGATHER:
        for (int q = 0; q < a->size; q++)
            if (nbytes) memcpy(c->out + q * nbytes, ddl_slot(a, q, e), nbytes);
        break;
    case DDL_K_BROADCAST:
        if (a->rank != c->root && nbytes) memcpy(c->out, ddl_slot(a, c->root, e), nbytes);
        break;
    default:  /* barrier: the sync was all */
        break;
    }
    return DDL_A_OK;
}

/* After a failed direct call (and our abort note): wait, at most until `deadline_ns`, until no
 * peer can still be touching our buffers: each has not reached the call's first sync (it will
 * see our note before it touches anything), has passed its second, left a note, or exited.
 * Returns 1 when settled, 0 when the deadline passed (the caller keeps the buffers alive). */
static inline int ddl_arena_settle(ddl_arena *a, int64_t deadline_ns) {
    uint64_t e = a->exposed;
    if (!e) return 1;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (;;) {
        int busy = 0;
        for (int q = 0; q < a->size && !busy; q++) {
            if (q == a->rank) continue;
            uint64_t eq = ddl_load_acquire_u64(a->boards[q] + DDL_A_EPOCH);
            if (eq != e || ddl_load_acquire_u32(a->boards[q] + DDL_A_ABORT_CODE)) continue;
            if (a->pidfds[q] >= 0) {
                struct pollfd fd = {a->pidfds[q], POLLIN, 0};
                if (poll(&fd, 1, 0) > 0) continue;
            }
            busy = 1;
        }
        if (!busy) {
            a->exposed = 0;
            return 1;
        }
        if (ddl_now_ns() >= deadline_ns) return 0;
        sched_yield();
    }
}

/* Tell the peers we failed (or closed): their waits end with DDL_A_ABORTED naming us. */
static inline void ddl_arena_abort(ddl_arena *a, uint32_t code, const uint8_t *reason,
                                   uint32_t len) {
    uint8_t *me = a->boards[a->rank];
    if (ddl_load_acquire_u32(me + DDL_A_ABORT_CODE)) return;  /* first note wins */
    if (len > 1024) len = 1024;
    memcpy(me + DDL_A_ABORT, reason, len);
    ddl_store_release_u32(me + DDL_A_ABORT_LEN, len);
    ddl_store_release_u32(me + DDL_A_ABORT_CODE, code);
    for (int q = 0; q < a->size; q++)
        if (q != a->rank) ddl_bell_ring(a->boards[q] + DDL_A_BELL);
}

#endif
