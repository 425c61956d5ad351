"""BENCHMARKS.md, regenerated from the JSON results in benchmarks/results/.

    python benchmarks/report.py            # rewrite BENCHMARKS.md
    python benchmarks/report.py --check    # exit 1 if BENCHMARKS.md is not what the JSON gives

The prose lives in ``benchmarks/report_template.md``; every table and every number of the summary
comes from a results file, through a line ``{{ renderer file [file ...] }}`` of the template. A
benchmark that measures something new writes its JSON (each script has ``--json``), and the
template names it. Nothing here measures: it only reads.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
TEMPLATE = HERE / "report_template.md"
OUTPUT = ROOT / "BENCHMARKS.md"

sys.path.insert(0, str(HERE))
import simulate_sweep  # noqa: E402  (a sibling script: its tables are reused)

SIZE_NAMES = {1 << 10: "KB", 1 << 20: "MB", 1 << 30: "GB"}


def size_label(n: float) -> str:
    """4096 -> '4 KB', 16777216 -> '16 MB' (binary units, as ddl-bench's sizes)."""
    for unit in (1 << 30, 1 << 20, 1 << 10):
        if n >= unit and n % unit == 0:
            return f"{int(n // unit)} {SIZE_NAMES[unit]}"
    return f"{int(n)} B"


def fmt(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits}f}"


def span(lo: float, hi: float, digits: int = 1) -> str:
    """'1.7-4.4', or one number where both ends print the same."""
    a, b = f"{lo:.{digits}f}", f"{hi:.{digits}f}"
    return a if a == b else f"{a}-{b}"


def load(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def table(head: list[str], rows: Iterable[list[str]], align: str | None = None) -> str:
    """A markdown table; ``align`` holds one of 'l'/'r' per column (default: first left)."""
    align = align or "l" + "r" * (len(head) - 1)
    out = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|",
    ]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


# --- one host: ddl-bench --compare ------------------------------------------------------------


def measured_on(*docs: dict) -> str:
    """Where result files say they were measured, as a line under their table (empty when they
    do not say: the machine the Machine section names first)."""
    machines = sorted({d["cpu"] for d in docs if d.get("cpu")})
    return f"\n\nMeasured on: {'; '.join(machines)}." if machines else ""


def host_allreduce(name: str) -> str:
    """ddl-bench rows with their peers (MPI, gloo) and, when measured, the single-copy bound."""
    doc = load(name)
    bound = doc.get("single_copy_bound_busbw")
    found = {p for r in doc["rows"] for p in r.get("peers", {})}
    peers = [p for p in ("mpi", "gloo") if p in found] + sorted(found - {"mpi", "gloo"})
    head = ["size", "ddlcore busbw (GB/s)", "time (µs)"]
    for p in peers:
        head += [f"{'MPI' if p == 'mpi' else p} busbw", f"ddlcore / {'MPI' if p == 'mpi' else p}"]
    if bound:
        head.append(f"% of bound ({bound:.1f} GB/s)")
    rows = []
    for r in doc["rows"]:
        cells = [size_label(r["size"]), fmt(r["busbw"]), fmt(r["time_us"], 1)]
        for p in peers:
            theirs = r.get("peers", {}).get(p)
            cells += [
                fmt(theirs, 3 if theirs and theirs < 0.01 else 2),
                fmt(r["busbw"] / theirs if theirs else None, 2),
            ]
        if bound:
            cells.append(f"{100 * r['busbw'] / bound:.0f}")
        rows.append(cells)
    return table(head, rows) + measured_on(doc)


def host_ratio(name: str, sizes: tuple[int, ...], peer: str = "mpi") -> tuple[float, float]:
    """The smallest and largest ddlcore/peer busbw ratio at these sizes."""
    rows = [r for r in load(name)["rows"] if r["size"] in sizes]
    ratios = [r["busbw"] / r["peers"][peer] for r in rows]
    return min(ratios), max(ratios)


_PLACES = {
    "free": "where the scheduler puts them (init pinned nothing)",
    "pinned": "init's default: a CPU block per rank (here one), the busy process on any CPU",
    "bound": "ranks bound by the launcher, the busy process on any CPU",
    "spread": "one CPU per rank, the busy process on the last CPU",
    "packed": "every rank on the first CPU, the busy process on the last",
}


def _placement(doc: dict) -> str:
    """Where a latency run's processes ran: its ``--place``, or, where the run left placement
    alone, "bound" where the launcher bound the ranks and "pinned" where init did (DDL_BIND)."""
    where = doc.get("place", "free")
    if where == "free" and doc.get("bound"):
        return "bound"
    return "pinned" if where == "free" and doc.get("pinned") else where


def latency(*names: str) -> str:
    """``allreduce_loop.py --mpi`` results (latency_<size>_np<N>[_<place>]_<quiet|busy>.json):
    medians and tails of ddlcore and MPI_Allreduce in the same processes, and busy against
    quiet; a placement column where a run pinned its processes (``--place``)."""
    docs = {name: load(name) for name in names}
    placed = any(_placement(d) != "free" for d in docs.values())
    quiet = {
        (d["ranks"], _placement(d)): d["ddlcore"]["median_us"]
        for n, d in docs.items()
        if n.endswith("_quiet.json")
    }
    head = [
        "ranks",
        *(["placement"] if placed else []),
        "beside the job",
        "ddlcore median (µs)",
        "p90",
        "MPI median (µs)",
        "p90",
        "MPI / ddlcore (median)",
        "ddlcore busy / quiet",
    ]
    rows = []
    for name, d in docs.items():
        busy = name.endswith("_busy.json")
        ours, mpi = d["ddlcore"], d["mpi"]
        key = (d["ranks"], _placement(d))
        rows.append(
            [
                str(d["ranks"]),
                *([_PLACES[key[1]]] if placed else []),
                "one busy process" if busy else "nothing (quiet)",
                fmt(ours["median_us"], 1),
                fmt(ours["p90_us"], 1),
                fmt(mpi["median_us"], 1),
                fmt(mpi["p90_us"], 1),
                fmt(mpi["median_us"] / ours["median_us"]),
                fmt(ours["median_us"] / quiet[key]) if busy and key in quiet else "",
            ]
        )
    align = "l" + ("l" if placed else "") + "l" + "r" * 6
    return table(head, rows, align) + measured_on(*docs.values())


# --- point-to-point ---------------------------------------------------------------------------


def p2p(name: str) -> str:
    doc = load(name)
    systems = doc["systems"]
    head = ["bytes"]
    for s in systems:
        head += [f"{s} µs", f"{s} GB/s"]
    rows = []
    for r in doc["rows"]:
        cells = [size_label(r["bytes"])]
        for s in systems:
            t = r["one_way_s"].get(s)
            cells += [fmt(t * 1e6, 1) if t else "-", fmt(r["bytes"] / t / 1e9) if t else "-"]
        rows.append(cells)
    return f"```bash\n{doc['command']}\n```\n\n" + table(head, rows)


# --- the testbed ------------------------------------------------------------------------------


def _groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["shape"], r.get("placement", "block"), r["size"], r["algo"], r.get("adapters", 1))
        out.setdefault(key, []).append(r)
    return out


def _median(rows: list[dict]) -> float:
    return statistics.median(r["time_us"] for r in rows)


def _command(doc: dict) -> str:
    return doc["meta"]["command"]


def testbed_auto(name: str) -> str:
    """auto and the flat ring per shape, placement and size: median over repeats / link bound."""
    doc = load(name)
    g = _groups(doc["rows"])
    rows = []
    for (shape, place, size, algo, adapters), runs in g.items():
        if algo != "auto":
            continue
        t, bound = _median(runs), runs[0]["bound_us"]
        ring = g.get((shape, place, size, "ring", adapters))
        sim = runs[0].get("sim_us")
        used = "/".join(sorted({r["algorithm"] for r in runs}))
        rows.append(
            [
                shape,
                place,
                size_label(size),
                used,
                fmt(t / bound),
                fmt(_median(ring) / bound) if ring else "-",
                fmt(sim / t) if sim else "-",
            ]
        )
    return f"```bash\n{_command(doc)}\n```\n\n" + table(
        [
            "shape",
            "placement",
            "size",
            "auto ran",
            "auto / bound",
            "flat ring / bound",
            "sim / measured (auto)",
        ],
        rows,
        "lllrrrr",
    )


def testbed_schedule(pipelined: str, in_series: str) -> str:
    """The schedule path (TCP inside the hosts): pipelined vs phases in series, 1 and 2 adapters."""
    p, s = load(pipelined), load(in_series)
    gp, gs = _groups(p["rows"]), _groups(s["rows"])
    rows = []
    for key, runs in sorted(gp.items(), key=lambda kv: (kv[0][0], kv[0][4], kv[0][2])):
        shape, place, size, algo, adapters = key
        t, bound, sim = _median(runs), runs[0]["bound_us"], runs[0].get("sim_us")
        serial = gs.get(key)
        one = gp.get((shape, place, size, algo, 1)) if adapters > 1 else None
        sims = [fmt(sim / t) if sim else "-"]
        if serial and serial[0].get("sim_us"):
            sims.append(fmt(serial[0]["sim_us"] / _median(serial)))
        rows.append(
            [
                shape,
                str(adapters),
                size_label(size),
                str(runs[0].get("segments", 1)),
                f"**{fmt(t / bound)}**" if adapters == 1 else fmt(t / bound),
                fmt(_median(serial) / bound) if serial else "",
                ", ".join(sims),
                f"{_median(one) / t:.2f}x" if one else "",
            ]
        )
    return f"```bash\n{_command(p)}\n{_command(s)}\n```\n\n" + table(
        [
            "shape",
            "adapters",
            "size",
            "segments",
            "pipelined / bound",
            "phases in series / bound",
            "sim / measured (pipelined, in series)",
            "2 adapters vs 1",
        ],
        rows,
        "lrrrrrrr",
    )


def testbed_rails(name: str) -> str:
    """The default path (boards inside the hosts) with 1 and 2 adapters per host."""
    doc = load(name)
    g = _groups(doc["rows"])
    sizes = sorted({k[2] for k in g})
    rows = []
    for shape, adapters in sorted({(k[0], k[4]) for k in g}):
        cells = [shape, str(adapters)]
        vs, sims = [], []
        for size in sizes:
            runs = g.get((shape, "block", size, "mdring", adapters))
            if not runs:
                cells.append("-")
                continue
            t = _median(runs)
            cells.append(fmt(t / runs[0]["bound_us"]))
            one = g.get((shape, "block", size, "mdring", 1))
            if adapters > 1 and one:
                vs.append(f"{_median(one) / t:.2f}x")
            sim = runs[0].get("sim_us")
            sims.append(fmt(sim / t) if sim else "-")
        rows.append(cells + [" / ".join(vs), " / ".join(sims)])
    labels = " / ".join(size_label(s) for s in sizes)
    return f"```bash\n{_command(doc)}\n```\n\n" + table(
        ["shape", "adapters"]
        + [f"{size_label(s)} / bound" for s in sizes]
        + [f"2 adapters vs 1 ({labels})", f"sim / measured ({labels})"],
        rows,
        "lr" + "r" * len(sizes) + "rr",
    )


def testbed_range(name: str, algo: str) -> tuple[float, float]:
    g = _groups(load(name)["rows"])
    ratios = [_median(runs) / runs[0]["bound_us"] for k, runs in g.items() if k[3] == algo]
    return min(ratios), max(ratios)


def rails_speedups(name: str, size: int) -> dict[str, float]:
    g = _groups(load(name)["rows"])
    out = {}
    for (shape, place, sz, algo, adapters), runs in g.items():
        one = g.get((shape, place, sz, algo, 1))
        if sz == size and adapters == 2 and one:
            out[shape] = _median(one) / _median(runs)
    return out


# --- the simulator ----------------------------------------------------------------------------


def _present(names: Iterable[str]) -> list[str]:
    """The results files that exist (a long sweep's file may not yet)."""
    return [n for n in names if (RESULTS / n).exists()]


def _rows(names: Iterable[str]) -> list[dict]:
    """The rows of those of ``names`` that exist, in order."""
    return [r for n in _present(names) for r in load(n)["rows"]]


def _auto_was_best(row: dict) -> bool:
    """An auto-vs-best row where auto's choice was the simulated best (ties included)."""
    return row["ratio"] is not None and row["ratio"] <= 1.0 + 1e-9


def paper(*names: str) -> str:
    """auto beside the per-host bound and the paper, every box the sweeps simulated."""
    rows = _rows(names)
    commands = [load(n)["meta"]["command"] for n in _present(names)]
    return "```bash\n" + "\n".join(commands) + "\n```\n" + simulate_sweep.paper_table(rows)


def sweep_tables(name: str) -> str:
    return simulate_sweep.tables(load(name)["rows"], "cpu").strip()


def _paper_point(rows: list[dict], box: str, nbytes: float, adapters: int, algo: str) -> dict:
    return next(
        r
        for r in rows
        if r["box"] == box
        and r["bytes"] == nbytes
        and r["adapters"] == adapters
        and r["algo"] == algo
        and r["reduce"] == "cpu"
    )


def auto_vs_best(*names: str) -> str:
    """auto's simulated time over the best candidate's, every point of the files given."""
    docs = [load(n) for n in _present(names)]
    rows = [r for d in docs for r in d["rows"]]
    judged = [r for r in rows if r["ratio"] is not None]
    worst = max(judged, key=lambda r: r["ratio"])
    best = sum(1 for r in judged if _auto_was_best(r))
    within = sum(1 for r in judged if r["ratio"] <= 1.05)
    ranks = sorted({r["ranks"] for r in rows})
    sizes = sorted({r["bytes"] for r in rows})
    off = [
        [
            r["box"],
            size_label(r["bytes"]),
            r["auto"],
            str(r["best"]),
            f"{r['ratio']:.3f}" if r["ratio"] is not None else "auto not simulated",
            str(r["skipped"]),
        ]
        for r in rows
        if not _auto_was_best(r)
    ]
    unjudged = len(rows) - len(judged)
    text = (
        "```bash\n" + "\n".join(d["command"] for d in docs) + "\n```\n\n"
        f"{', '.join(map(str, ranks))} GPUs x {', '.join(size_label(s) for s in sizes)}: "
        f"auto's choice was the simulated best at {best} of {len(judged)} points, within 5% "
        f"at {within}; the worst point is {worst['ratio']:.3f}x the best "
        f"({worst['box']}, {size_label(worst['bytes'])})"
        + (
            f"; at {unjudged} more, auto's own choice is over the simulator's step budget"
            if unjudged
            else ""
        )
        + "."
    )
    if off:
        text += "\n\n" + table(
            ["box", "size", "auto", "best simulated", "auto / best", "candidates over the budget"],
            off,
            "lllllr",
        )
    return text


# --- convergence ------------------------------------------------------------------------------


def convergence(name: str) -> str:
    doc = load(name)
    rows = []
    for r in doc["runs"]:
        rows.append(
            [
                r["backend"],
                str(r["np"]),
                "yes" if r["reached"] else "no",
                str(r["epochs_to_target"] or "-"),
                fmt(r["time_to_target_s"]) if r["reached"] else "-",
                f"{r['throughput']:.0f}",
                fmt(r["t_iter_ms"]),
                fmt(r["scaling_efficiency"]),
                fmt(r["comm_overhead_ms"]),
                f"{r['comm_overhead_pct']:.0f}%",
                f"{r['final_val_acc']:.4f}",
            ]
        )
    target = doc["config"]["target"]
    return table(
        [
            "backend",
            "np",
            f"reached {target:.0%}",
            "epochs",
            "time to target (s)",
            "samples/s",
            "t_iter (ms)",
            "efficiency",
            "comm (ms)",
            "comm %",
            "final acc",
        ],
        rows,
        "lrlrrrrrrrr",
    )


def _throughput(name: str, backend: str, np_: int) -> float:
    return next(
        r["throughput"] for r in load(name)["runs"] if r["backend"] == backend and r["np"] == np_
    )


# --- torch.distributed's backend "ddl" -------------------------------------------------------


def torch_ddp(*names: str) -> str:
    """DDP steps and dist.all_reduce through the backend "ddl", beside gloo and the raw API."""
    docs = [load(n) for n in _present(names)]
    head = "```bash\n" + "\n".join(d["command"] for d in docs) + "\n```\n\n"
    loads = ", ".join(
        f"np = {d['nranks']}: {d['load_before'][0]:.1f} before, {d['load_after'][0]:.1f} after"
        for d in docs
    )
    train = [
        [
            str(d["nranks"]),
            str(r["batch_per_rank"]),
            fmt(r["local"]["step_ms"], 1),
            fmt(r["ddl"]["step_ms"], 1),
            fmt(r["gloo"]["step_ms"], 1),
            fmt(r["ddl"]["samples_per_s"], 1),
            fmt(r["gloo"]["samples_per_s"], 1),
            f"**{r['ratio']:.2f}**",
        ]
        for d in docs
        for r in d.get("train", [])
    ]
    params = next((r["params"] for d in docs for r in d.get("train", [])), 0)
    bw = [
        [
            str(d["nranks"]),
            size_label(r["size"]),
            fmt(r["ddl"]["busbw"]),
            fmt(r["raw"]["busbw"]),
            fmt(r["raw_async"]["busbw"]),
            fmt(r["gloo"]["busbw"]),
            f"**{r['ddl_over_raw']:.2f}**",
            fmt(r["ddl_over_gloo"]),
        ]
        for d in docs
        for r in d["allreduce"]
    ]
    return (
        head
        + f"Load average (1 min, 2 vCPUs) {loads}."
        + measured_on(*docs).replace("\n\n", " ")
        + "\n\n"
        + f"DDP, {params / 1e6:.1f} M parameters, step time in ms (the slowest rank's median):"
        + "\n\n"
        + table(
            [
                "np",
                "batch per rank",
                "local (no comm)",
                "ddl",
                "gloo",
                "ddl samples/s",
                "gloo samples/s",
                "ddl / gloo",
            ],
            train,
        )
        + "\n\n`dist.all_reduce` busbw (GB/s), float32:\n\n"
        + table(
            [
                "np",
                "size",
                "ddl",
                "raw `comm.allreduce`",
                "raw `allreduce_async().wait()`",
                "gloo",
                "ddl / raw",
                "ddl / gloo",
            ],
            bw,
        )
    )


def _torch_ddp_spans(names: Iterable[str]) -> tuple[tuple[float, float], tuple[float, float]]:
    docs = [load(n) for n in _present(names)]
    train = [r["ratio"] for d in docs for r in d.get("train", [])]
    raw = [r["ddl_over_raw"] for d in docs for r in d["allreduce"]]
    return (min(train), max(train)), (min(raw), max(raw))


# --- the summary ------------------------------------------------------------------------------


def summary() -> str:
    lo, hi = testbed_range("testbed_out_of_the_box.json", "auto")
    rlo, rhi = testbed_range("testbed_out_of_the_box.json", "ring")
    rails = rails_speedups("testbed_rails.json", 64 << 20)
    sweep = _rows(["simulate_sweep_quick.json"])
    one = {nb: _paper_point(sweep, "4x16x4", nb, 1, "auto") for nb in (100e6, 350e6)}
    four = _paper_point(sweep, "4x16x4", 100e6, 4, "auto")
    flat = _paper_point(sweep, "4x16x4", 100e6, 4, "ring")
    bound = {nb: simulate_sweep.network_bound((4, 16, 4), nb) for nb in one}
    avb = [
        r for r in _rows(["auto_vs_best.json", "auto_vs_best_large.json"]) if r["ratio"] is not None
    ]
    best = sum(1 for r in avb if _auto_was_best(r))
    avb_ranks = sorted({r["ranks"] for r in avb})
    np2 = host_ratio("allreduce_np2_direct.json", (16 << 20, 64 << 20))
    np4 = host_ratio("allreduce_np4_direct.json", (16 << 20, 64 << 20))
    gloo2 = host_ratio("allreduce_np2_direct.json", (16 << 20, 64 << 20), "gloo")
    lat = {state: load(f"latency_4k_np2_{state}.json") for state in ("quiet", "busy")}
    unpinned = {state: load(f"latency_4k_np2_unpinned_{state}.json") for state in ("quiet", "busy")}
    tcp = {state: load(f"latency_4k_np2_tcp_{state}.json") for state in ("quiet", "busy")}
    conv = _throughput("convergence.json", "ddlcore", 2) / _throughput(
        "convergence.json", "gloo", 2
    )
    rows = [
        [
            "Two emulated hosts x 2 or 4 ranks, 1 Gbit/s, **nothing set**: `auto`",
            f"{span(lo, hi, 2)}x the link bound (16 and 64 MB, block and cyclic placement); "
            f"the flat ring {rlo:.2f}-{rhi:.1f}x",
            "[The testbed](#the-testbed-two-emulated-hosts)",
        ],
        [
            "Two network adapters per host (rails), 64 MB",
            " and ".join(f"{v:.2f}x ({k})" for k, v in sorted(rails.items()))
            + " one adapter's speed",
            "same",
        ],
        [
            "The paper's cluster in the simulator (256 GPUs, 4x16x4, one adapter per host)",
            f"100 MB in {one[100e6]['time_s'] * 1e3:.1f} ms (paper: 23 ms), 350 MB in "
            f"{one[350e6]['time_s'] * 1e3:.1f} ms (paper: < 100 ms): "
            f"{one[100e6]['time_s'] / bound[100e6]:.2f}x and "
            f"{one[350e6]['time_s'] / bound[350e6]:.2f}x the per-host network bound",
            "[The paper's cluster](#the-papers-cluster-in-the-simulator)",
        ],
        [
            "The same with 4 adapters per host",
            f"100 MB in {four['time_s'] * 1e3:.1f} ms, {flat['time_s'] / four['time_s']:.1f}x "
            "the flat ring",
            "same",
        ],
        [
            f"`auto` against every candidate, simulated, {avb_ranks[0]}-{avb_ranks[-1]} GPUs",
            f"the best candidate at {best} of {len(avb)} points",
            "same",
        ],
        [
            "One host, 16 and 64 MB allreduce",
            f"np = 2: {span(*np2)}x MPICH's MPI_Allreduce and {span(*gloo2, 0)}x gloo in the "
            f"same processes; np = 4: {span(*np4)}x MPICH",
            "[One host](#one-host-allreduce-beside-mpi-and-gloo)",
        ],
        [
            "One host, 4 KB allreduce, median, np = 2",
            f"{lat['quiet']['ddlcore']['median_us']:.1f} µs (MPICH "
            f"{lat['quiet']['mpi']['median_us']:.1f} µs); beside a busy process "
            f"{lat['busy']['ddlcore']['median_us']:.1f} µs (MPICH "
            f"{lat['busy']['mpi']['median_us']:.1f} µs), "
            f"{lat['busy']['ddlcore']['median_us'] / lat['quiet']['ddlcore']['median_us']:.2f}x "
            "the quiet time, init having pinned each rank to a CPU; left to the scheduler "
            f"(`DDL_BIND=none`) {unpinned['busy']['ddlcore']['median_us']:.1f} µs in this run",
            "[Latency](#small-message-latency-medians-beside-mpich)",
        ],
        [
            "Over TCP (loopback), 4 KB allreduce, median, np = 2",
            f"{tcp['quiet']['ddlcore']['median_us']:.1f} µs (MPICH over TCP "
            f"{tcp['quiet']['mpi']['median_us']:.1f} µs); beside a busy process "
            f"{tcp['busy']['ddlcore']['median_us']:.1f} µs (MPICH "
            f"{tcp['busy']['mpi']['median_us']:.1f} µs)",
            "[Over TCP](#over-tcp-beside-mpi-over-tcp)",
        ],
        [
            "Training (MLP, DDP-style, np = 2, CPU)",
            f"{conv:.2f}x gloo's samples/s, same accuracy at the same epoch",
            "[Convergence](#convergence-and-scaling-with-pytorch)",
        ],
    ]
    ddp_names = ["torch_ddp_np2.json", "torch_ddp_np4.json"]
    if _present(ddp_names):
        (tlo, thi), (rlo, rhi) = _torch_ddp_spans(ddp_names)
        rows.append(
            [
                'torch.distributed backend "ddl": DDP, 25 M parameters, np = 2 and 4, CPU',
                f"{span(tlo, thi, 2)}x gloo's samples/s; `dist.all_reduce` 1-64 MB at "
                f"{span(rlo, rhi, 2)}x the raw API's busbw",
                '[The backend "ddl"](#the-torchdistributed-backend-ddl)',
            ]
        )
    kills = [r["recovery_s"] * 1e3 for r in load("elastic_recovery_np4.json")["rows"]]
    rows.append(
        [
            "A rank SIGKILLed (rank 0 included), np = 4, one host: to the first allreduce on "
            "the shrunk communicator",
            f"p50 {statistics.median(kills):.0f} ms, p99 {_quantile(kills, 0.99):.0f} ms over "
            f"{len(kills)} kills; no peer measured beside it yet",
            "[Surviving a rank's death](#surviving-a-ranks-death)",
        ]
    )
    stops = [r["recovery_s"] * 1e3 for r in load("elastic_recovery_np4_stop.json")["rows"]]
    rows.append(
        [
            "A rank SIGSTOPped (hung), np = 4, one host: excluded by the heartbeat, to the first "
            "allreduce on the shrunk communicator",
            f"p50 {statistics.median(stops):.0f} ms, max {max(stops):.0f} ms over {len(stops)} "
            "stops (goal: 1.5 s); torchft's default heartbeat timeout is 5 s",
            "[Surviving a rank's death](#surviving-a-ranks-death)",
        ]
    )
    return table(["what", "result", "where"], rows, "lll")


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def elastic_recovery(kills: str, costs: str) -> str:
    """Kill -> first collective on the shrunk communicator, and agree's cost beside MPICH's."""
    out = elastic_kills(kills)
    cost = load(costs)
    med = cost["median_us"]
    agree, mpi = med["ddlcore agree"], med["MPICH Agree (MPIX_Comm_agree)"]
    out += f"\n\n```bash\n{cost['command']}\n```\n\n" + table(
        [f"np {cost['np']}, no failure", "median µs", "ratio to ddlcore agree"],
        [[name, fmt(t, 1), fmt(t / agree)] for name, t in med.items()],
    )
    out += (
        f"\n\nddlcore's agree takes {agree / mpi:.2f}x the time of MPICH's in the same processes."
    )
    return out


def elastic_kills(kills: str) -> str:
    """Kill -> first collective on the shrunk communicator: every kill, rank 0's, the others'."""
    doc = load(kills)
    times = [r["recovery_s"] * 1e3 for r in doc["rows"]]
    groups = [
        ("every kill", times),
        (
            "rank 0 (the store's) killed",
            [t for r, t in zip(doc["rows"], times, strict=True) if not r["victim"]],
        ),
        (
            "another rank killed",
            [t for r, t in zip(doc["rows"], times, strict=True) if r["victim"]],
        ),
    ]
    rows = [
        [
            what,
            str(len(ts)),
            fmt(min(ts), 1),
            fmt(statistics.median(ts), 1),
            fmt(_quantile(ts, 0.99), 1),
            fmt(max(ts), 1),
        ]
        for what, ts in groups
        if ts
    ]
    where = f"np {doc['np']}" + (f", {doc['testbed']} testbed" if "testbed" in doc else "")
    return f"```bash\n{doc['command']}\n```\n\n" + table(
        [where, "kills", "min ms", "p50 ms", "p99 ms", "max ms"], rows
    )


def elastic_hang(stops: str) -> str:
    """SIGSTOP -> the survivors' collective fails (exclusion) -> first collective shrunk."""
    doc = load(stops)
    columns = [
        ("the survivors' collective failed", "excluded_s"),
        ("computing again", "recovery_s"),
    ]
    rows = []
    for what, key in columns:
        ts = [r[key] * 1e3 for r in doc["rows"]]
        rows.append(
            [
                what,
                fmt(min(ts), 0),
                fmt(statistics.median(ts), 0),
                fmt(_quantile(ts, 0.99), 0),
                fmt(max(ts), 0),
                fmt(max(ts) / 1500.0),
            ]
        )
    return f"```bash\n{doc['command']}\n```\n\n" + table(
        [
            f"np {doc['np']}, {doc['rounds']} stops, from the stop to",
            "min ms",
            "p50 ms",
            "p99 ms",
            "max ms",
            "max / 1.5 s",
        ],
        rows,
    )


RENDERERS: dict[str, Callable[..., str]] = {
    "summary": summary,
    "host_allreduce": host_allreduce,
    "latency": latency,
    "p2p": p2p,
    "testbed_auto": testbed_auto,
    "testbed_schedule": testbed_schedule,
    "testbed_rails": testbed_rails,
    "paper": paper,
    "sweep_tables": sweep_tables,
    "auto_vs_best": auto_vs_best,
    "convergence": convergence,
    "torch_ddp": torch_ddp,
    "elastic_recovery": elastic_recovery,
    "elastic_hang": elastic_hang,
    "elastic_kills": elastic_kills,
}

PLACEHOLDER = re.compile(r"^\{\{\s*(\w+)((?:\s+[\w.\-]+)*)\s*\}\}$")


def render(template: str) -> str:
    out = []
    for line in template.splitlines():
        m = PLACEHOLDER.match(line.strip())
        if not m:
            out.append(line)
            continue
        name, args = m.group(1), m.group(2).split()
        if name not in RENDERERS:
            raise SystemExit(
                f"report_template.md: unknown renderer {name!r} "
                f"(known: {', '.join(sorted(RENDERERS))})"
            )
        out.append(RENDERERS[name](*args))
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--check", action="store_true", help="compare with BENCHMARKS.md instead of writing it"
    )
    p.add_argument("--output", type=Path, default=OUTPUT)
    a = p.parse_args(argv)
    text = render(TEMPLATE.read_text())
    if a.check:
        if a.output.read_text() != text:
            print(
                f"{a.output} is not what `python benchmarks/report.py` gives from "
                "benchmarks/results/: run it and commit the result",
                file=sys.stderr,
            )
            return 1
        return 0
    a.output.write_text(text)
    print(f"wrote {a.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
