"""bool tensors on the backend "ddl" against gloo, in the same processes: a gloo group over every
rank beside the default "ddl" one, the same random inputs (seeded per case and rank) through
both. all_reduce (sync and async), reduce (to the first and the last rank), reduce_scatter_tensor,
all_gather_into_tensor and broadcast, with SUM, PRODUCT, MIN and MAX, at sizes 0, 1, primes and
sizes no world size divides, must give gloo's truth values; ddl's bytes stay 0 or 1 (gloo's SUM
adds them: True + True is the byte 2). AVG has no bool result on either (ddl: TypeError). Never
imports ddlcore; ``init_process_group`` as written, under any launcher (mpiexec, srun too).
Prints "torch bool ok: rank R of N" at the end.

    python torch_bool_job.py [ddl://]   # init_method (default: torch's, env://)
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

init_method = sys.argv[1] if len(sys.argv) > 1 else None
dist.init_process_group("ddl", init_method=init_method, timeout=timedelta(seconds=25))
rank, size = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == "ddl", dist.get_backend()
gloo = dist.new_group(backend="gloo")

# torch 2.13 renamed them (the old names warn)
reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
SIZES = [0, 1, 2, 7, 13, 4099]
OPS = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
case = 0


def random_bool(n):
    """This rank's input of the next case: mostly True for some cases, mostly False for others,
    so that both AND and OR have True and False elements to give."""
    global case
    case += 1
    gen = torch.Generator().manual_seed(1000 * case + rank)
    return torch.rand(n, generator=gen) < (0.9 if case % 2 else 0.3)


def truth(t):
    """The truth values of a bool tensor, whatever its bytes (gloo's SUM leaves a 2)."""
    return t.view(torch.uint8) != 0


def canonical(t, what):
    assert t.dtype == torch.bool, (what, t.dtype)
    assert t.numel() == 0 or int(t.view(torch.uint8).max()) <= 1, (what, t.view(torch.uint8))


def same(ddl, ref, what):
    canonical(ddl, what)
    assert torch.equal(truth(ddl), truth(ref)), (what, ddl, ref)


for n in SIZES:
    for op in OPS:
        x = random_bool(n)
        what = f"n={n} op={op}"
        ours, theirs = x.clone(), x.clone()
        dist.all_reduce(ours, op=op)
        dist.all_reduce(theirs, op=op, group=gloo)
        same(ours, theirs, f"all_reduce {what}")
        ours = x.clone()
        dist.all_reduce(ours, op=op, async_op=True).wait()
        same(ours, theirs, f"all_reduce async {what}")
        for root in {0, size - 1}:
            ours, ref = x.clone(), x.clone()
            dist.reduce(ours, dst=root, op=op)
            dist.reduce(ref, dst=root, op=op, group=gloo)
            if rank == root:
                same(ours, ref, f"reduce to {root} {what}")
        big = random_bool(n * size)
        ours = torch.empty(n, dtype=torch.bool)
        ref = torch.empty(n, dtype=torch.bool)
        reduce_scatter(ours, big.clone(), op=op)
        reduce_scatter(ref, big.clone(), op=op, group=gloo)
        same(ours, ref, f"reduce_scatter_tensor {what}")
    ours = torch.empty(n * size, dtype=torch.bool)
    ref = torch.empty(n * size, dtype=torch.bool)
    all_gather(ours, x)
    all_gather(ref, x, group=gloo)
    same(ours, ref, f"all_gather_into_tensor n={n}")
    ours, ref = x.clone(), x.clone()
    dist.broadcast(ours, src=size - 1)
    dist.broadcast(ref, src=size - 1, group=gloo)
    same(ours, ref, f"broadcast n={n}")

# A stop flag, the pattern this is for: any rank's True stops every rank.
stop = torch.tensor(rank == size - 1)
dist.all_reduce(stop, op=dist.ReduceOp.MAX)
assert bool(stop), stop
try:
    dist.all_reduce(torch.ones(3, dtype=torch.bool), op=dist.ReduceOp.AVG)
except TypeError as exc:
    assert "avg" in str(exc), exc
else:
    raise AssertionError("AVG of bool did not raise")
dist.barrier()
sys.stdout.write(f"torch bool ok: rank {rank} of {size}\n")
dist.destroy_process_group()
