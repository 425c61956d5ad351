"""GPU kernel throughput, as ratios to what the device itself does.

    python benchmarks/bench_cuda.py [--mib 1,4,16,64,256] [--reps 20] [--tensors 1000]
                                    [--tensor-kib 4] [--json out.json]

1. Reduce: ``reduce_copy(a, a, b)`` (a = a + b) for every kernel dtype, bfloat16 included, on
   buffers of each ``--mib`` size, in GB/s counting bytes read + written (two reads, one write),
   next to a device-to-device copy of the same buffer (one read, one write). Timed with CUDA
   events, best of ``--reps`` after a warm-up.
2. Pack: ``--tensors`` float32 tensors of ``--tensor-kib`` KiB packed into one flat buffer by the
   fused kernel in one launch (from device arrays, and from precomputed addresses), against one
   device-to-device copy per tensor, and torch.cat / cupy.concatenate where installed with CUDA.
   Wall-clock per call up to the end of the GPU work, best of ``--reps``; the ratio is copies'
   time over the fused pack's.

Needs a GPU; says so and exits where there is none. Under Numba's simulator
(``NUMBA_ENABLE_CUDASIM=1``) it runs too, on tiny sizes (``--mib 0.002``), so the tests check
that it works end to end and that the pack it times is right; its numbers there mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import ml_dtypes
import numpy as np


def _gpu() -> Any:
    try:
        from numba import cuda
    except ImportError:
        sys.exit("bench_cuda.py needs numba-cuda (pip install 'ddlcore[cuda]') and a GPU")
    if not cuda.is_available():
        sys.exit("bench_cuda.py needs a CUDA GPU: numba.cuda.is_available() is False here")
    return cuda


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--mib",
        default="1,4,16,64,256",
        help="reduce buffer sizes, MiB (fractions allowed: 0.002 is 2 KiB)",
    )
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--tensor-kib", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cuda = _gpu()
    from ddlcore.kernels import cuda as kcuda

    from ddlcore.device import pointer_of

    def best_ms(fn) -> float:  # GPU time between two events
        fn()
        cuda.synchronize()
        best = float("inf")
        for _ in range(args.reps):
            start, stop = cuda.event(), cuda.event()
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            best = min(best, start.elapsed_time(stop))
        return best

    def best_wall_us(fn) -> float:  # host call + GPU work, as a caller sees it
        fn()
        cuda.synchronize()
        best = float("inf")
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn()
            cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best * 1e6

    name = getattr(cuda.get_current_device(), "name", "Numba CUDA simulator")
    print(f"# {name.decode() if isinstance(name, bytes) else name}, best of {args.reps}")
    rows: dict = {"reduce": {}, "pack": {}}
    rng = np.random.default_rng(0)
    names = kcuda.KERNEL_DTYPES
    print(
        f"{'MiB':>5s} {'copy GB/s':>10s} "
        + " ".join(f"{n:>9s}" for n in names)
        + "   (reduce GB/s, % of copy)"
    )
    for mib in (float(m) for m in args.mib.split(",")):
        nbytes = max(8, int(mib * (1 << 20)) // 8 * 8)  # whole elements of every dtype
        src, dst = cuda.device_array(nbytes, np.uint8), cuda.device_array(nbytes, np.uint8)
        copy_gbps = 2 * nbytes / best_ms(lambda s=src, d=dst: d.copy_to_device(s)) / 1e6
        cells, row = [], {"copy_GBps": copy_gbps}
        for dt in kcuda.DTYPES:
            n = nbytes // dt.itemsize
            host = (
                np.arange(n, dtype=dt)
                if dt.kind in "iu"
                else np.asarray(
                    rng.random(n, np.float64 if dt.itemsize == 8 else np.float32)
                ).astype(dt)
            )
            marker = "bfloat16" if dt == np.dtype(ml_dtypes.bfloat16) else None
            stored = host.view(np.uint16) if marker else host
            a, b = cuda.to_device(stored), cuda.to_device(stored)
            gbps = (
                3
                * nbytes
                / best_ms(lambda a=a, b=b, m=marker: kcuda.reduce_copy(a, a, b, "sum", dtype=m))
                / 1e6
            )
            row[dt.name] = gbps
            cells.append(f"{gbps:5.0f} {gbps / copy_gbps:3.0%}")
            del a, b
        rows["reduce"][mib] = row
        print(f"{mib:5g} {copy_gbps:10.0f} " + " ".join(f"{c:>9s}" for c in cells))

    k, count = args.tensors, (args.tensor_kib << 10) // 4
    host = rng.random((k, count)).astype(np.float32)
    tensors = [cuda.to_device(h) for h in host]
    flat = cuda.device_array(k * count, np.float32)
    addresses = [pointer_of(t) for t in tensors]
    flat_address = pointer_of(flat)
    pieces = [flat[i * count : (i + 1) * count] for i in range(k)]

    def separate() -> None:
        for piece, tensor in zip(pieces, tensors, strict=True):
            piece.copy_to_device(tensor)

    timings = {
        "fused pack (device arrays)": best_wall_us(lambda: kcuda.pack(flat, tensors)),
        "fused pack (addresses)": best_wall_us(
            lambda: kcuda.pack_addresses(flat_address, addresses, [count] * k, "float32")
        ),
        f"{k} separate copies": best_wall_us(separate),
    }
    assert np.array_equal(flat.copy_to_host(), host.reshape(-1)), "pack gave wrong bytes"
    try:
        import torch

        if torch.cuda.is_available():
            parts = [torch.from_numpy(h).cuda() for h in host]
            out = torch.empty(k * count, device="cuda")
            timings["torch.cat"] = best_wall_us(lambda: torch.cat(parts, out=out))
    except ImportError:
        pass
    try:
        import cupy

        cparts = [cupy.asarray(h) for h in host]
        timings["cupy.concatenate"] = best_wall_us(lambda: cupy.concatenate(cparts))
    except ImportError:
        pass
    fused = timings["fused pack (device arrays)"]
    print(f"\npack of {k} x {args.tensor_kib} KiB float32 tensors (us per call, ratio to fused):")
    for label, us in timings.items():
        print(f"  {label:28s} {us:10.1f} {us / fused:7.2f}x")
    rows["pack"] = timings
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
