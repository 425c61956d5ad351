"""PyTorch integration on real processes: the DDP hooks and the DistributedOptimizer train exactly
like one process on the whole batch, buckets are reduced while backward still runs, the
broadcasts make ranks agree, and misuse fails on every rank with a message that says what to do.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import RankPools, free_port, require

try:
    import torch
except ImportError:  # pragma: no cover - the torch extra is part of CI's install
    torch = None

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4: every rank gets an equal shard
STEPS = 4


@pytest.fixture(autouse=True)
def _needs_torch():
    require(torch is not None, "torch is not installed (pip install 'ddlcore[torch]')")


# One pool of rank processes per world size for this module: each rank imports torch once, not
# once per test (what is tested is the integration, not the processes; every call still makes
# and closes its own communicator, on a fresh port, and a failed call replaces the processes).
_POOLS = RankPools()


@pytest.fixture(scope="module", autouse=True)
def _close_pools():
    yield
    _POOLS.close()


def run_ranks(fn, nprocs: int, *args, timeout: float = 120.0):
    return _POOLS.run(fn, nprocs, *args, timeout=timeout)


def _require_device(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip(
            "needs a real GPU (CPU tensors are tested on every run; the GPU path "
            "itself is covered in CI by tests/collectives/test_device.py under the "
            "simulator)"
        )


# --- a small model, its data, and the single-process reference -----------------------------------


def _model(seed: int = 0, width: int = 16):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, 3),
    )
    model.unused = torch.nn.Parameter(torch.ones(5))  # never in the loss: its grad stays None
    return model


def _data(passes: int = 1):
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS, passes, GLOBAL_BATCH, 6, generator=gen)
    y = torch.randint(0, 3, (STEPS, passes, GLOBAL_BATCH), generator=gen)
    return x, y


def _optimizer(kind: str, params):
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    # weight decay: a parameter handed a zero gradient instead of None would still move
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def _gpu(device: str, rank: int) -> str:
    """Where rank ``rank`` computes for a test's ``device``: "cpu"; for "cuda" and
    "cuda-side-stream", GPU ``rank`` where there are enough (GPU 0 for all on a single GPU)."""
    return "cpu" if device == "cpu" else f"cuda:{rank % torch.cuda.device_count()}"


def _train(
    model, opt, rank: int, size: int, passes: int = 1, device: str = "cpu", on: str | None = None
) -> None:
    """STEPS steps on this rank's shard; ``passes`` micro-batches accumulate per step. ``device``
    as `_gpu` takes it ("cuda-side-stream": every step on a stream of its own, non-blocking like
    torch's pool streams); ``on`` overrides the GPU."""
    on = on or _gpu(device, rank)
    x, y = (t.to(on) for t in _data(passes))
    if device == "cuda-side-stream":
        side = torch.cuda.Stream(on)
        side.wait_stream(torch.cuda.current_stream(on))  # the model's set-up, the broadcasts
        with torch.cuda.stream(side):
            _train_steps(model, opt, rank, size, passes, x, y)
        torch.cuda.synchronize(on)
    else:
        _train_steps(model, opt, rank, size, passes, x, y)


def _train_steps(model, opt, rank: int, size: int, passes: int, x, y) -> None:
    shard = slice(rank * GLOBAL_BATCH // size, (rank + 1) * GLOBAL_BATCH // size)
    for step in range(STEPS):
        opt.zero_grad()
        for p in range(passes):
            loss = torch.nn.functional.cross_entropy(model(x[step, p, shard]), y[step, p, shard])
            loss.backward()
        opt.step()


def _params(model) -> dict[str, np.ndarray]:
    return {name: p.detach().double().cpu().numpy().copy() for name, p in model.named_parameters()}


def _reference(kind: str, passes: int = 1) -> dict[str, np.ndarray]:
    model = _model()
    _train(model, _optimizer(kind, model.parameters()), 0, 1, passes)
    return _params(model)


def _assert_close(
    got: dict[str, np.ndarray], want: dict[str, np.ndarray], rtol: float, atol: float
) -> None:
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)


# --- DistributedOptimizer ------------------------------------------------------------------------


def _optimizer_body(rank, size, kind, compression, passes, device="cpu"):
    torch.set_num_threads(1)
    import ddlcore
    from ddlcore.integrations.torch import DistributedOptimizer, broadcast_parameters

    with ddlcore.init() as comm:
        model = _model(seed=rank).to(_gpu(device, rank))  # differs per rank until the broadcast
        broadcast_parameters(model, comm)
        opt = DistributedOptimizer(
            _optimizer(kind, model.parameters()),
            comm,
            model.named_parameters(),
            fusion_bytes=300,
            compression=compression,
            backward_passes_per_step=passes,
        )
        assert isinstance(opt, type(_optimizer(kind, [torch.zeros(1, requires_grad=True)])))
        assert len(opt._ddl.buckets) >= 3  # 300-byte buckets: several per backward
        _train(model, opt, rank, size, passes, device)
        assert model.unused.grad is None  # no rank computed one
        return _params(model)


@pytest.mark.parametrize("nprocs,kind", [(2, "sgd"), (3, "sgd"), (3, "adam")])
def test_distributed_optimizer_trains_like_one_process(nprocs, kind):
    want = _reference(kind)
    for got in run_ranks(_optimizer_body, nprocs, kind, None, 1, timeout=120):
        _assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_distributed_optimizer_accumulates_backward_passes():
    want = _reference("sgd", passes=2)
    for got in run_ranks(_optimizer_body, 2, "sgd", None, 2, timeout=120):
        _assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_distributed_optimizer_compressed(compression):
    want = _reference("sgd")
    got = run_ranks(_optimizer_body, 3, "sgd", compression, 1, timeout=120)
    for g in got:
        _assert_close(g, want, rtol=0, atol=2e-2 if compression == "bf16" else 2e-3)
    for g in got[1:]:  # the ranks still agree exactly
        _assert_close(g, got[0], rtol=0, atol=0)


# --- DDP communication hooks ---------------------------------------------------------------------


def _ddp_body(rank, size, hook_name, port, device="cpu"):
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddlcore
    from ddlcore.integrations import torch as ddl_torch

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        with ddlcore.init() as comm:
            model = _model(seed=0)
            del model.unused  # DDP expects every parameter in the loss
            model.to(_gpu(device, rank))
            ddp = DDP(model, bucket_cap_mb=0.0003)
            calls = []
            hook = getattr(ddl_torch, hook_name)
            ddp.register_comm_hook(comm, hook)  # DDP checks the hook's name and annotations
            launch = comm.allreduce_async

            def counted(*args, **kwargs):
                calls.append(1)
                return launch(*args, **kwargs)

            comm.allreduce_async = counted
            _train(ddp, _optimizer("sgd", ddp.parameters()), rank, size, device=device)
            assert len(calls) >= STEPS, (
                f"{len(calls)} allreduces in {STEPS} steps: DDP bypassed the hook"
            )
            return _params(model)
    finally:
        dist.destroy_process_group()


def _reference_without_unused() -> dict[str, np.ndarray]:
    return {k: v for k, v in _reference("sgd").items() if k != "unused"}


@pytest.mark.parametrize("nprocs", [2, 3])
def test_ddp_allreduce_hook_trains_like_one_process(nprocs):
    want = _reference_without_unused()
    for got in run_ranks(_ddp_body, nprocs, "allreduce_hook", free_port(), timeout=120):
        _assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hook_name", ["fp16_allreduce_hook", "bf16_allreduce_hook"])
def test_ddp_compression_hooks(hook_name):
    want = _reference_without_unused()
    got = run_ranks(_ddp_body, 2, hook_name, free_port(), timeout=120)
    for g in got:
        _assert_close(g, want, rtol=0, atol=2e-2 if hook_name.startswith("bf16") else 2e-3)
    _assert_close(got[1], got[0], rtol=0, atol=0)


# --- overlap: buckets are reduced while backward is still running --------------------------------


def _overlap_body(rank, size, port):
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddlcore
    from ddlcore.integrations.torch import DistributedOptimizer, allreduce_hook

    def deep_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])

    def record_launches(comm, events):
        launch = comm.allreduce_async

        def recorded(*args, **kwargs):
            events.append("allreduce")
            return launch(*args, **kwargs)

        comm.allreduce_async = recorded

    def record_backward_end(model, events):
        # the first layer's weight gets its gradient last: backward is over after this hook
        first = model[0].weight
        first.register_post_accumulate_grad_hook(lambda p: events.append("backward_end"))

    order = {}
    with ddlcore.init() as comm:
        events: list[str] = []
        record_launches(comm, events)
        model = deep_model()
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01), comm, fusion_bytes=300_000
        )
        record_backward_end(model, events)
        model(torch.randn(8, 256)).sum().backward()
        order["optimizer"] = list(events)
        opt.step()

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
        )
        try:
            events.clear()
            model = deep_model()
            ddp = DDP(model, bucket_cap_mb=0.3)
            ddp.register_comm_hook(comm, allreduce_hook)
            record_backward_end(model, events)
            for _ in range(2):  # DDP rebuilds its buckets after the first iteration
                events.clear()
                ddp(torch.randn(8, 256)).sum().backward()
            order["ddp"] = list(events)
        finally:
            dist.destroy_process_group()
    return order


def test_buckets_are_reduced_during_backward():
    for order in run_ranks(_overlap_body, 2, free_port(), timeout=120):
        for who, events in order.items():
            # six 256 KiB layers, ~300 KB buckets (DDP sizes its own): several allreduces, the
            # first ones started before the first layer's gradient exists
            assert events.count("allreduce") >= 3, (who, events)
            assert "backward_end" in events, (who, events)
            assert events[: events.index("backward_end")].count("allreduce") >= 2, (who, events)


# --- broadcasts ----------------------------------------------------------------------------------


def _optimizer_state_body(rank, size, device="cpu"):
    torch.set_num_threads(1)
    import ddlcore
    from ddlcore.integrations.torch import broadcast_optimizer_state, broadcast_parameters

    with ddlcore.init() as comm:
        model = _model(seed=rank).to(_gpu(device, rank))
        opt = torch.optim.Adam(model.parameters(), lr=0.001 * (rank + 1), betas=(0.8, 0.95))
        if rank == 0:  # only the root has taken steps: moments and step counts exist there
            _train(model, opt, 0, 1, device=device, on=_gpu(device, rank))
        broadcast_parameters(model.state_dict(), comm)
        broadcast_optimizer_state(opt, comm)
        sd = opt.state_dict()
        state = {
            (i, k): (v.double().cpu().numpy().copy() if torch.is_tensor(v) else v)
            for i, entry in sd["state"].items()
            for k, v in entry.items()
        }
        groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
        return _params(model), state, groups


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_broadcast_parameters_and_optimizer_state(device):
    _require_device(device)
    results = run_ranks(_optimizer_state_body, 3, device, timeout=120)
    params0, state0, groups0 = results[0]
    assert state0 and groups0[0]["lr"] == 0.001
    for params, state, groups in results[1:]:
        _assert_close(params, params0, rtol=0, atol=0)
        assert state.keys() == state0.keys()
        for key in state0:
            np.testing.assert_array_equal(state[key], state0[key], err_msg=str(key))
        assert groups == groups0
        assert tuple(groups[0]["betas"]) == (0.8, 0.95)


# --- misuse --------------------------------------------------------------------------------------


def _misuse_body(rank, size):
    torch.set_num_threads(1)
    import ddlcore
    from ddlcore.integrations.torch import (
        DistributedOptimizer,
        ParametersDifferError,
        broadcast_parameters,
    )

    messages = {}
    with ddlcore.init() as comm:
        # a different model on the last rank: every rank refuses, naming that rank
        model = _model(width=16 if rank < size - 1 else 17)
        try:
            DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
        except ddlcore.CollectiveMismatchError as exc:
            messages["model"] = str(exc)
        try:
            broadcast_parameters(model, comm)
        except ddlcore.CollectiveMismatchError as exc:
            messages["broadcast"] = str(exc)

        # the same model, initialised differently and never broadcast: the first step refuses
        model = _model(seed=rank)
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), comm, model.named_parameters()
        )
        before = _params(model)
        try:
            _train(model, opt, rank, size)
        except ParametersDifferError as exc:
            messages["params"] = str(exc)
            after = _params(model)
            messages["untouched"] = all(np.array_equal(before[k], after[k]) for k in before)

        # after a broadcast the same optimizer trains
        broadcast_parameters(model, comm)
        _train(model, opt, rank, size)
        messages["trained"] = True
        try:
            DistributedOptimizer(opt, comm)
        except ValueError as exc:
            messages["twice"] = str(exc)
        try:
            DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), comm, compression="int4"
            )
        except ValueError as exc:
            messages["compression"] = str(exc)
        try:
            DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "comm")
        except TypeError as exc:
            messages["comm"] = str(exc)
    return messages


def test_misuse_fails_on_every_rank_with_a_clear_message():
    size = 3
    for messages in run_ranks(_misuse_body, size, timeout=120):
        assert f"rank {size - 1} has" in messages["model"] and "same model" in messages["model"]
        assert f"rank {size - 1} has" in messages["broadcast"]
        assert "broadcast_parameters(model, comm)" in messages["params"]
        assert (
            "rank 1's parameters differ" in messages["params"] and "0.weight" in messages["params"]
        )
        assert messages["untouched"] and messages["trained"]
        assert "already a DistributedOptimizer" in messages["twice"]
        assert "compression='int4'" in messages["compression"]
        assert "ddlcore Communicator" in messages["comm"]


# --- the training loop's hazards -----------------------------------------------------------------


def _two_heads(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.ModuleDict(
        {"body": torch.nn.Linear(6, 8), "a": torch.nn.Linear(8, 3), "b": torch.nn.Linear(8, 3)}
    )


def _local_loss(model, x, y, rank: int, step: int):
    """Head b is in the loss on rank 0 only, and only on even steps: which parameters get a
    gradient depends on the rank and the data."""
    h = torch.tanh(model["body"](x))
    loss = torch.nn.functional.cross_entropy(model["a"](h), y)
    if rank == 0 and step % 2 == 0:
        loss = loss + model["b"](h).square().mean()
    return loss


def _hazards_reference(size: int) -> dict[str, np.ndarray]:
    """One process: the mean over the ranks' losses, the same schedule."""
    model = _two_heads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = _data()
    k = GLOBAL_BATCH // size
    for step in range(STEPS):
        opt.zero_grad()
        total = (
            sum(
                _local_loss(
                    model, x[step, 0, r * k : (r + 1) * k], y[step, 0, r * k : (r + 1) * k], r, step
                )
                for r in range(size)
            )
            / size
        )
        total.backward()
        opt.step()
        sched.step()
    return _params(model)


def _hazards_body(rank, size):
    torch.set_num_threads(1)
    import ddlcore
    from ddlcore.integrations.torch import DistributedOptimizer

    out = {}
    with ddlcore.init() as comm:
        model = _two_heads()
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)  # before wrapping
        opt = DistributedOptimizer(base, comm, model.named_parameters(), fusion_bytes=64)
        pre_hook_calls = []
        opt.register_step_pre_hook(lambda *_: pre_hook_calls.append(1))
        x, y = _data()
        k = GLOBAL_BATCH // size
        shard = slice(rank * k, (rank + 1) * k)
        losses = []
        for step in range(STEPS):
            opt.zero_grad()
            # a pass whose gradients are thrown away (e.g. a skipped batch): zero_grad drops them
            _local_loss(model, x[step, 0, shard] + 1.0, y[step, 0, shard], rank, step).backward()
            opt.zero_grad()
            loss = _local_loss(model, x[step, 0, shard], y[step, 0, shard], rank, step)
            loss.backward()
            # a collective between backward and step(): the buckets backward left go first
            losses.append(float(comm.allreduce(loss.detach().reshape(1), op="avg")[0]))
            opt.step()
            sched.step()
        out["params"] = _params(model)
        out["losses"] = losses
        out["pre_hook_calls"] = len(pre_hook_calls)

        # one backward too many before step(): every rank refuses, and zero_grad recovers
        opt.zero_grad()
        for _ in range(2):
            try:
                _local_loss(model, x[0, 0, shard], y[0, 0, shard], rank, 1).backward()
            except ddlcore.DDLError as exc:
                out["twice"] = str(exc)
        opt.zero_grad()
        _local_loss(model, x[0, 0, shard], y[0, 0, shard], rank, 1).backward()
        opt.step()
        out["after"] = _params(model)
    return out


@pytest.mark.parametrize("nprocs", [2, 3])
def test_training_loop_hazards(nprocs):
    """Data-dependent unused parameters with a collective between backward and step(), a pass
    dropped by zero_grad, an LR scheduler made before wrapping, step hooks called once."""
    want = _hazards_reference(nprocs)
    results = run_ranks(_hazards_body, nprocs, timeout=120)
    for out in results:
        _assert_close(out["params"], want, rtol=1e-5, atol=1e-6)
        assert out["pre_hook_calls"] == STEPS
        assert "got a gradient after its bucket was sent" in out["twice"], out.get("twice")
        assert out["losses"] == results[0]["losses"]
        _assert_close(out["after"], results[0]["after"], rtol=0, atol=0)


def _add_group_and_closure_body(rank, size):
    torch.set_num_threads(1)
    import ddlcore
    from ddlcore.integrations.torch import DistributedOptimizer

    with ddlcore.init() as comm:
        model = _model()
        first, last = list(model[:4].parameters()), list(model[4].parameters())
        opt = DistributedOptimizer(torch.optim.SGD(first, lr=0.1), comm, fusion_bytes=256)
        opt.add_param_group({"params": last, "lr": 0.05})  # gets buckets and hooks too
        _train(model, opt, rank, size)
        sgd = _params(model)

        model = _model()
        opt = DistributedOptimizer(
            torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4), comm, fusion_bytes=256
        )
        x, y = _data()
        shard = slice(rank * GLOBAL_BATCH // size, (rank + 1) * GLOBAL_BATCH // size)

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[0, 0, shard]), y[0, 0, shard])
            loss.backward()
            return loss

        opt.step(closure)
        return sgd, _params(model)


def test_add_param_group_and_closure():
    model = _model()
    opt = torch.optim.SGD(list(model[:4].parameters()), lr=0.1)
    opt.add_param_group({"params": list(model[4].parameters()), "lr": 0.05})
    _train(model, opt, 0, 1)
    want_sgd = _params(model)
    model = _model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x, y = _data()

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[0, 0]), y[0, 0])
        loss.backward()
        return loss

    opt.step(closure)
    want_lbfgs = _params(model)
    for sgd, lbfgs in run_ranks(_add_group_and_closure_body, 2, timeout=120):
        _assert_close(sgd, want_sgd, rtol=1e-5, atol=1e-6)
        _assert_close(lbfgs, want_lbfgs, rtol=1e-4, atol=1e-5)


def _sum_compressed_body(rank, size):
    torch.set_num_threads(1)
    import ddlcore
    from ddlcore.integrations.torch import DistributedOptimizer

    with ddlcore.init() as comm:
        model = _model()
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1 / size),
            comm,
            fusion_bytes=300,
            compression="fp16",
            op="sum",
        )
        _train(model, opt, rank, size)
        return _params(model)


def test_sum_of_compressed_gradients():
    model = _model()
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 0, 1)
    want = _params(model)
    for got in run_ranks(_sum_compressed_body, 3, timeout=120):
        _assert_close(got, want, rtol=0, atol=2e-3)


def _odd_buffers_body(rank, size):
    torch.set_num_threads(1)
    import ddlcore
    from ddlcore.integrations.torch import broadcast_optimizer_state, broadcast_parameters

    out = {}
    with ddlcore.init() as comm:
        model = _model(seed=rank)
        model.register_buffer("mask", torch.arange(7) % (rank + 2) == 0)
        model.register_buffer("counts", torch.arange(5, dtype=torch.int16) * (rank + 1))
        model.register_buffer("phase", torch.full((3,), complex(rank, -rank)))
        model.register_buffer(
            "strided", torch.arange(12.0).reshape(3, 4).t() * (rank + 1), persistent=True
        )
        broadcast_parameters(model, comm)
        out["buffers"] = {k: v.clone().numpy() for k, v in model.named_buffers()}
        out["strided_contiguous"] = model.strided.is_contiguous()

        opt = torch.optim.SGD(model.parameters(), lr=np.float32(0.1))  # NumPy scalar: no JSON
        try:
            broadcast_optimizer_state(opt, comm)
        except TypeError as exc:
            out["error"] = str(exc)
    return out


def test_broadcast_any_dtype_and_a_root_side_error_reaches_every_rank():
    results = run_ranks(_odd_buffers_body, 3, timeout=120)
    for out in results:
        for name, value in results[0]["buffers"].items():
            np.testing.assert_array_equal(out["buffers"][name], value, err_msg=name)
        assert not out["strided_contiguous"]
    np.testing.assert_array_equal(results[1]["buffers"]["mask"], np.arange(7) % 2 == 0)
    assert (
        "float32" in results[0]["error"]
        and "cannot be sent without pickling" in results[0]["error"]
    )
    for out in results[1:]:
        assert "rank 0's optimizer state cannot be sent" in out["error"]


# --- CUDA tensors (a real GPU only; PyTorch CUDA tensors have no simulator) ----------------------
# The same bodies as above on CUDA tensors, rank r on GPU r (all on GPU 0 with a single one):
# the stream ordering of the packing kernels, the collectives' ready events, DDP's futures of
# CUDA tensors, and training on a non-blocking side stream.


@pytest.mark.parametrize("device", ["cuda", "cuda-side-stream"])
@pytest.mark.parametrize("nprocs,compression", [(1, None), (2, None), (2, "fp16"), (2, "bf16")])
def test_distributed_optimizer_on_cuda_tensors(nprocs, compression, device):
    _require_device(device)
    want = _reference("sgd")
    atol = {None: 1e-5, "fp16": 2e-3, "bf16": 2e-2}[compression]
    for got in run_ranks(_optimizer_body, nprocs, "sgd", compression, 1, device, timeout=180):
        _assert_close(got, want, rtol=1e-4 if compression is None else 0, atol=atol)


@pytest.mark.parametrize("device", ["cuda", "cuda-side-stream"])
@pytest.mark.parametrize(
    "hook_name", ["allreduce_hook", "fp16_allreduce_hook", "bf16_allreduce_hook"]
)
def test_ddp_hooks_on_cuda_tensors(hook_name, device):
    _require_device(device)
    want = _reference_without_unused()
    atol = {"allreduce_hook": 1e-5, "fp16_allreduce_hook": 2e-3, "bf16_allreduce_hook": 2e-2}
    got = run_ranks(_ddp_body, 2, hook_name, free_port(), device, timeout=180)
    for g in got:
        _assert_close(
            g, want, rtol=1e-4 if hook_name == "allreduce_hook" else 0, atol=atol[hook_name]
        )
