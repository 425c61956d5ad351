"""A torch.distributed program on the backend "ddl" that never imports ddlcore (torch finds the
backend through its ``torch.backends`` entry point). Every supported collective (reduce,
gather, scatter and all-to-all too) over float32,
float64, int32 and int64 tensors of sizes 0, 1, primes and sizes not divisible by the world
size, every op, synchronous and asynchronous, is checked against a reference computed here from
every rank's inputs (seeded); so are functional collectives and DTensor; then DDP trains the same model on "ddl" and on a gloo group, and
their parameters must match. Prints "torch backend ok: rank R of N" at the end.

    python torch_backend_job.py [cpu|cuda]   # where the tensors live (cuda: rank r on GPU r % n)
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("ddl", timeout=timedelta(seconds=25))
rank, size = dist.get_rank(), dist.get_world_size()
DEVICE = torch.device("cpu")
if sys.argv[1:] == ["cuda"]:
    DEVICE = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(DEVICE)
world = dist.group.WORLD
assert dist.get_backend() == "ddl" and type(world).__name__ == "ProcessGroupDDL", world
assert world.communicator.timeout == 25, world.communicator.timeout  # init's timeout= honored

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64]
SIZES = [0, 1, 7, 33, 4099]  # 0, 1, primes: none divisible by the world size of 2
OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.PRODUCT: "prod",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
}
case = 0


def inputs(n, dtype, shape=None):
    """Every rank's input of this case (the same on every rank: seeded by case and rank)."""
    global case
    case += 1
    out = []
    for r in range(size):
        g = torch.Generator().manual_seed(1000 * case + r)
        if dtype.is_floating_point:
            x = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
        else:  # small values: a product of every rank's stays far inside int32
            x = torch.randint(-9, 10, (n,), generator=g, dtype=dtype)
        out.append((x.reshape(shape) if shape else x).to(DEVICE))
    return out


def reduced(xs, op):
    stacked = torch.stack(xs)
    if op == "sum":
        return stacked.sum(0, dtype=stacked.dtype)
    if op == "prod":
        return stacked.prod(0, dtype=stacked.dtype)
    if op == "min":
        return stacked.min(0).values
    if op == "max":
        return stacked.max(0).values
    if stacked.dtype.is_floating_point:
        return stacked.sum(0) / size
    return torch.div(stacked.sum(0), size, rounding_mode="floor")  # ddlcore's integer avg


def check(got, want, what):
    assert got.device == DEVICE, (what, got.device)
    got, want = got.cpu(), want.cpu()
    if want.dtype.is_floating_point:
        rtol = 1e-5 if want.dtype == torch.float32 else 1e-12
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol, msg=what)
    else:
        assert torch.equal(got, want), (what, got, want)


def run(work_or_none, async_op, outputs, what):
    """Wait for an async collective, and check that its future holds the output tensors."""
    if not async_op:
        assert work_or_none is None
        return
    work = work_or_none
    assert work.wait() is True, what
    value = work.get_future().wait()
    assert [t.data_ptr() for t in value] == [t.data_ptr() for t in outputs], what
    assert work.is_completed() and work.is_success(), what


for dtype in DTYPES:
    for n in SIZES:
        for torch_op, op in OPS.items():
            xs = inputs(n, dtype)
            async_op = (n + case) % 2 == 0
            t = xs[rank].clone()
            run(
                dist.all_reduce(t, op=torch_op, async_op=async_op),
                async_op,
                [t],
                f"allreduce {dtype} {n} {op}",
            )
            check(t, reduced(xs, op), f"allreduce {dtype} n={n} {op}")

            # reduce_scatter_tensor: every rank's n * size elements, block `rank` to this rank
            xs = inputs(n * size, dtype)
            out = torch.empty(n, dtype=dtype, device=DEVICE)
            run(
                dist.reduce_scatter_tensor(out, xs[rank].clone(), op=torch_op, async_op=async_op),
                async_op,
                [out],
                "rs tensor",
            )
            check(out, reduced(xs, op)[rank * n : (rank + 1) * n], f"reduce_scatter_tensor {op}")
            # reduce_scatter of a list
            out = torch.empty(n, dtype=dtype, device=DEVICE)
            dist.reduce_scatter(
                out,
                list(xs[rank].clone().split(n))
                if n
                else [torch.empty(0, dtype=dtype, device=DEVICE)] * size,
                op=torch_op,
            )
            check(out, reduced(xs, op)[rank * n : (rank + 1) * n], f"reduce_scatter {op}")
            # reduce: the root's tensor gets the result, the others' stay as they were
            xs, root = inputs(n, dtype), case % size
            t = xs[rank].clone()
            run(dist.reduce(t, dst=root, op=torch_op, async_op=async_op), async_op, [t], "reduce")
            check(t, reduced(xs, op) if rank == root else xs[rank], f"reduce {dtype} {n} {op}")

        xs = inputs(n, dtype)
        outs = [torch.full((n,), -1, dtype=dtype, device=DEVICE) for _ in range(size)]
        run(dist.all_gather(outs, xs[rank], async_op=True), True, outs, "allgather")
        for r in range(size):
            check(outs[r], xs[r], f"allgather {dtype} n={n} from {r}")
        flat = torch.empty(n * size, dtype=dtype, device=DEVICE)
        dist.all_gather_into_tensor(flat, xs[rank])
        check(flat, torch.cat(xs), f"all_gather_into_tensor {dtype} n={n}")
        for root in range(size):
            t = xs[rank].clone()
            run(dist.broadcast(t, src=root, async_op=True), True, [t], "broadcast")
            check(t, xs[root], f"broadcast {dtype} n={n} root {root}")
            # gather into the root's list; scatter the root's list
            outs = [torch.full((n,), -1, dtype=dtype, device=DEVICE) for _ in range(size)]
            dist.gather(xs[rank], outs if rank == root else None, dst=root)
            for r in range(size):
                check(
                    outs[r], xs[r] if rank == root else torch.full((n,), -1, dtype=dtype), "gather"
                )
            t = torch.full((n,), -1, dtype=dtype, device=DEVICE)
            dist.scatter(t, [x.clone() for x in xs] if rank == root else None, src=root)
            check(t, xs[rank], f"scatter {dtype} n={n} root {root}")
        # all_to_all_single: equal blocks, then rows split unevenly (rank s sends d rows
        # (s + d + n) % 3 of them), and all_to_all of a list of tensors of those sizes
        xs = inputs(2 * n * size, dtype, (2 * n * size, 1) if n else None)
        out = torch.empty_like(xs[rank])
        run(dist.all_to_all_single(out, xs[rank], async_op=True), True, [out], "all_to_all")
        want = torch.cat([x[rank * 2 * n : (rank + 1) * 2 * n] for x in xs])
        check(out, want, f"all_to_all_single {dtype} n={n}")
        rows = [[(s + d + n) % 3 for d in range(size)] for s in range(size)]
        ys = [inputs(sum(rows[s]) * 2, dtype, (sum(rows[s]), 2))[s] for s in range(size)]
        parts = [y.split(rows[s]) for s, y in enumerate(ys)]
        out = torch.empty(sum(r[rank] for r in rows), 2, dtype=dtype, device=DEVICE)
        dist.all_to_all_single(out, ys[rank], [r[rank] for r in rows], rows[rank])
        check(out, torch.cat([parts[s][rank] for s in range(size)]), "all_to_all_single split")
        outs = [torch.empty(r[rank], 2, dtype=dtype, device=DEVICE) for r in rows]
        dist.all_to_all(outs, list(parts[rank]))
        for s in range(size):
            check(outs[s], parts[s][rank], f"all_to_all {dtype} from {s}")

# Non-contiguous tensors: the collective works on a contiguous copy, written back.
xs = inputs(12, torch.float64, (3, 4))
t = xs[rank].clone().t()
dist.all_reduce(t)
check(t, reduced(xs, "sum").t(), "allreduce of a transposed tensor")
t = xs[rank].clone()
dist.broadcast(t[:, 1], src=1)
check(t[:, 1], xs[1][:, 1], "broadcast of a strided column")

# A call torch waits for at once on a plain contiguous CPU tensor runs there and then and gives
# no work (torch's dist.* wait on none); any other gets a work to wait on. Sync broadcast too.
group = dist.group.WORLD
xs = inputs(7, torch.float32)
for async_op, make in [
    (False, lambda: xs[rank].clone()),
    (True, lambda: xs[rank].clone()),
    (False, lambda: xs[rank].clone().requires_grad_()),  # .numpy() refuses it
    (False, lambda: xs[rank].clone().to(torch.bfloat16)),  # NumPy has no bfloat16
]:
    t = make()
    opts = dist.AllreduceOptions()
    opts.asyncOp = async_op
    work = group.allreduce([t], opts)
    plain = DEVICE.type == "cpu" and not async_op and t.dtype == torch.float32
    if (plain and not t.requires_grad) != (work is None):
        sys.exit(f"allreduce, asyncOp={async_op}, {t.dtype}: got {work!r}")
    if work is not None:
        work.wait()
    got, want = t.detach().float().cpu(), reduced(xs, "sum").cpu()
    tol = 3e-2 if t.dtype == torch.bfloat16 else 1e-5  # bfloat16: 8 bits of mantissa
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=f"allreduce {t.dtype}")
for root in range(size):
    t = xs[rank].clone()
    dist.broadcast(t, src=root)
    check(t, xs[root], f"waited broadcast from {root}")

# Coalesced: several tensors of two dtypes in one allreduce_coalesced; several all-gathers and
# reduce-scatters into tensors in one coalesced call each.
a, b, c = inputs(5, torch.float32), inputs(0, torch.float64), inputs(11, torch.int64)
mine = [a[rank].clone(), b[rank].clone(), c[rank].clone()]
with dist._coalescing_manager(async_ops=True) as cm:
    for x in mine:
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
cm.wait()
for x, xs in zip(mine, (a, b, c), strict=True):
    check(x, reduced(xs, "max"), "coalesced allreduce")
a, b = inputs(3, torch.float32), inputs(4, torch.int32)
flats = [
    torch.empty(3 * size, device=DEVICE),
    torch.empty(4 * size, dtype=torch.int32, device=DEVICE),
]
with dist._coalescing_manager():
    dist.all_gather_into_tensor(flats[0], a[rank])
    dist.all_gather_into_tensor(flats[1], b[rank])
check(flats[0], torch.cat(a), "coalesced all_gather_into_tensor")
check(flats[1], torch.cat(b), "coalesced all_gather_into_tensor")
a = inputs(3 * size, torch.float64)
out = torch.empty(3, dtype=torch.float64, device=DEVICE)
with dist._coalescing_manager():
    dist.reduce_scatter_tensor(out, a[rank].clone())
check(out, reduced(a, "sum")[rank * 3 : (rank + 1) * 3], "coalesced reduce_scatter_tensor")
dist.barrier()

# The object collectives on gather and scatter.
objs = [None] * size if rank == 0 else None
dist.gather_object({"rank": rank, "pad": "x" * 5 * rank}, objs, dst=0)
assert rank != 0 or [o["rank"] for o in objs] == list(range(size)), objs
got = [None]
dist.scatter_object_list(
    got, [f"obj{r}" for r in range(size)] if rank == size - 1 else None, src=size - 1
)
assert got == [f"obj{rank}"], got

# What ddlcore cannot do yet says so, before anything is sent.
for what, call in [
    (
        "ReduceOp.BAND",
        lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND),
    ),
    (
        "input_split_sizes",
        lambda: dist.all_to_all_single(torch.ones(2), torch.ones(2), [1] * size, [2] * size),
    ),
]:
    try:
        call()
    except (ValueError, dist.DistError) as exc:
        assert what in str(exc), (what, exc)
    else:
        raise AssertionError(f"{what}: no error")

# DDP on "ddl" (C++ reducer, then torch's own allreduce hook) against DDP on a gloo group.
gloo = dist.new_group(backend="gloo")


def train(process_group, hook=None):
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(
            DEVICE
        ),
        process_group=process_group,
    )
    if hook is not None:
        model.register_comm_hook(process_group, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 3, generator=g)
        x, y = x.to(DEVICE), y.to(DEVICE)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


on_gloo = train(gloo)
for params in (train(world), train(world, default_hooks.allreduce_hook)):
    for p, q in zip(params, on_gloo, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)

# Functional collectives and DTensor reach the group from C++ (by its name, through DeviceMesh).
mesh = init_device_mesh(DEVICE.type, (size,))
xs = inputs(3 * size, torch.float32)
check(funcol.all_reduce(xs[rank], "sum", mesh).wait(), reduced(xs, "sum"), "funcol.all_reduce")
check(funcol.all_gather_tensor(xs[rank], 0, mesh).wait(), torch.cat(xs), "funcol.all_gather")
check(
    funcol.reduce_scatter_tensor(xs[rank], "max", 0, mesh).wait(),
    reduced(xs, "max")[rank * 3 : (rank + 1) * 3],
    "funcol.reduce_scatter_tensor",
)
full = torch.arange(4.0 * size, device=DEVICE).reshape(2 * size, 2)
check(distribute_tensor(full, mesh, [Shard(0)]).to_local(), full.chunk(size)[rank], "distribute")
shard = DTensor.from_local(xs[rank], mesh, [Shard(0)])
check(shard.redistribute(mesh, [Replicate()]).to_local(), torch.cat(xs), "DTensor replicate")
check((shard * 2).sum().full_tensor(), 2 * torch.cat(xs).sum(), "DTensor partial sum")

# A group over every rank is a communicator of its own, met through the same store.
everyone = dist.new_group(backend="ddl")
assert everyone.communicator is not world.communicator
xs = inputs(5, torch.int64)
t = xs[rank].clone()
dist.all_reduce(t, op=dist.ReduceOp.PRODUCT, group=everyone)
check(t, reduced(xs, "prod"), "allreduce on new_group()")
dist.destroy_process_group()

# Made again (torch reuses the store's prefix): the new communicator must not meet at the
# address of the last one's store.
dist.init_process_group("ddl")
t = torch.tensor([rank + 1.0], device=DEVICE)
dist.all_reduce(t)
check(t, torch.tensor([size * (size + 1) / 2]), "allreduce after init_process_group again")
dist.destroy_process_group()
sys.stdout.write(f"torch backend ok: rank {rank} of {size}\n")
