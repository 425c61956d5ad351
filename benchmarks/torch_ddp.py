"""A DDP training step and ``dist.all_reduce`` through torch.distributed's backend "ddl", beside
gloo and ddlcore's own API, in the same processes.

    torchrun --nproc-per-node 2 benchmarks/torch_ddp.py --json benchmarks/results/torch_ddp_np2.json
    ddlrun -np 4 python benchmarks/torch_ddp.py --json benchmarks/results/torch_ddp_np4.json

Training: one MLP (~25 M parameters, 100 MB of float32 gradients), wrapped twice from the same
initial weights, in DDP on the default "ddl" group and in DDP on a gloo group made beside it; the
same fixed batch per rank. After warm-up, rounds of timed steps alternate between the two
(ddl, gloo, gloo, ddl, ...) so that both see the same load; a step's time is the median over
every round, the slowest rank's. "local" is the same step with no DDP and no communication: the
compute a step cannot go below. Both models must end with the same parameters.

allreduce: float32 tensors of 1-64 MB, ``dist.all_reduce`` on the ddl group, ``comm.allreduce``
of the group's own ddlcore `Communicator` on the same memory (the raw API) and
``dist.all_reduce`` on gloo, in alternating rounds (raw_async: ``comm.allreduce_async().wait()``,
the engine's background path that the backend takes); busbw = 2 (n - 1) / n x bytes / time, the
median round's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddlcore.bench.output import cpu_model

MB = 1 << 20


def make_model(width: int, depth: int, features: int) -> torch.nn.Module:
    """features -> width (x depth hidden layers) -> features, ReLU between."""
    dims = [features] + [width] * depth + [features]
    layers: list[torch.nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def slowest(value: float, group: Any) -> float:
    """The largest ``value`` over the ranks."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def train(args: argparse.Namespace, world: Any, gloo: Any) -> list[dict[str, Any]]:
    """One row per batch size: each way's median step, the slowest rank's."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = make_model(args.width, args.depth, args.features)
    params = sum(p.numel() for p in base.parameters())
    models = {
        "ddl": DDP(make_model(args.width, args.depth, args.features), process_group=world),
        "gloo": DDP(make_model(args.width, args.depth, args.features), process_group=gloo),
        "local": make_model(args.width, args.depth, args.features),
    }
    for m in models.values():
        target = m.module if isinstance(m, DDP) else m
        target.load_state_dict(base.state_dict())
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    rows = []
    for batch in args.batch:
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(batch, args.features, generator=g)
        y = torch.randn(batch, args.features, generator=g)

        def step(name: str, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            opts[name].zero_grad()
            torch.nn.functional.mse_loss(models[name](x), y).backward()
            opts[name].step()

        times: dict[str, list[float]] = {name: [] for name in models}
        for name in models:
            for _ in range(args.warmup):
                step(name)
        for r in range(args.rounds):
            order = list(models) if r % 2 == 0 else list(reversed(models))
            for name in order:
                dist.barrier(group=gloo)
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    step(name)
                    times[name].append(time.perf_counter() - t0)
        row: dict[str, Any] = {"params": params, "batch_per_rank": batch}
        for name, ts in times.items():
            ms = slowest(statistics.median(ts), gloo) * 1e3
            row[name] = {"step_ms": ms, "samples_per_s": size * batch / ms * 1e3}
        row["ratio"] = row["ddl"]["samples_per_s"] / row["gloo"]["samples_per_s"]
        rows.append(row)
        if rank == 0:
            print(f"DDP step, {params / 1e6:.1f} M parameters, batch {batch} per rank, np {size}:")
            for name in models:
                print(
                    f"  {name:5s} {row[name]['step_ms']:8.1f} ms  "
                    f"{row[name]['samples_per_s']:8.1f} samples/s"
                )
            print(f"  ddl / gloo samples/s: {row['ratio']:.2f}x", flush=True)
    # The same data and steps on both: DDP on ddl and on gloo must agree.
    for p, q in zip(models["ddl"].parameters(), models["gloo"].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    return rows


def busbw(args: argparse.Namespace, world: Any, gloo: Any) -> list[dict[str, Any]]:
    size = dist.get_world_size()
    comm = world.communicator
    check = torch.ones(1000)
    dist.all_reduce(check)
    assert torch.equal(check, torch.full((1000,), float(size))), check
    rows = []
    nbytes = args.min_mb * MB
    while nbytes <= args.max_mb * MB:
        t = torch.zeros(nbytes // 4)  # zeros: a sum that stays finite however often it runs
        arr = t.numpy()  # the same memory, as the raw API's array
        ways: dict[str, Callable[[], Any]] = {
            "ddl": lambda t=t: dist.all_reduce(t),
            "raw": lambda arr=arr: comm.allreduce(arr, out=arr),
            "raw_async": lambda arr=arr: comm.allreduce_async(arr, out=arr).wait(),
            "gloo": lambda t=t: dist.all_reduce(t, group=gloo),
        }
        iters = max(3, min(40, (256 * MB) // nbytes))
        rounds: dict[str, list[float]] = {name: [] for name in ways}
        for way in ways.values():
            way()  # warm: staging buffers, connections
        for r in range(args.bw_rounds):
            order = list(ways) if r % 2 == 0 else list(reversed(ways))
            for name in order:
                dist.barrier(group=gloo)
                t0 = time.perf_counter()
                for _ in range(iters):
                    ways[name]()
                rounds[name].append((time.perf_counter() - t0) / iters)
        row: dict[str, Any] = {"size": nbytes, "iters": iters}
        for name, ts in rounds.items():
            seconds = slowest(statistics.median(ts), gloo)
            row[name] = {
                "time_us": seconds * 1e6,
                "busbw": 2 * (size - 1) / size * nbytes / seconds / 1e9,
            }
        row["ddl_over_raw"] = row["ddl"]["busbw"] / row["raw"]["busbw"]
        row["ddl_over_gloo"] = row["ddl"]["busbw"] / row["gloo"]["busbw"]
        rows.append(row)
        nbytes *= 2
    return rows


def command(argv: list[str], size: int) -> str:
    script = "benchmarks/torch_ddp.py " + " ".join(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return f"torchrun --nproc-per-node {size} {script}".strip()
    return f"ddlrun -np {size} python {script}".strip()


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--width", type=int, default=2048, help="hidden width (default 2048)")
    p.add_argument("--depth", type=int, default=6, help="hidden layers (default 6)")
    p.add_argument("--features", type=int, default=1024, help="input and output width")
    p.add_argument(
        "--batch", type=int, nargs="+", default=[8, 32], help="samples per rank and step"
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model")
    p.add_argument("--steps", type=int, default=5, help="timed steps per model and round")
    p.add_argument("--rounds", type=int, default=6, help="rounds of training")
    p.add_argument("--bw-rounds", type=int, default=7, help="rounds per allreduce size")
    p.add_argument("--min-mb", type=int, default=1)
    p.add_argument("--max-mb", type=int, default=64)
    p.add_argument("--no-train", action="store_true", help="only the allreduce sweep")
    p.add_argument("--json", help="rank 0 writes the results here")
    args = p.parse_args()
    torch.set_num_threads(1)  # one core's worth per rank, under any launcher
    load_before = os.getloadavg()
    dist.init_process_group("ddl")
    rank, size = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    result: dict[str, Any] = {
        "command": command(sys.argv[1:], size),
        "nranks": size,
        "cores": os.cpu_count(),
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "load_before": load_before,
    }
    if not args.no_train:
        result["train"] = train(args, world, gloo)
    result["allreduce"] = rows = busbw(args, world, gloo)
    result["load_after"] = os.getloadavg()
    if rank == 0:
        print(f"allreduce busbw (GB/s), np {size}:")
        ways = ("ddl", "raw", "raw_async", "gloo")
        print("  size   " + " ".join(f"{w:>9s}" for w in ways) + "  ddl/raw ddl/gloo")
        for r in rows:
            print(
                f"  {r['size'] // MB:4d} MB "
                + " ".join(f"{r[w]['busbw']:9.2f}" for w in ways)
                + f" {r['ddl_over_raw']:8.2f} {r['ddl_over_gloo']:8.2f}"
            )
        print(f"load average before {load_before}, after {result['load_after']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
            print(f"# wrote {args.json}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
