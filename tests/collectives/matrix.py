"""The collective test matrix, run inside spawned ranks (see ``tests/harness.py``).

Every rank builds every rank's input from the same seed, so each can compute the NumPy reference
itself. Each case returns a digest of its result so the parent can check that every rank got
bit-identical results.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Sequence

import ml_dtypes
import numpy as np

DTYPES = [
    np.float16,
    ml_dtypes.bfloat16,
    np.float32,
    np.float64,
    np.int8,
    np.uint8,
    np.int32,
    np.int64,
]
OPS = ["sum", "avg", "prod", "min", "max"]
# 0, 1, primes, counts not divisible by 2, 3 or 4, and (with small chunks) many chunks.
COUNTS = [0, 1, 2, 3, 5, 7, 13, 31, 101, 1009, 4099, 65537]


def few_simulator_threads() -> None:
    """On Numba's CUDA simulator (a no-op on a GPU), launch the kernels on 2 blocks of 4 threads
    instead of the library's 2 x 32. The simulator starts a Python thread per CUDA thread of
    each launch, about a millisecond each: that was most of a device collective test's time.
    For rank processes whose subject is the collectives, not the kernels' grid (which
    tests/kernels/cuda runs as the library launches it); the same grid-stride code runs, with
    every thread taking more elements."""
    from ddlcore.kernels.cuda import runtime

    from tests.harness import patch

    if runtime.simulated():
        patch(runtime, "SIMULATOR_THREADS", 4)
        patch(runtime, "SIMULATOR_MAX_BLOCKS", 2)


def random_input(dtype, count: int, rank: int, seed: int, op: str) -> np.ndarray:
    """Random, never all-zero data; for prod, magnitudes near 1 keep floats in range. A fresh
    (writable) copy of `_random_input`'s array."""
    return _random_input(np.dtype(dtype), count, rank, seed, op == "prod").copy()


# Every rank builds every rank's input, and the ops of one case share theirs (all but prod): a
# copy is far cheaper than the generator (half the CPU time of the large-count tests). 24 arrays
# hold two ops' inputs of 8 ranks and then some.
@functools.lru_cache(maxsize=24)
def _random_input(dt: np.dtype, count: int, rank: int, seed: int, prod: bool) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, count])
    if dt.kind in "iu":
        info = np.iinfo(dt)
        x = rng.integers(info.min, info.max, count, dtype=dt, endpoint=True)
    elif prod:
        mag = rng.uniform(0.5, 1.5, count)
        x = (mag * rng.choice([-1.0, 1.0], count)).astype(dt)
    else:
        x = rng.uniform(-1.0, 1.0, count).astype(dt)
    x.setflags(write=False)
    return x


def expected(xs: Sequence[np.ndarray], op: str) -> np.ndarray:
    """``reference.reduce_ref(xs, op)``, with the integer avg (the exact mean rounded down) in
    64-bit NumPy instead of the reference's Python integers (a third of the CPU time of the
    large-count tests): with ``x = n*q + r``, ``floor(sum(x) / n) = sum(q) + sum(r) // n``,
    which 64-bit arithmetic gets exactly even where ``sum(q)`` wraps on the way (the result is
    in the dtype's range, so it is the one value congruent to it modulo 2**64)."""
    from ddlcore.kernels import reference

    dt = np.asarray(xs[0]).dtype if len(xs) else None
    if op != "avg" or dt is None or dt.kind not in "iu":
        return reference.reduce_ref(xs, op)
    wide = np.uint64 if dt.kind == "u" else np.int64
    n = wide(len(xs))
    q, r = np.zeros(np.shape(xs[0]), wide), np.zeros(np.shape(xs[0]), wide)
    with np.errstate(over="ignore"):
        for x in xs:
            x = np.asarray(x).astype(wide)
            q += x // n
            r += x % n
        return (q + r // n).astype(dt)


def tolerance(dtype, op: str, size: int) -> tuple[float, float]:
    dt = np.dtype(dtype)
    if dt.kind in "iu" or op in ("min", "max"):
        return 0.0, 0.0
    eps = float(ml_dtypes.finfo(dt).eps)
    return 4 * size * eps, 4 * size * eps  # (rtol, atol): ring order differs from the oracle's


def digest(arr) -> str:
    return hashlib.sha1(np.ascontiguousarray(arr).view(np.uint8)).hexdigest()[:16]


def check_close(got: np.ndarray, want: np.ndarray, dtype, op: str, size: int, what: str) -> None:
    rtol, atol = tolerance(dtype, op, size)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if rtol == 0:
        ok = np.array_equal(got.view(np.uint8), want.view(np.uint8)) if got.size else True
    else:
        ok = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol)
    if not ok:
        bad = np.flatnonzero(got.astype(np.float64) != want.astype(np.float64))[:5]
        raise AssertionError(
            f"{what}: wrong at {bad.tolist()}: got {got.ravel()[bad]}, want {want.ravel()[bad]}"
        )


def allreduce_both_ways(comm, dtype, count: int, op: str) -> str:
    """Allreduce random inputs out of place and in place; check both against the reference and
    against each other (same bits); return the result's digest."""
    rank, size = comm.rank, comm.size
    xs = [_random_input(np.dtype(dtype), count, r, count, op == "prod") for r in range(size)]
    want = expected(xs, op)
    case = f"{np.dtype(dtype).name} {op} count={count}"
    got = comm.allreduce(xs[rank].copy(), op=op)
    check_close(got, want, dtype, op, size, f"rank {rank}: {case}")
    inplace = xs[rank].copy()
    assert comm.allreduce(inplace, op=op, out=inplace) is inplace
    check_close(inplace, want, dtype, op, size, f"rank {rank}: in place {case}")
    assert digest(inplace) == digest(got), case
    return digest(got)


COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast")
# The thin slice, for transports whose schedules the full matrix already proves over another
# transport: every dtype (sum), every op (float32), counts 0, 1, a prime, and many small chunks.
THIN_COUNTS = [0, 1, 13, 1009, 4099]
# Above this count the full matrix takes the thin slice's ops too: every op meets every dtype at
# the smaller counts already, and what a large count adds (thousands of chunks, every dtype's
# element size) does not depend on the op; the largest count was 70% of a TCP world's time.
FULL_OPS_UP_TO = 4099


def _cases(collective: str, counts: list[int], thin: bool):
    for dtype in DTYPES:
        for count in counts:
            ops = OPS if collective in ("allreduce", "reduce_scatter") else [None]
            for op in ops:
                thin_here = thin or count > FULL_OPS_UP_TO
                if thin_here and op not in (None, "sum") and dtype is not np.float32:
                    continue
                yield dtype, count, op


def run_matrix(
    rank: int, size: int, collective: str | Sequence[str], seed: int = 0, thin: bool = False
) -> dict[str, str]:
    """Run each collective named over dtype x op x count (the thin slice if ``thin``) in one
    communicator; return {case: digest of this rank's result}."""
    import ddlcore

    digests: dict[str, str] = {}
    collectives = [collective] if isinstance(collective, str) else list(collective)
    counts = [int(c) for c in os.environ.get("MATRIX_COUNTS", "").split(",") if c] or (
        THIN_COUNTS if thin else COUNTS
    )
    with ddlcore.init() as comm:
        assert (comm.rank, comm.size) == (rank, size)
        for collective in collectives:
            for dtype, count, op in _cases(collective, counts, thin):
                case = f"{collective} {np.dtype(dtype).name} {op} count={count}"
                n = count * size if collective == "reduce_scatter" else count
                xs = [_random_input(np.dtype(dtype), n, r, seed, op == "prod") for r in range(size)]
                x = xs[rank].copy()
                if collective == "allreduce":
                    got = comm.allreduce(x, op=op)
                    want = expected(xs, op)
                elif collective == "reduce_scatter":
                    got = comm.reduce_scatter(x, op=op)
                    want = expected(xs, op)[rank * count : (rank + 1) * count]
                elif collective == "allgather":
                    got = comm.allgather(x)
                    want = np.concatenate(xs)
                else:
                    root = (count + 1) % size
                    got = comm.broadcast(x, root=root)
                    assert got is x
                    want = xs[root]
                    case += f" root={root}"
                if collective != "broadcast":  # out-of-place: the input is untouched
                    np.testing.assert_array_equal(x, xs[rank])
                check_close(got, want, dtype, op or "sum", size, f"rank {rank}: {case}")
                digests[case] = digest(got)
    return digests
