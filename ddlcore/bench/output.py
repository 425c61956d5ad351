"""ddl-bench's files: the rows as JSON (with the memory-bandwidth reference when measured), as
CSV (one busbw column per peer), and busbw against size as a PNG (matplotlib). The console table
is printed by `ddlcore.bench.run` as it goes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import asdict
from typing import Any

from ddlcore.bench.cases import Row


def cpu_model() -> str:
    """The CPU's model name and how many the machine has ("AMD EPYC, 2 CPUs"), for the
    record of a measurement: a pool of virtual machines does not always give the same one."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), ""
            )
    except OSError:
        pass
    return f"{model or platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"


def _write_outputs(
    args: argparse.Namespace, rows: list[Row], n: int, membw: dict[str, float] | None, bound: float
) -> None:
    if args.json:
        doc: dict[str, Any] = {
            "collective": args.collective,
            "nranks": n,
            "cpu": cpu_model(),
            "rows": [asdict(r) for r in rows],
        }
        if membw is not None:
            doc["memory_bandwidth"] = membw
            doc["single_copy_bound_busbw"] = bound
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.csv:
        with open(args.csv, "w") as f:
            peers = sorted({p for r in rows for p in r.peers})
            f.write(
                "size,count,type,redop,root,time_us,algbw,busbw,wrong,ip_time_us,ip_algbw,"
                "ip_busbw,ip_wrong" + "".join(f",{p}_busbw" for p in peers) + "\n"
            )
            for r in rows:
                vals = [
                    r.size,
                    r.count,
                    r.type,
                    r.redop,
                    r.root,
                    r.time_us,
                    r.algbw,
                    r.busbw,
                    r.wrong,
                    r.ip_time_us,
                    r.ip_algbw,
                    r.ip_busbw,
                    r.ip_wrong,
                ]
                vals += [r.peers.get(p, "") for p in peers]
                f.write(",".join(str(v) for v in vals) + "\n")
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("# --plot needs matplotlib (pip install 'ddlcore[plot]')", file=sys.stderr)
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = [r.size for r in rows]
        ax.plot(xs, [r.busbw for r in rows], marker="o", label="ddlcore")
        for p in sorted({p for r in rows for p in r.peers}):
            ax.plot(
                [r.size for r in rows if p in r.peers],
                [r.peers[p] for r in rows if p in r.peers],
                marker="s",
                label=p,
            )
        if membw is not None and bound == bound:
            ax.axhline(bound, color="grey", linestyle="--", label="single-copy memory bound")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"{args.collective}, {n} ranks, {args.dtype} {args.op}")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
