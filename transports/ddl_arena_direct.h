/* The boards' path for large messages (see ddl_arena.h for the protocol): rank r reduces slice
 * r of the result, reading it out of every rank's input with process_vm_readv chunk by chunk,
 * and writes each reduced chunk, still in cache, into every rank's output with
 * process_vm_writev; two sync points per call. */
#ifndef DDL_ARENA_DIRECT_H
#define DDL_ARENA_DIRECT_H

#include "ddl_arena.h"

/* --- large messages: direct reads out of the peers' buffers ------------------------------ */

static inline int ddl_arena_read(ddl_arena *a, int q, uint64_t remote, uint8_t *local,
                                 uint64_t n) {
    if (!n) return DDL_A_OK;
    int st = ddl_arena_check_notes(a);
    if (st != DDL_A_OK) return st;
    int64_t rc = ddl_cma_read(a->pids[q], remote, local, n);
    if (rc == 0) return DDL_A_OK;
    a->bad_rank = q;
    a->err = rc;
    return rc == -ESRCH ? DDL_A_DEAD : DDL_A_CMA_FAILED;
}

static inline int ddl_arena_write(ddl_arena *a, int q, uint64_t remote, const uint8_t *local,
                                  uint64_t n) {
    if (!n) return DDL_A_OK;
    int64_t rc = ddl_cma_write(a->pids[q], remote, local, n);
    if (rc == 0) return DDL_A_OK;
    a->bad_rank = q;
    a->err = rc;
    return rc == -ESRCH ? DDL_A_DEAD : DDL_A_CMA_FAILED;
}

/* Operand q of the chunk at byte offset boff of every rank's input: our own memory, or the
 * peer's read into a staging buffer. */
static inline int ddl_operand(ddl_arena *a, const ddl_call *c, const uint64_t *ins, int q,
                              uint64_t boff, uint64_t nb, int which, const uint8_t **p) {
    if (q == a->rank) {
        /* Our input chunk may be the output chunk (in place), overwritten by the operands
         * before ours: ddl_reduce_direct saved it in temp[2]. */
        *p = a->saved ? a->temp[2] : c->in + boff;
        return DDL_A_OK;
    }
    *p = a->temp[which];
    return ddl_arena_read(a, q, ins[q] + boff, a->temp[which], nb);
}

/* out[o:o+n] = in_0[i:i+n] OP in_1[i:i+n] OP ... in rank order, chunk by chunk; ``i`` and
 * ``o`` are element offsets into the inputs and into our output. With ``outs``, each reduced
 * chunk, still in cache, is also written to the same place in every peer's output. */
static inline int ddl_reduce_direct(ddl_arena *a, const ddl_call *c, const uint64_t *ins,
                                    const uint64_t *outs, int64_t i, int64_t n, int64_t o) {
    int64_t step = (int64_t)(a->chunk / (uint64_t)c->itemsize);
    if (step < 1) step = 1;
    for (int64_t done = 0; done < n; done += step) {
        int64_t m = n - done < step ? n - done : step;
        uint64_t boff = (uint64_t)(i + done) * c->itemsize, nb = (uint64_t)m * c->itemsize;
        uint8_t *dst = c->out + (uint64_t)(o + done) * c->itemsize;
        const uint8_t *x, *y;
        int st = ddl_arena_check_notes(a);
        if (st != DDL_A_OK) return st;
        a->saved = a->rank >= 2 && c->in + boff == dst;
        if (a->saved) memcpy(a->temp[2], dst, nb);
        st = ddl_operand(a, c, ins, 0, boff, nb, 0, &x);
        if (st == DDL_A_OK) st = ddl_operand(a, c, ins, 1, boff, nb, 1, &y);
        if (st != DDL_A_OK) return st;
        ddl_reduce(dst, x, y, m, c->dtype, c->op);
        for (int q = 2; q < a->size; q++) {
            if ((st = ddl_operand(a, c, ins, q, boff, nb, 0, &y)) != DDL_A_OK) return st;
            ddl_reduce(dst, dst, y, m, c->dtype, c->op);
        }
        if (c->divisor) ddl_divide(dst, m, c->dtype, c->divisor);
        if (outs)
            for (int q = 0; q < a->size; q++)
                if (q != a->rank && (st = ddl_arena_write(a, q, outs[q] + (uint64_t)(o + done) *
                                                          c->itemsize, dst, nb)) != DDL_A_OK)
                    return st;
    }
    return DDL_A_OK;
}

static inline int ddl_arena_direct(ddl_arena *a, const ddl_call *c) {
    uint64_t ins[DDL_ARENA_MAX], outs[DDL_ARENA_MAX];
    uint64_t nbytes = (uint64_t)c->count * (uint64_t)c->itemsize;
    a->exposed = a->epoch + 1;  /* peers may touch our buffers from this sync on */
    int st = ddl_arena_sync(a, c, c->in, c->out);
    if (st != DDL_A_OK) return st;
    for (int q = 0; q < a->size; q++) {
        const uint8_t *ent = ddl_entry(a, q, a->epoch);
        ins[q] = ddl_get_u64(ent + DDL_E_IN);
        outs[q] = ddl_get_u64(ent + DDL_E_OUT);
    }
    int64_t off, len;
    switch (c->kind) {
    case DDL_K_ALLREDUCE:
        /* Slice r of the result is reduced by rank r alone, which reads slice r of every input
         * and writes the result into every output: no other rank touches slice r anywhere, so
         * in place is safe, and each byte of the result is written once per rank. */
        ddl_part(c->count, a->size, a->rank, &off, &len);
        if ((st = ddl_reduce_direct(a, c, ins, outs, off, len, off)) != DDL_A_OK) return st;
        break;
    case DDL_K_REDUCE_SCATTER: {
        int64_t k = c->count / a->size;
        if ((st = ddl_reduce_direct(a, c, ins, NULL, a->rank * k, k, 0)) != DDL_A_OK) return st;
        break;
    }
    case DDL_K_RS_PART:
        /* As allreduce, without writing into the peers' outputs. */
        ddl_part(c->count, a->size, a->rank, &off, &len);
        if ((st = ddl_reduce_direct(a, c, ins, NULL, off, len, off)) != DDL_A_OK) return st;
        break;
    case DDL_K_AG_PART:
        /* Part q of rank q's output is final and nobody writes it during this call. */
        for (int q = 0; q < a->size; q++) {
            ddl_part(c->count, a->size, q, &off, &len);
            if (q != a->rank &&
                (st = ddl_arena_read(a, q, outs[q] + (uint64_t)(off * c->itemsize),
                                     c->out + off * c->itemsize,
                                     (uint64_t)(len * c->itemsize))) != DDL_A_OK)
                return st;
        }
        break;
    case DDL_K_ALLGATHER:
        for (int q = 0; q < a->size; q++) {
            if (q == a->rank) {
                if (nbytes && c->out + q * nbytes != c->in)
                    memmove(c->out + q * nbytes, c->in, nbytes);
                continue;
            }
            if ((st = ddl_arena_read(a, q, ins[q], c->out + q * nbytes, nbytes)) != DDL_A_OK)
                return st;
        }
        break;
    case DDL_K_BROADCAST:
        if (a->rank != c->root &&
            (st = ddl_arena_read(a, c->root, ins[c->root], c->out, nbytes)) != DDL_A_OK)
            return st;
        break;
    default:
        return DDL_A_BAD_ARGS;
    }
    /* Nobody may return (and reuse its buffers) before every peer has finished with them. */
    st = ddl_arena_sync(a, c, NULL, NULL);
    if (st == DDL_A_OK) a->exposed = 0;
    return st;
}

#endif
