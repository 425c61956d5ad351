"""Convergence benchmark: a real model trained data-parallel to a validation-accuracy target.

    python benchmarks/convergence.py [--nps 1,2,4] [--backends ddlcore,ddlcore-ddp,gloo]
        [--target 0.97] [--epochs 40] [--global-batch 256] [--device cpu|cuda]
        [--json out.json] [--plot out.png]

An MLP (64-1024-1024-10, 1.1 M parameters) learns scikit-learn's handwritten digits (shipped with
the package: no download; fixed stratified split, 1497 train / 300 validation, standardised with
the training statistics). Every run uses the same global batch, the same seeded per-epoch shuffle
(so the global batches are identical for every np: rank r takes slice r of each), the same
initial weights and the same learning-rate schedule: SGD with momentum, lr = base_lr * B / 256
(Goyal et al.'s linear scaling rule), linear warm-up over the first epochs, then cosine decay.
Each run trains for a fixed number of epochs, so throughput is measured over the same work for
every np, and time-to-accuracy is read off the curve where the validation accuracy first reaches
the target.

The driver (default mode) spawns ``ddlrun -np N --no-prefix python convergence.py --worker ...``
for each (backend, np): np = 1 once (plain single-process training, no communication: the
baseline), then for np > 1 each backend:

* ``ddlcore``      plain model + ddlcore's `DistributedOptimizer` (Horovod style),
* ``ddlcore-ddp``  torch DistributedDataParallel with ddlcore's `allreduce_hook`,
* ``gloo``         torch DistributedDataParallel with torch.distributed's own gloo allreduce.

It prints time-to-accuracy, throughput, median time per iteration, scaling efficiency
(throughput(np) / (np * throughput(1)), the paper's definition) and communication overhead
(t_iter(np) - t_iter(1) / np: the time beyond perfect scaling), optionally writes every run's
history as JSON and a plot of validation accuracy vs training time, and exits non-zero when a run
fails or misses the target. Validation (rank 0, once per epoch) is not counted as training time.

``--device cuda`` trains on GPUs (local rank r on GPU r modulo the GPUs there are): the gradients
then take ddlcore's GPU path (device buffers, the CUDA pack kernels) and gloo's CUDA support; each
step's time is taken after ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

BACKENDS = ("ddlcore", "ddlcore-ddp", "gloo")
BASELINE = "single"  # np = 1: one process, no communication, shared by every backend
REFERENCE_BATCH = 256  # the linear scaling rule's reference batch (Goyal et al. use 256)


# --- data, model, schedule (identical in every process) ------------------------------------------


def split_digits(seed: int, path: str) -> None:
    """The digits, split 1497 train / 300 validation (stratified, seeded), standardised, written
    to ``path`` (.npz) by the driver, so that scikit-learn (~2 s to import) loads once per sweep
    rather than once per rank.

    Parameters
    ----------
    seed : int
        Seed of the split.
    path : str
        Where to write ``x_train, y_train, x_val, y_val`` (float32 features, int64 labels).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_va, y_tr, y_va = train_test_split(x, y, test_size=300, stratify=y, random_state=seed)
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0)
    std[std == 0] = 1.0  # border pixels that are always 0
    np.savez(
        path,
        x_train=((x_tr - mean) / std).astype(np.float32),
        y_train=y_tr.astype(np.int64),
        x_val=((x_va - mean) / std).astype(np.float32),
        y_val=y_va.astype(np.int64),
    )


def load_data(path: str) -> tuple[Any, Any, Any, Any]:
    """The split :func:`split_digits` wrote, as torch tensors (x_train, y_train, x_val, y_val)."""
    import torch

    with np.load(path) as data:
        return tuple(  # type: ignore[return-value]
            torch.from_numpy(data[k]) for k in ("x_train", "y_train", "x_val", "y_val")
        )


def build_model(hidden: int, seed: int) -> Any:
    """An MLP 64-hidden-hidden-10 with ReLU, initialised from ``seed``.

    The default width (1024) makes a step cost ~20 ms at batch 256 on one core, which keeps
    compute well above the ~2 ms allreduce of its 4.5 MB of gradients on this machine.
    """
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def lr_factor(iteration: int, warmup_iters: int, total_iters: int, warmup_start: float) -> float:
    """Multiplier of the peak learning rate at ``iteration``: linear warm-up from
    ``warmup_start`` to 1 over ``warmup_iters``, then cosine decay to 0 at ``total_iters``."""
    if iteration < warmup_iters:
        return warmup_start + (1.0 - warmup_start) * iteration / warmup_iters
    span = max(1, total_iters - warmup_iters)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (iteration - warmup_iters) / span)))


# --- worker: one rank of one run -----------------------------------------------------------------


class _Sync:
    """Barrier and gather-max over the ranks of a run, through whichever library it uses."""

    def __init__(self, barrier: Callable[[], None], gather: Callable[[np.ndarray], np.ndarray]):
        self.barrier = barrier
        self.gather = gather  # (k,) float64 -> (size, k)


def _setup(
    args: argparse.Namespace, model: Any, rank: int, size: int
) -> tuple[Any, Any, _Sync, Callable[[], None]]:
    """Wrap ``model`` for ``args.backend``: (model to train, optimizer, sync, close)."""
    import torch

    peak_lr = args.base_lr * args.global_batch / REFERENCE_BATCH

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=peak_lr, momentum=0.9, weight_decay=args.weight_decay)

    if args.backend == BASELINE:
        return model, sgd(model.parameters()), _Sync(lambda: None, lambda a: a[None]), lambda: None

    if args.backend in ("ddlcore", "ddlcore-ddp"):
        import ddlcore

        comm = ddlcore.init()
        assert (comm.rank, comm.size) == (rank, size)
        sync = _Sync(
            comm.barrier,
            lambda a: comm.allgather(np.ascontiguousarray(a, np.float64)).reshape(size, -1),
        )
    if args.backend == "ddlcore":
        from ddlcore.integrations.torch import (
            DistributedOptimizer,
            broadcast_optimizer_state,
            broadcast_parameters,
        )

        broadcast_parameters(model, comm, root=0)
        opt = DistributedOptimizer(
            sgd(model.parameters()), comm, model.named_parameters(), fusion_bytes=args.fusion_bytes
        )
        broadcast_optimizer_state(opt, comm, root=0)
        return model, opt, sync, comm.close

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=size
    )
    on_gpu = next(model.parameters()).device
    ddp = DistributedDataParallel(  # broadcasts rank 0's weights
        model, device_ids=[on_gpu.index] if on_gpu.type == "cuda" else None
    )
    if args.backend == "ddlcore-ddp":
        from ddlcore.integrations.torch import allreduce_hook

        ddp.register_comm_hook(comm, allreduce_hook)

        def close() -> None:
            comm.close()
            dist.destroy_process_group()
    else:

        def gather(a: np.ndarray) -> np.ndarray:
            parts = [torch.empty(len(a), dtype=torch.float64) for _ in range(size)]
            dist.all_gather(parts, torch.as_tensor(a, dtype=torch.float64))
            return torch.stack(parts).numpy()

        sync = _Sync(dist.barrier, gather)
        close = dist.destroy_process_group
    return ddp, sgd(ddp.parameters()), sync, close


def worker(args: argparse.Namespace) -> None:
    """Train on this rank (rank and size from ddlrun's DDL_RANK / DDL_SIZE); rank 0 writes the
    run's result to ``args.result`` as JSON."""
    import torch

    torch.set_num_threads(1)  # 2 cores shared by up to 4 ranks
    rank, size = int(os.environ.get("DDL_RANK", "0")), int(os.environ.get("DDL_SIZE", "1"))
    if args.global_batch % size:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by np={size}")
    local = args.global_batch // size
    device = torch.device("cpu")
    if args.device == "cuda":
        local_rank = int(os.environ.get("DDL_LOCAL_RANK", str(rank)))
        if not torch.cuda.device_count():
            raise SystemExit(
                f"rank {rank}: --device cuda, but this process sees no GPU (CUDA_VISIBLE_DEVICES?)"
            )
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    settle = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x_tr, y_tr, x_va, y_va = (t.to(device) for t in load_data(args.data))
    model = build_model(args.hidden, args.seed).to(device)
    train_model, opt, sync, close = _setup(args, model, rank, size)

    iters_per_epoch = len(x_tr) // args.global_batch  # drop_last: every global batch is full
    if iters_per_epoch == 0:
        raise SystemExit(
            f"--global-batch {args.global_batch} exceeds the {len(x_tr)} training samples"
        )
    total = iters_per_epoch * args.epochs
    warmup = iters_per_epoch * args.warmup_epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda it: lr_factor(it, warmup, total, args.warmup_start)
    )
    loss_fn = torch.nn.CrossEntropyLoss()

    step_s: list[float] = []
    history: list[dict[str, float]] = []
    train_s = 0.0
    if device.type == "cuda":
        # Untimed, changing nothing: one backward through every backend's path, its gradients
        # dropped, so that one-off costs (Numba compiling ddlcore's CUDA kernels, cuBLAS and
        # gloo setting up) do not land in the first epoch of some backends only.
        warm = torch.arange(rank * local, (rank + 1) * local, device=device)
        loss_fn(train_model(x_tr[warm]), y_tr[warm]).backward()
        opt.zero_grad()
        settle()
    sync.barrier()
    for epoch in range(args.epochs):
        # the same shuffle on every rank and for every np: the global batches are identical
        perm = torch.randperm(
            len(x_tr), generator=torch.Generator().manual_seed(args.seed * 100_003 + epoch)
        ).to(device)
        train_model.train()
        t_epoch = time.perf_counter()
        loss_sum = 0.0
        settle()
        for i in range(iters_per_epoch):
            t0 = time.perf_counter()
            idx = perm[
                i * args.global_batch + rank * local : i * args.global_batch + (rank + 1) * local
            ]
            opt.zero_grad()
            loss = loss_fn(train_model(x_tr[idx]), y_tr[idx])
            loss.backward()
            opt.step()
            sched.step()
            settle()  # on a GPU the step's kernels have finished, not just been queued
            step_s.append(time.perf_counter() - t0)
            loss_sum += loss.item()
        train_s += time.perf_counter() - t_epoch
        if rank == 0:  # validation: not training time; the others wait in the barrier
            model.eval()
            with torch.no_grad():
                acc = (model(x_va).argmax(dim=1) == y_va).double().mean().item()
            history.append(
                {
                    "epoch": epoch + 1,
                    "train_time_s": train_s,
                    "val_acc": acc,
                    "train_loss_rank0": loss_sum / iters_per_epoch,
                    "lr": opt.param_groups[0]["lr"],
                }
            )
        sync.barrier()

    per_iter = sync.gather(np.array(step_s)).max(axis=0)  # a step takes as long as its slowest rank
    # DDP's reducer holds the process group: drop it before destroying the group, or gloo's
    # threads may outlive it into interpreter shutdown (an occasional SIGABRT, seen once at np=4)
    del train_model, opt, sched
    gc.collect()
    close()
    if rank != 0:
        return
    steady = per_iter[iters_per_epoch:] if args.epochs > 1 else per_iter
    result = {
        "backend": args.backend,
        "np": size,
        "epochs": args.epochs,
        "device": args.device,
        "iters_per_epoch": iters_per_epoch,
        "global_batch": args.global_batch,
        "samples": total * args.global_batch,
        "train_time_s": train_s,
        "throughput": total * args.global_batch / train_s,
        "t_iter_ms": 1e3 * statistics.median(steady.tolist()),
        "params": sum(p.numel() for p in model.parameters()),
        "final_val_acc": history[-1]["val_acc"],
        "history": history,
    }
    with open(args.result, "w") as f:
        json.dump(result, f)


# --- driver --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _training_args(args: argparse.Namespace) -> list[str]:
    """The options every worker gets, so that every run trains the same recipe."""
    out = [
        "--epochs",
        str(args.epochs),
        "--global-batch",
        str(args.global_batch),
        "--base-lr",
        str(args.base_lr),
        "--warmup-epochs",
        str(args.warmup_epochs),
        "--warmup-start",
        str(args.warmup_start),
        "--weight-decay",
        str(args.weight_decay),
        "--hidden",
        str(args.hidden),
        "--seed",
        str(args.seed),
        "--device",
        args.device,
        "--data",
        args.data,
    ]
    if args.fusion_bytes is not None:
        out += ["--fusion-bytes", str(args.fusion_bytes)]
    return out


def run_one(args: argparse.Namespace, backend: str, nproc: int, workdir: str) -> dict[str, Any]:
    """Launch one run through ddlrun and return rank 0's result.

    Raises
    ------
    RuntimeError
        The run failed or timed out; the message holds the end of its output.
    """
    result = os.path.join(workdir, f"{backend}-np{nproc}.json")
    cmd = [
        sys.executable,
        "-m",
        "ddlcore.launcher",
        "-np",
        str(nproc),
        "--no-prefix",
        "--timeout",
        str(args.run_timeout),
        "--job-timeout",
        str(args.run_timeout),
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--backend",
        backend,
        "--port",
        str(_free_port()),
        "--result",
        result,
        *_training_args(args),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=args.run_timeout + 30
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{backend} np={nproc}: no result after {exc.timeout:.0f} s") from exc
    if proc.returncode != 0 or not os.path.exists(result):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(
            f"{backend} np={nproc} failed (exit code {proc.returncode}); "
            f"command: {' '.join(cmd)}\n{tail}"
        )
    with open(result) as f:
        out: dict[str, Any] = json.load(f)
    out["wall_s"] = time.monotonic() - t0
    return out


def summarise(runs: list[dict[str, Any]], target: float) -> None:
    """Add time-to-accuracy, scaling efficiency and communication overhead to each run, in place
    (relative to the np = 1 run, which must be ``runs[0]``)."""
    base = runs[0]
    for run in runs:
        hit = next((h for h in run["history"] if h["val_acc"] >= target), None)
        run["target"] = target
        run["reached"] = hit is not None
        run["epochs_to_target"] = hit["epoch"] if hit else None
        run["time_to_target_s"] = hit["train_time_s"] if hit else None
        run["scaling_efficiency"] = run["throughput"] / (run["np"] * base["throughput"])
        overhead = run["t_iter_ms"] - base["t_iter_ms"] / run["np"]
        run["comm_overhead_ms"] = overhead
        run["comm_overhead_pct"] = 100.0 * overhead / run["t_iter_ms"]


def print_table(runs: list[dict[str, Any]]) -> None:
    """The results, one line per run."""
    head = (
        f"{'backend':<12} {'np':>3} {'target':>7} {'epochs':>7} {'TTA s':>7} "
        f"{'samples/s':>10} {'t_iter ms':>10} {'eff':>6} {'comm ms':>8} {'comm %':>7} "
        f"{'final acc':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in runs:
        tta = f"{r['time_to_target_s']:.2f}" if r["reached"] else "-"
        epochs = f"{r['epochs_to_target'] or '-'}/{r['epochs']}"
        print(
            f"{r['backend']:<12} {r['np']:>3} {'yes' if r['reached'] else 'NO':>7} "
            f"{epochs:>7} {tta:>7} {r['throughput']:>10.0f} {r['t_iter_ms']:>10.2f} "
            f"{r['scaling_efficiency']:>6.2f} {r['comm_overhead_ms']:>8.2f} "
            f"{r['comm_overhead_pct']:>6.1f}% {r['final_val_acc']:>9.4f}"
        )


def plot(runs: list[dict[str, Any]], target: float, path: str) -> None:
    """Validation accuracy vs training time, one line per (backend, np), saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        ax.plot(
            [0.0] + [h["train_time_s"] for h in r["history"]],
            [0.1] + [h["val_acc"] for h in r["history"]],  # 0.1: chance, before training
            marker=".",
            label=f"{r['backend']} np={r['np']}",
        )
    ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("training time (s, validation excluded)")
    ax.set_ylabel("validation accuracy")
    ax.set_ylim(max(0.0, target - 0.15), 1.0)
    where = (
        f"{os.cpu_count()} CPU cores" if runs[0].get("device", "cpu") == "cpu" else "on the GPUs"
    )
    ax.set_title(f"digits MLP, global batch {runs[0]['global_batch']}, {where}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def driver(args: argparse.Namespace) -> int:
    """Run the sweep; print, save, and return the exit code (1 if a run failed or missed)."""
    nps = sorted({1, *(int(n) for n in args.nps.split(",") if n)})
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in BACKENDS:
            raise SystemExit(
                f"--backends: unknown backend {b!r} (choose from {', '.join(BACKENDS)})"
            )
    for n in nps:
        if n < 1 or args.global_batch % n:
            raise SystemExit(f"--nps: np={n} does not divide --global-batch {args.global_batch}")
    plan = [(BASELINE, 1)] + [(b, n) for n in nps if n > 1 for b in backends]
    cores = os.cpu_count() or 1
    print(
        f"# digits MLP 64-{args.hidden}-{args.hidden}-10, global batch {args.global_batch}, "
        f"peak lr {args.base_lr * args.global_batch / REFERENCE_BATCH:g} (linear scaling), "
        f"warm-up {args.warmup_epochs} epochs then cosine, {args.epochs} epochs, "
        f"target {args.target:g}, on {args.device}"
    )
    if max(nps) > cores:
        print(f"# note: np={max(nps)} oversubscribes this machine's {cores} cores")
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if max(nps) > gpus:
            print(f"# note: np={max(nps)} puts several ranks on each of the {gpus} GPU(s)")
    runs: list[dict[str, Any]] = []
    failures: list[str] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ddl-convergence-") as workdir:
        args.data = os.path.join(workdir, "digits.npz")
        split_digits(args.seed, args.data)
        for backend, nproc in plan:
            print(f"# running {backend} np={nproc} ...", flush=True)
            try:
                runs.append(run_one(args, backend, nproc, workdir))
            except RuntimeError as exc:
                if nproc == 1:
                    print(f"convergence: the np=1 baseline failed: {exc}", file=sys.stderr)
                    return 1
                failures.append(str(exc))
    summarise(runs, args.target)
    print()
    print_table(runs)
    print(
        f"\n# sweep took {time.monotonic() - t0:.0f} s; eff = throughput(np) / (np * "
        "throughput(1)); comm = t_iter(np) - t_iter(1)/np, % of t_iter(np)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": {k: v for k, v in vars(args).items() if k not in ("worker", "data")},
                    "cores": cores,
                    "runs": runs,
                },
                f,
                indent=1,
            )
        print(f"# wrote {args.json}")
    if args.plot:
        plot(runs, args.target, args.plot)
        print(f"# wrote {args.plot}")
    missed = [
        f"{r['backend']} np={r['np']} (best {max(h['val_acc'] for h in r['history']):.4f})"
        for r in runs
        if not r["reached"]
    ]
    sys.stdout.flush()  # the table before the verdict on stderr
    for msg in failures:
        print(f"convergence: run failed: {msg}", file=sys.stderr)
    if missed:
        print(
            f"convergence: target {args.target:g} not reached by: {', '.join(missed)}",
            file=sys.stderr,
        )
    return 1 if failures or missed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of both modes (the driver forwards the training options to its workers)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nps", default="1,2,4", help="rank counts (np=1 is always run)")
    p.add_argument("--backends", default=",".join(BACKENDS), help="for np > 1")
    p.add_argument("--target", type=float, default=0.97, help="validation accuracy to reach")
    p.add_argument("--epochs", type=int, default=40, help="fixed number of epochs per run")
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--base-lr", type=float, default=0.1, help="learning rate per 256 samples")
    p.add_argument("--warmup-epochs", type=int, default=3)
    p.add_argument(
        "--warmup-start",
        type=float,
        default=0.1,
        help="warm-up starts at this fraction of the peak learning rate",
    )
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--hidden", type=int, default=1024, help="width of the two hidden layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model and the gradients live (cuda: local rank r on GPU r)",
    )
    p.add_argument(
        "--fusion-bytes",
        type=int,
        default=None,
        help="DistributedOptimizer bucket size (default: DDL_FUSION_BYTES)",
    )
    p.add_argument("--run-timeout", type=float, default=300, help="seconds per run")
    p.add_argument("--json", help="write every run's results and history here")
    p.add_argument("--plot", help="write validation accuracy vs training time here (PNG)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default=BASELINE, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cuda" and not args.worker:
        import torch

        if not torch.cuda.is_available():
            p.error(
                "--device cuda: torch sees no GPU here (torch.cuda.is_available() is False; "
                "a CPU build of torch, or no driver)"
            )
    if args.epochs < 1 or args.warmup_epochs < 0 or args.global_batch < 1:
        p.error("--epochs and --global-batch must be >= 1, --warmup-epochs >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
