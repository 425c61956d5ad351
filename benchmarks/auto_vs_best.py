"""Does ``auto`` pick well? Every candidate the tuner weighs, simulated, against auto's choice.

For each box up to 256 GPUs (the paper's links: hosts of 4 GPUs at 20 GB/s, 10 GB/s in a rack, 9.5 GB/s across
racks, one network adapter per host) and allreduce size, every candidate of
`ddlcore.tuning.candidates` (ring, rhd, rd, and mdring in every dimension order with its
pipelined segment count) runs in the simulator; the table gives auto's simulated time over the
best candidate's. Candidates over the simulator's step budget are left out and counted.

    python benchmarks/auto_vs_best.py [--json benchmarks/results/auto_vs_best.json]
"""

from __future__ import annotations

import argparse
import json
import sys

from ddlcore import simulate, topology, tuning

BW = (20e9, 10e9, 9.5e9)
LAT = (5e-6, 10e-6, 20e-6)
BOXES = [(4, 1, 1), (4, 2, 1), (4, 4, 1), (4, 8, 1), (4, 16, 1), (4, 16, 2), (4, 16, 4)]
SIZES = [4 << 10, 256 << 10, 4 << 20, 64 << 20, 1 << 30]
MAX_STEPS = 4_000_000


def point(dims: tuple[int, ...], nbytes: int) -> dict:
    topo = topology.box(dims, BW, LAT)
    auto = tuning.choose("allreduce", topo, nbytes, "auto", simulate.DEFAULT_CHUNK_BYTES)
    times: dict[str, float] = {}
    skipped = 0
    for c in tuning.candidates("allreduce", topo, nbytes):
        name = c.algorithm + (f"[{','.join(map(str, c.dim_order))}]x{c.segments}"
                              if c.dim_order is not None else "")
        try:
            prog = simulate.compile_program("allreduce", c.algorithm, topo, nbytes,
                                            dim_order=c.dim_order, max_steps=MAX_STEPS,
                                            segments=c.segments)
        except simulate.TooLargeToSimulate:
            skipped += 1
            continue
        times[name] = simulate.execute(prog, topo)[0]
    mine = auto.algorithm + (f"[{','.join(map(str, auto.dim_order))}]x{auto.segments}"
                             if auto.dim_order is not None else "")
    best = min(times, key=times.__getitem__)
    return {"box": topo.shape, "ranks": topo.size, "bytes": nbytes, "auto": mine,
            "auto_s": times.get(mine), "best": best, "best_s": times[best],
            "ratio": times[mine] / times[best] if mine in times else None,
            "candidates": times, "skipped": skipped}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    rows = []
    print("| GPUs | box | bytes | auto | best | auto / best | left out |")
    print("|---:|---|---:|---|---|---:|---:|")
    for dims in BOXES:
        for nbytes in SIZES:
            r = point(dims, nbytes)
            rows.append(r)
            ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "auto not simulated"
            print(f"| {r['ranks']} | {r['box']} | {nbytes} | {r['auto']} | {r['best']} | "
                  f"{ratio} | {r['skipped']} |", flush=True)
    worst = max((r for r in rows if r["ratio"] is not None), key=lambda r: r["ratio"])
    print(f"\nworst: auto at {worst['ratio']:.3f}x the best candidate ({worst['box']}, "
          f"{worst['bytes']} bytes)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python benchmarks/auto_vs_best.py", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
