"""GPU kernel throughput: reduce-copy per dtype against the device's own copy bandwidth.

    python benchmarks/bench_cuda.py [--mib 256] [--reps 20] [--json out.json]

For each dtype, ``reduce_copy(a, a, b)`` (a = a + b) on two device buffers of ``--mib`` MiB, in
GB/s counting two reads and one write, next to a device-to-device copy (one read, one write) of
the same buffer; timed with CUDA events, best of ``--reps`` after warm-up. Needs a GPU.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main() -> None:
    from ddlcore.kernels import cuda as kcuda
    from numba import cuda

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    def best_ms(fn) -> float:
        fn()
        cuda.synchronize()
        best = float("inf")
        for _ in range(args.reps):
            start, stop = cuda.event(), cuda.event()
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            best = min(best, cuda.event_elapsed_time(start, stop))
        return best

    nbytes = args.mib << 20
    name = cuda.get_current_device().name
    name = name.decode() if isinstance(name, bytes) else name
    print(f"# {name}: {args.mib} MiB buffers, best of {args.reps}")
    src = cuda.device_array(nbytes, np.uint8)
    dst = cuda.device_array(nbytes, np.uint8)
    copy_ms = best_ms(lambda: dst.copy_to_device(src))
    copy_gbps = 2 * nbytes / copy_ms / 1e6
    print(f"device copy: {copy_gbps:.0f} GB/s (read + write)")
    rows = {"copy_GBps": copy_gbps, "reduce": {}}
    print(f"{'dtype':9s} {'reduce GB/s':>12s} {'of copy':>8s}")
    for dt in kcuda.DTYPES:
        count = nbytes // np.dtype(dt).itemsize
        a = cuda.to_device(np.random.default_rng(0).random(count).astype(dt))
        b = cuda.to_device(np.random.default_rng(1).random(count).astype(dt))
        ms = best_ms(lambda a=a, b=b: kcuda.reduce_copy(a, a, b, "sum"))
        gbps = 3 * nbytes / ms / 1e6
        rows["reduce"][np.dtype(dt).name] = gbps
        print(f"{np.dtype(dt).name:9s} {gbps:12.0f} {gbps / copy_gbps:8.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
