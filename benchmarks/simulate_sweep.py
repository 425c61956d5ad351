"""The PowerAI DDL paper's setting in the simulator: ring vs mdring vs rhd (and auto) from 4 to 4096
ranks, for ResNet-50's ~100 MB and ResNet-101-22k's ~350 MB of gradients.

Hosts of 4 GPUs (NVLink 20 GB/s, 5 us), hosts in racks (10 GB/s, 10 us), racks joined at
9.5 GB/s, 20 us. The box grows as 4x1x1, 4x2x1 ... 4x16x1 (one rack of 16 hosts), 4x16x2,
4x16x4 (the paper's 64 hosts in 4 racks, 256 GPUs), then 4x64x4 (1024) and 4x64x16 (4096: racks
of 64 hosts, 16 racks). Every point runs twice: one network adapter per host (its 4 GPUs share
it) and 4 (one per GPU, as DDL's hosts had several). Points whose schedules are over the
simulator's step budget are reported as NOT SIMULATED with the cost model's number beside them,
never as simulated.

    python benchmarks/simulate_sweep.py            # ~10-15 min on the 2-core VM
    python benchmarks/simulate_sweep.py --quick    # up to 256 ranks, ~1 min

Each point also runs at two reduction speeds: tuning.REDUCE_BW (8 GB/s, what the library's tuner
assumes, a CPU core) and 200 GB/s (a GPU's). Writes benchmarks/results/simulate_sweep.json,
simulate_sweep_cpu.png and simulate_sweep_gpu.png, and prints markdown tables.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ddlcore import config, simulate, topology
from ddlcore.planning import tuning

BW = (20e9, 10e9, 9.5e9)
LAT = (5e-6, 10e-6, 20e-6)
SIZES = {"ResNet-50 (100 MB)": 100e6, "ResNet-101-22k (350 MB)": 350e6}
BOXES = [
    (4, 1, 1),
    (4, 2, 1),
    (4, 4, 1),
    (4, 8, 1),
    (4, 16, 1),
    (4, 16, 2),
    (4, 16, 4),
    (4, 64, 4),
    (4, 64, 16),
]
ALGOS = ("ring", "mdring", "rhd", "auto")
ADAPTERS = (1, 4)
# Reduction speeds: tuning.REDUCE_BW (8 GB/s, a CPU core of this project's VM: what the library's
# tuner assumes) and a GPU's: a P100's HBM2 moves 732 GB/s, a += b touches 3 bytes per reduced
# byte, so ~240 GB/s, rounded down to 200 GB/s.
REDUCE = {"cpu": tuning.REDUCE_BW, "gpu": 200e9}
RESULTS = Path(__file__).resolve().parent / "results"


def shape(dims: tuple[int, ...]) -> str:
    return "x".join(map(str, dims))


def sweep(
    boxes: list[tuple[int, ...]],
    max_steps: int,
    reduces: dict[str, float] = REDUCE,
    saved: Callable[[list[dict]], None] = lambda rows: None,
) -> list[dict]:
    """Every box x size x adapter count x reduction speed x algorithm; ``saved`` is called with
    the rows so far after each box and size (long sweeps keep what they finished)."""
    rows: list[dict] = []
    for dims, (label, nbytes) in itertools.product(boxes, SIZES.items()):
        # Schedules do not depend on the reduction speed: compile once per adapter count here.
        programs: dict[tuple, simulate.Program | str] = {}
        for adapters, (reduce, reduce_bw), algo in itertools.product(
            ADAPTERS, reduces.items(), ALGOS
        ):
            topo = topology.box(dims, BW, LAT, adapters=adapters)
            # The choice is the library's (its tuner assumes tuning.REDUCE_BW).
            choice = tuning.choose(
                "allreduce", topo, int(nbytes), algo, simulate.DEFAULT_CHUNK_BYTES
            )
            order = choice.dim_order if choice.algorithm == "mdring" else None
            nseg = choice.segments if choice.algorithm == "mdring" else 1
            row = {
                "ranks": topo.size,
                "box": topo.shape,
                "model": label,
                "bytes": nbytes,
                "adapters": adapters,
                "reduce": reduce,
                "reduce_bw": reduce_bw,
                "algo": algo,
                "algorithm": choice.algorithm,
                "dim_order": order,
                "segments": nseg,
                "predicted_s": tuning.predict(
                    "allreduce", choice.algorithm, topo, nbytes, order, reduce_bw, segments=nseg
                ),
            }
            # mdring's streams depend on whether a host's ranks share an adapter
            key = (dims, nbytes, choice.algorithm, order, nseg, adapters)
            t0 = time.process_time()
            if key not in programs:
                try:
                    programs[key] = simulate.compile_program(
                        "allreduce",
                        choice.algorithm,
                        topo,
                        nbytes,
                        dim_order=order,
                        max_steps=max_steps,
                        segments=nseg,
                    )
                except simulate.TooLargeToSimulate as exc:
                    programs[key] = str(exc)
            prog = programs[key]
            if isinstance(prog, str):
                row.update(simulated=False, time_s=None, reason=prog)
            else:
                res = simulate.simulate(
                    "allreduce",
                    choice.algorithm,
                    topo,
                    nbytes,
                    dim_order=order,
                    reduce_bw=reduce_bw,
                    program=prog,
                )
                row.update(
                    simulated=True,
                    time_s=res.time_s,
                    busbw=res.busbw,
                    steps=res.steps,
                    dims=[d.__dict__ for d in res.dims],
                )
            row["cpu_s"] = time.process_time() - t0
            rows.append(row)
            done = f"{row['time_s'] * 1e3:9.3f} ms" if row["simulated"] else "NOT SIMULATED"
            print(
                f"{topo.shape:>8} {label:<24} adapters={adapters} {reduce} {algo:<6} -> "
                f"{choice.algorithm:<6} {done}  (model {row['predicted_s'] * 1e3:.3f} ms, "
                f"{row['cpu_s']:.1f} s cpu)",
                file=sys.stderr,
                flush=True,
            )
        saved(rows)
    return rows


# The paper (Cho et al. 2017, PowerAI DDL) at 256 GPUs: ResNet-50's ~100 MB of gradients cost
# 23 ms of communication overhead; ResNet-101's ~350 MB reduced in under 100 ms.
PAPER_MS = {("ResNet-50 (100 MB)", 256): "23", ("ResNet-101-22k (350 MB)", 256): "< 100"}


def network_bound(dims: tuple[int, ...], nbytes: float) -> float:
    """Seconds each host's adapter needs at least: 2 (H-1)/H n through 10 GB/s (one host:
    the NVLink ring's 2 (P-1)/P n at 20 GB/s)."""
    hosts = math.prod(dims[1:])
    if hosts == 1:
        return 2 * (dims[0] - 1) / dims[0] * nbytes / BW[0]
    return 2 * (hosts - 1) / hosts * nbytes / BW[1]


def paper_table(rows: list[dict]) -> str:
    """auto (one adapter per host, 8 GB/s reductions) beside the bound and the paper."""
    out = [
        "\n| GPUs | box | "
        + " | ".join(f"{label}: auto ms | % of bound | paper ms" for label in SIZES)
        + " |",
        "|---:|---|" + "---:|---:|---:|" * len(SIZES),
    ]
    sel = [r for r in rows if r["algo"] == "auto" and r["adapters"] == 1 and r["reduce"] == "cpu"]
    for ranks in sorted({r["ranks"] for r in sel}):
        cells = []
        for label, nbytes in SIZES.items():
            r = next(x for x in sel if x["ranks"] == ranks and x["bytes"] == nbytes)
            dims = tuple(int(d) for d in r["box"].split("x"))
            if r["simulated"]:
                pct = f"{network_bound(dims, nbytes) / r['time_s'] * 100:.0f}%"
                cells.append(f"{r['time_s'] * 1e3:.1f} | {pct}")
            else:
                cells.append("not simulated | ")
            cells.append(PAPER_MS.get((label, ranks), ""))
        out.append(f"| {ranks} | {r['box']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def cell(row: dict) -> str:
    model = f"{row['predicted_s'] * 1e3:.1f}"
    name = f"{row['algorithm']} " if row["algo"] == "auto" else ""
    if not row["simulated"]:
        return f"{name}not simulated (model {model})"
    return f"{name}**{row['time_s'] * 1e3:.1f}** ({model})"


REDUCE_LABEL = {"cpu": "reduction 8 GB/s (tuning.REDUCE_BW)", "gpu": "reduction 200 GB/s (GPU)"}


def tables(rows: list[dict], reduce: str) -> str:
    out = []
    for adapters, (label, nbytes) in itertools.product(ADAPTERS, SIZES.items()):
        sel = [
            r
            for r in rows
            if r["adapters"] == adapters and r["bytes"] == nbytes and r["reduce"] == reduce
        ]
        out.append(
            f"\n**{label}, {adapters} network adapter(s) per host, "
            f"{REDUCE_LABEL[reduce]}**: allreduce ms, simulated in **bold**, the cost "
            "model's prediction in parentheses; auto names its choice\n"
        )
        out.append("| ranks | box | " + " | ".join(ALGOS) + " |")
        out.append("|---:|---|" + "---|" * len(ALGOS))
        for ranks in sorted({r["ranks"] for r in sel}):
            by = {r["algo"]: r for r in sel if r["ranks"] == ranks}
            out.append(
                f"| {ranks} | {by['ring']['box']} | "
                + " | ".join(cell(by[a]) for a in ALGOS)
                + " |"
            )
    return "\n".join(out)


def bytes_table(rows: list[dict], ranks: int = 256, nbytes: float = 100e6) -> str:
    """Per dimension at the paper's scale: what each algorithm moves and how busy the ports are."""
    out = [
        f"\n**Per dimension at {ranks} ranks, {nbytes / 1e6:g} MB**: MB sent by the busiest "
        "rank / ms the busiest port of that dimension was busy (independent of the reduction "
        "speed)\n",
        "| adapters | algorithm | host (NVLink) | in-rack | cross-rack "
        "| time ms (8 / 200 GB/s reduction) |",
        "|---:|---|---|---|---|---:|",
    ]
    for r in rows:
        if (
            r["ranks"] == ranks
            and r["bytes"] == nbytes
            and r["algo"] != "auto"
            and r["simulated"]
            and r["reduce"] == "cpu"
        ):
            gpu = next(
                (
                    g
                    for g in rows
                    if g["reduce"] == "gpu"
                    and all(g[f] == r[f] for f in ("ranks", "bytes", "algo", "adapters"))
                ),
                None,
            )
            dims = " | ".join(
                f"{d['bytes_per_rank'] / 1e6:.1f} / {d['busy_s'] * 1e3:.2f}" for d in r["dims"]
            )
            on_gpu = f"{gpu['time_s'] * 1e3:.1f}" if gpu else "-"
            out.append(
                f"| {r['adapters']} | {r['algorithm']} | {dims} | "
                f"{r['time_s'] * 1e3:.1f} / {on_gpu} |"
            )
    return "\n".join(out)


def plot(rows: list[dict], reduce: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(ADAPTERS), len(SIZES), figsize=(12, 9), sharex=True, squeeze=False)
    colors = {"ring": "tab:red", "mdring": "tab:blue", "rhd": "tab:green", "auto": "black"}
    for (i, adapters), (j, (label, nbytes)) in itertools.product(
        enumerate(ADAPTERS), enumerate(SIZES.items())
    ):
        ax = axes[i][j]
        for algo in ALGOS:
            sel = sorted(
                (
                    r
                    for r in rows
                    if r["adapters"] == adapters
                    and r["bytes"] == nbytes
                    and r["algo"] == algo
                    and r["reduce"] == reduce
                ),
                key=lambda r: r["ranks"],
            )
            sim = [(r["ranks"], r["time_s"] * 1e3) for r in sel if r["simulated"]]
            auto = algo == "auto"
            ax.plot(
                [x for x, _ in sim],
                [y for _, y in sim],
                marker="x" if auto else "o",
                ms=5,
                color=colors[algo],
                lw=1 if auto else 2,
                ls=":" if auto else "-",
                label=f"{algo} (simulated)",
            )
            skipped = [(r["ranks"], r["predicted_s"] * 1e3) for r in sel if not r["simulated"]]
            if skipped:  # no line to them: they are tuning.predict's numbers, not simulated
                ax.plot(
                    [x for x, _ in skipped],
                    [y for _, y in skipped],
                    marker="o",
                    mfc="none",
                    ls="none",
                    color=colors[algo],
                    ms=8,
                    label=f"{algo}: NOT simulated, tuning.predict only",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{label}, {adapters} adapter(s)/host", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        if i == len(ADAPTERS) - 1:
            ax.set_xlabel("ranks (GPUs), 4 per host")
        if j == 0:
            ax.set_ylabel("allreduce time (ms)")
        ax.legend(fontsize=7)
    fig.suptitle(
        "ddlcore.simulate: allreduce on 4-GPU hosts, NVLink 20 GB/s, in-rack 10 GB/s, "
        f"cross-rack 9.5 GB/s; {REDUCE_LABEL[reduce]}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="only up to 256 ranks")
    p.add_argument("--max-steps", type=float, default=simulate.MAX_STEPS)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--boxes",
        help="only these boxes, e.g. 4x64x4,4x64x16 (written to simulate_sweep_boxes.json)",
    )
    p.add_argument("--reduce", choices=sorted(REDUCE), help="only this reduction speed")
    p.add_argument(
        "--replot",
        action="store_true",
        help="redraw the plots and tables from the JSON of an earlier run",
    )
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    stem = (
        "simulate_sweep_boxes"
        if a.boxes
        else "simulate_sweep_quick"
        if a.quick
        else "simulate_sweep"
    )
    reduces = {a.reduce: REDUCE[a.reduce]} if a.reduce else REDUCE
    if a.replot:
        rows = json.loads((a.out / f"{stem}.json").read_text())["rows"]
        reduces = {r["reduce"]: r["reduce_bw"] for r in rows}
    else:
        boxes = (
            [config.parse_dims(b) for b in a.boxes.split(",")]
            if a.boxes
            else [b for b in BOXES if math.prod(b) <= 256]
            if a.quick
            else BOXES
        )
        meta = {
            "command": " ".join(["python benchmarks/simulate_sweep.py", *(argv or sys.argv[1:])]),
            "link_bw": BW,
            "link_lat": LAT,
            "reduce_bw": reduces,
            "itemsize": 4,
            "chunk_bytes": simulate.DEFAULT_CHUNK_BYTES,
            "max_steps": int(a.max_steps),
        }

        def save(rows: list[dict]) -> None:
            (a.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

        rows = sweep(boxes, int(a.max_steps), reduces, save)
    for reduce in reduces:
        plot(rows, reduce, a.out / f"{stem}_{reduce}.png")
        print(tables(rows, reduce))
    print(bytes_table(rows))
    print(
        "\n**The paper's cluster**: auto, one adapter per host; % of bound = the per-host "
        "network bound 2 (H-1)/H n / 10 GB/s over the simulated time" + paper_table(rows)
    )
    print(
        f"\n{'read' if a.replot else 'wrote'} {a.out / stem}.json; wrote {stem}_cpu.png and "
        f"{stem}_gpu.png",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
