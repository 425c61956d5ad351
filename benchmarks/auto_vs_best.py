"""Does ``auto`` pick well? Every candidate the tuner weighs, simulated, against auto's choice.

For each box up to 256 GPUs (the paper's links: hosts of 4 GPUs at 20 GB/s, 10 GB/s in a rack, 9.5 GB/s across
racks, one network adapter per host) and allreduce size, every candidate of
`ddlcore.planning.tuning.candidates` (ring, rhd, rd, and mdring in every dimension order with its
pipelined segment count), and mdring in auto's order in every other segment count (of at least
one chunk), runs in the simulator; the table gives auto's simulated time over the best
candidate's. Candidates over the simulator's step budget are left out and counted.

    python benchmarks/auto_vs_best.py [--json benchmarks/results/auto_vs_best.json]
    python benchmarks/auto_vs_best.py --boxes 4x64x4,4x64x16 --json benchmarks/results/auto_vs_best_large.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ddlcore import config, simulate, topology
from ddlcore.planning import tuning

BW = (20e9, 10e9, 9.5e9)
LAT = (5e-6, 10e-6, 20e-6)
BOXES = [(4, 1, 1), (4, 2, 1), (4, 4, 1), (4, 8, 1), (4, 16, 1), (4, 16, 2), (4, 16, 4)]
SIZES = [4 << 10, 256 << 10, 4 << 20, 64 << 20, 1 << 30]
MAX_STEPS = 4_000_000


def point(dims: tuple[int, ...], nbytes: int, max_steps: int = MAX_STEPS) -> dict:
    topo = topology.box(dims, BW, LAT)
    auto = tuning.choose("allreduce", topo, nbytes, "auto", simulate.DEFAULT_CHUNK_BYTES)
    times: dict[str, float] = {}
    skipped = 0
    tried = tuning.candidates("allreduce", topo, nbytes, chunk_bytes=simulate.DEFAULT_CHUNK_BYTES)
    if auto.dim_order is not None:  # auto's order in every segment count, not only its own
        tried += [
            dataclasses.replace(auto, segments=s)
            for s in tuning.SEGMENT_COUNTS
            if s != auto.segments and nbytes / s >= simulate.DEFAULT_CHUNK_BYTES
        ]
    for c in tried:
        name = c.algorithm + (
            f"[{','.join(map(str, c.dim_order))}]x{c.segments}" if c.dim_order is not None else ""
        )
        if name in times:
            continue
        try:
            prog = simulate.compile_program(
                "allreduce",
                c.algorithm,
                topo,
                nbytes,
                dim_order=c.dim_order,
                max_steps=max_steps,
                segments=c.segments,
            )
        except simulate.TooLargeToSimulate:
            skipped += 1
            continue
        times[name] = simulate.execute(prog, topo)[0]
    mine = auto.algorithm + (
        f"[{','.join(map(str, auto.dim_order))}]x{auto.segments}"
        if auto.dim_order is not None
        else ""
    )
    best = min(times, key=times.__getitem__) if times else None
    return {
        "box": topo.shape,
        "ranks": topo.size,
        "bytes": nbytes,
        "auto": mine,
        "auto_s": times.get(mine),
        "best": best,
        "best_s": times[best] if best else None,
        "ratio": times[mine] / times[best] if mine in times else None,
        "candidates": times,
        "skipped": skipped,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--boxes", help="these boxes instead, e.g. 4x64x4,4x64x16")
    p.add_argument(
        "--max-steps",
        type=float,
        default=MAX_STEPS,
        help="a candidate with more steps is left out (and counted)",
    )
    a = p.parse_args(argv)
    boxes = [config.parse_dims(b) for b in a.boxes.split(",")] if a.boxes else BOXES
    command = " ".join(
        [
            "python benchmarks/auto_vs_best.py",
            *(["--boxes", a.boxes] if a.boxes else []),
            *([f"--max-steps {a.max_steps:g}"] if a.max_steps != MAX_STEPS else []),
            *(["--json", a.json] if a.json else []),
        ]
    )
    rows = []
    print("| GPUs | box | bytes | auto | best | auto / best | left out |")
    print("|---:|---|---:|---|---|---:|---:|")
    for dims in boxes:
        for nbytes in SIZES:
            r = point(dims, nbytes, int(a.max_steps))
            rows.append(r)
            if a.json:  # long sweeps keep what they finished
                with open(a.json, "w") as f:
                    json.dump({"command": command, "rows": rows}, f, indent=1)
            ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "auto not simulated"
            print(
                f"| {r['ranks']} | {r['box']} | {nbytes} | {r['auto']} | {r['best']} | "
                f"{ratio} | {r['skipped']} |",
                flush=True,
            )
    judged = [r for r in rows if r["ratio"] is not None]
    if judged:
        worst = max(judged, key=lambda r: r["ratio"])
        print(
            f"\nworst: auto at {worst['ratio']:.3f}x the best candidate ({worst['box']}, "
            f"{worst['bytes']} bytes)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
