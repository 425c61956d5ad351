"""The simulator's command line (``python -m ddlcore.simulate``): builds a box from the flags,
simulates one collective on it and prints a table or one JSON object; a run refused as too large
prints NOT SIMULATED, why, and the cost model's prediction (exit status 3)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from ddlcore import topology
from ddlcore.algorithms import ALGORITHMS
from ddlcore.planning import tuning
from ddlcore.simulate.model import Result, cyclic, simulate
from ddlcore.simulate.program import DEFAULT_CHUNK_BYTES, MAX_STEPS, TooLargeToSimulate

# argparse's description: the package docstring's first paragraph.
DESCRIPTION = (
    "The simulator: runs the SAME schedules the engine runs against a link model, to predict a "
    "collective's time at scales this machine cannot run (e.g. 64 hosts x 4 GPUs in 4 racks)."
)
# The CLI's default links, the PowerAI DDL paper's cluster (Cho et al. 2017): NVLink inside a host,
# then in-rack and cross-rack network (bytes/s, and per-message latency in seconds).
PAPER_BW = [20e9, 10e9, 9.5e9]
PAPER_LAT = [5e-6, 10e-6, 20e-6]


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _report(res: Result) -> str:
    order = f" (dimensions in order {','.join(map(str, res.dim_order))})" if res.dim_order else ""
    if res.segments > 1:
        order += f" pipelined in {res.segments} segments"
    lines = [
        f"{res.collective} of {res.nbytes / 1e6:g} MB via {res.algorithm}{order} on {res.topology} "
        f"({res.ranks} ranks, {res.adapters} network adapter(s) per host), {res.steps} steps",
        f"simulated {res.time_s * 1e3:.3f} ms   algbw {res.algbw / 1e9:.2f} GB/s   busbw "
        f"{res.busbw / 1e9:.2f} GB/s   cost model (tuning.predict) {res.predicted_s * 1e3:.3f} ms",
        f"{'dim':>3} {'size':>5} {'level':<11} {'GB/s':>6} {'lat us':>6} {'MB sent/rank':>12} "
        f"{'messages':>9} {'busiest port ms':>15}",
    ]
    for d in res.dims:
        lines.append(
            f"{d.dim:>3} {d.size:>5} {d.level:<11} {d.bw / 1e9:>6.3g} {d.lat * 1e6:>6.3g} "
            f"{d.bytes_per_rank / 1e6:>12.3f} {d.messages:>9} {d.busy_s * 1e3:>15.3f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI. Exit status 0: simulated; 3: refused as too large (NOT SIMULATED, with the reason)."""
    p = argparse.ArgumentParser(
        prog="python -m ddlcore.simulate",
        description=DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--collective",
        default="allreduce",
        choices=tuning.SELECTABLE,
        help="the collective to simulate",
    )
    p.add_argument("--topology", default="4x16x4", help="box, fastest dimension first")
    p.add_argument(
        "--link-bw",
        default="",
        help="bytes/s per dimension, comma-separated; one "
        "value applies to every dimension, fewer values than dimensions repeat the "
        "last (20e9,10e9 on a 3-D box: 20e9,10e9,10e9; the table shows each "
        "dimension's); empty: the paper's 20e9,10e9,9.5e9 for as many dimensions as "
        "the box has",
    )
    p.add_argument(
        "--link-lat",
        default="",
        help="seconds per dimension, as --link-bw (empty: 5e-6,10e-6,20e-6)",
    )
    p.add_argument("--bytes", type=float, default=100e6, help="each rank's input in bytes")
    p.add_argument("--algo", default="auto", help="ring, mdring, rhd, rd or auto")
    p.add_argument(
        "--segments",
        type=int,
        default=0,
        help="mdring allreduce: pipelined "
        "segments (0: the cost model's choice, 1: the phases one after another)",
    )
    p.add_argument(
        "--dim-order",
        default="",
        help="mdring phase order, e.g. 0,2,1 (empty: the best, under auto)",
    )
    p.add_argument("--adapters", type=int, default=1, help="network adapters per host")
    p.add_argument(
        "--placement",
        default="block",
        choices=("block", "cyclic"),
        help="rank -> host map: block (host by host, as launchers do by default) or "
        "cyclic (round-robin over hosts: rank order crosses a host every hop)",
    )
    p.add_argument(
        "--levels",
        default="",
        help="level per dimension, comma-separated (empty: "
        "the first inside a host, the others across the network, e.g. host,rack,"
        "cross-rack)",
    )
    p.add_argument(
        "--reduce-bw", type=float, default=tuning.REDUCE_BW, help="bytes/s of the reduction kernel"
    )
    p.add_argument(
        "--copy-bw", type=float, default=None, help="bytes/s of a local copy (None: --reduce-bw)"
    )
    p.add_argument("--itemsize", type=int, default=4, help="bytes per element")
    p.add_argument(
        "--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="pipeline chunk in bytes"
    )
    p.add_argument(
        "--max-steps",
        type=float,
        default=MAX_STEPS,
        help="refuse (exit 3) schedules with more steps than this",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    try:
        dims = [int(d) for d in a.topology.lower().split("x")]
    except ValueError:
        p.error(f"--topology {a.topology!r}: expected sizes like 4x16x4")
    if a.algo != "auto" and a.algo not in ALGORITHMS[a.collective]:
        p.error(f"--algo {a.algo!r}: {a.collective} has {sorted(ALGORITHMS[a.collective])} or auto")
    try:
        bw = _floats(a.link_bw) if a.link_bw else PAPER_BW[: len(dims)]
        lat = _floats(a.link_lat) if a.link_lat else PAPER_LAT[: len(dims)]
        topo = topology.box(
            dims,
            topology.per_dim(bw, len(dims), "--link-bw"),
            topology.per_dim(lat, len(dims), "--link-lat"),
            a.levels.split(",") if a.levels else None,
            a.adapters,
        )
    except ValueError as exc:
        p.error(str(exc))
    if a.placement == "cyclic":
        topo = cyclic(topo)
    order = tuple(int(v) for v in a.dim_order.split(",")) if a.dim_order else None
    try:
        res = simulate(
            a.collective,
            a.algo,
            topo,
            a.bytes,
            a.itemsize,
            a.chunk_bytes,
            order,
            a.reduce_bw,
            a.copy_bw,
            int(a.max_steps),
            segments=a.segments,
        )
    except TooLargeToSimulate as exc:
        choice = tuning.choose(
            a.collective, topo, int(a.bytes), a.algo, a.chunk_bytes, segments=a.segments
        )
        model = tuning.predict(
            a.collective,
            choice.algorithm,
            topo,
            a.bytes,
            order or choice.dim_order,
            a.reduce_bw,
            segments=choice.segments,
        )
        if a.json:
            print(
                json.dumps(
                    {
                        "simulated": False,
                        "reason": str(exc),
                        "time_s": None,
                        "algorithm": choice.algorithm,
                        "topology": topo.shape,
                        "predicted_s": model,
                    }
                )
            )
        else:
            print(
                f"NOT SIMULATED: {exc}\n(the cost model alone predicts {model * 1e3:.3f} ms; "
                "that is a formula, not a simulation)"
            )
        return 3
    print(json.dumps(res.to_json()) if a.json else _report(res))
    return 0
