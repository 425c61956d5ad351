"""Where one training iteration's time goes with the PyTorch DistributedOptimizer.

    ddlrun -np 2 python benchmarks/torch_step_profile.py          # forward / backward / step, ms
    ddlrun -np 2 python benchmarks/torch_step_profile.py --local  # the same ranks, no communication

The model and batch are the convergence benchmark's (MLP 64-1024-1024-10, global batch 256
split over the ranks); the medians of 50 iterations after 10 warm-up ones are printed per rank.
Backward includes packing and starting the buckets it completes, step() waiting for the rest and
unpacking them: the difference to ``--local`` is what communication adds to each phase.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ddlcore
from ddlcore.integrations.torch import DistributedOptimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", action="store_true", help="no DistributedOptimizer")
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with ddlcore.init() as comm:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 10),
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if not args.local:
            opt = DistributedOptimizer(opt, comm, model.named_parameters())
        x = torch.randn(args.global_batch // comm.size, 64)
        y = torch.randint(0, 10, (args.global_batch // comm.size,))
        phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
        for i in range(10 + args.iters):
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if i >= 10:
                for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                    phases[name].append(dt * 1e3)
        medians = {name: statistics.median(v) for name, v in phases.items()}
        mode = "local" if args.local else "ddlcore"
        print(
            f"rank {comm.rank} {mode}: "
            + " ".join(f"{k} {v:.2f}" for k, v in medians.items())
            + f" total {sum(medians.values()):.2f} ms"
        )


if __name__ == "__main__":
    main()
