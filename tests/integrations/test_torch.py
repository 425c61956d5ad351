"""PyTorch integration on real processes: the DDP hooks and the DistributedOptimizer train exactly
like one process on the whole batch, buckets are reduced while backward still runs, the
broadcasts make ranks agree, and misuse fails on every rank with a message that says what to do.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import free_port, require, run_ranks

try:
    import torch
except ImportError:  # pragma: no cover - the torch extra is part of CI's install
    torch = None

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4: every rank gets an equal shard
STEPS = 4


@pytest.fixture(autouse=True)
def _needs_torch():
    require(torch is not None, "torch is not installed (pip install 'ddlcore[torch]')")


# --- a small model, its data, and the single-process reference -----------------------------------

def _model(seed: int = 0, width: int = 16):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, 3))
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
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train(model, opt, rank: int, size: int, passes: int = 1) -> None:
    """STEPS steps on this rank's shard; ``passes`` micro-batches accumulate per step."""
    x, y = _data(passes)
    shard = slice(rank * GLOBAL_BATCH // size, (rank + 1) * GLOBAL_BATCH // size)
    for step in range(STEPS):
        opt.zero_grad()
        for p in range(passes):
            loss = torch.nn.functional.cross_entropy(model(x[step, p, shard]), y[step, p, shard])
            loss.backward()
        opt.step()


def _params(model) -> dict[str, np.ndarray]:
    return {name: p.detach().double().numpy().copy() for name, p in model.named_parameters()}


def _reference(kind: str, passes: int = 1) -> dict[str, np.ndarray]:
    model = _model()
    _train(model, _optimizer(kind, model.parameters()), 0, 1, passes)
    return _params(model)


def _assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], rtol: float,
                  atol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)


# --- DistributedOptimizer ------------------------------------------------------------------------

def _optimizer_body(rank, size, kind, compression, passes):
    torch.set_num_threads(1)
    import ddlcore
    from ddlcore.integrations.torch import DistributedOptimizer, broadcast_parameters

    with ddlcore.init() as comm:
        model = _model(seed=rank)  # different on every rank until the broadcast
        broadcast_parameters(model, comm)
        opt = DistributedOptimizer(_optimizer(kind, model.parameters()), comm,
                                   model.named_parameters(), fusion_bytes=300,
                                   compression=compression, backward_passes_per_step=passes)
        assert isinstance(opt, type(_optimizer(kind, [torch.zeros(1, requires_grad=True)])))
        assert len(opt._ddl_buckets) >= 3  # 300-byte buckets: several per backward
        _train(model, opt, rank, size, passes)
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

def _ddp_body(rank, size, hook_name, port):
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddlcore
    from ddlcore.integrations import torch as ddl_torch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        with ddlcore.init() as comm:
            model = _model(seed=0)
            del model.unused  # DDP expects every parameter in the loss
            ddp = DDP(model, bucket_cap_mb=0.0003)
            calls = []
            hook = getattr(ddl_torch, hook_name)
            ddp.register_comm_hook(comm, hook)  # DDP checks the hook's name and annotations
            launch = comm.allreduce_async

            def counted(*args, **kwargs):
                calls.append(1)
                return launch(*args, **kwargs)

            comm.allreduce_async = counted
            _train(ddp, _optimizer("sgd", ddp.parameters()), rank, size)
            assert len(calls) >= STEPS, f"{len(calls)} allreduces in {STEPS} steps: DDP bypassed the hook"
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
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), comm,
                                   fusion_bytes=300_000)
        record_backward_end(model, events)
        model(torch.randn(8, 256)).sum().backward()
        order["optimizer"] = list(events)
        opt.step()

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size)
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
            assert events[:events.index("backward_end")].count("allreduce") >= 2, (who, events)


# --- broadcasts ----------------------------------------------------------------------------------

def _optimizer_state_body(rank, size):
    torch.set_num_threads(1)
    import ddlcore
    from ddlcore.integrations.torch import broadcast_optimizer_state, broadcast_parameters

    with ddlcore.init() as comm:
        model = _model(seed=rank)
        opt = torch.optim.Adam(model.parameters(), lr=0.001 * (rank + 1), betas=(0.8, 0.95))
        if rank == 0:  # only the root has taken steps: moments and step counts exist there
            _train(model, opt, 0, 1)
        broadcast_parameters(model.state_dict(), comm)
        broadcast_optimizer_state(opt, comm)
        sd = opt.state_dict()
        state = {(i, k): (v.double().numpy().copy() if torch.is_tensor(v) else v)
                 for i, entry in sd["state"].items() for k, v in entry.items()}
        groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
        return _params(model), state, groups


def test_broadcast_parameters_and_optimizer_state():
    results = run_ranks(_optimizer_state_body, 3, timeout=120)
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
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm,
                                   model.named_parameters())
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
            DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm,
                                 compression="int4")
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
        assert "rank 1's parameters differ" in messages["params"] and "0.weight" in messages["params"]
        assert messages["untouched"] and messages["trained"]
        assert "already a DistributedOptimizer" in messages["twice"]
        assert "compression='int4'" in messages["compression"]
        assert "ddlcore Communicator" in messages["comm"]
