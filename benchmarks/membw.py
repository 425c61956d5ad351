"""Host memory bandwidth, the physical reference for collectives on one host.

    python benchmarks/membw.py [--mib 64] [--reps 20]

Prints GB/s for a copy (dst = src: reads n, writes n bytes) and for a += b (reads 2n, writes n),
counting bytes read plus written, best of ``--reps`` after warm-up; single-threaded, as one rank
of a collective is.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def best_seconds(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(nbytes: int, reps: int) -> dict[str, float]:
    n = nbytes // 4
    a = np.random.default_rng(0).random(n, np.float32)
    b = np.random.default_rng(1).random(n, np.float32)
    c = np.empty_like(a)
    copy_s = best_seconds(lambda: np.copyto(c, a), reps)
    add_s = best_seconds(lambda: np.add(a, b, out=a), reps)
    return {"copy_GBps": 2 * nbytes / copy_s / 1e9, "add_GBps": 3 * nbytes / add_s / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    res = measure(args.mib << 20, args.reps)
    print(
        f"{args.mib} MiB: copy {res['copy_GBps']:.1f} GB/s, a+=b {res['add_GBps']:.1f} GB/s "
        "(bytes read + written)"
    )


if __name__ == "__main__":
    main()
