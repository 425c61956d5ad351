"""FSDP2 (``torch.distributed.fsdp.fully_shard``) training on CPU over a given backend, in a
program that never imports ddlcore: torch finds "ddl" through its ``torch.backends`` entry
point. A small MLP, each layer and the root sharded over a 1-D DeviceMesh (one dimension not
divisible by the world size, so shards are padded), trains a few steps with gradient
accumulation, in float32, then under bfloat16 MixedPrecisionPolicies (bfloat16 parameters
gathered; gradients reduced in float32, then in bfloat16). The backends run one after the other
in the same processes (one torch start-up for all); for each, rank 0 saves every step's loss and
the full parameters to OUT/<backend>.pt, for a test to compare across backends.

    torchrun --nproc-per-node 2 torch_fsdp_job.py ddl,gloo OUT
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

STEPS, MICRO = 4, 2


def train(mesh, rank, mp_policy):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(12, 33), torch.nn.GELU(), torch.nn.Linear(33, 17)]
    layers += [torch.nn.LayerNorm(17), torch.nn.Linear(17, 5)]
    model = torch.nn.Sequential(*layers)
    kwargs = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for layer in model:
        if any(p.requires_grad for p in layer.parameters()):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(MICRO):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            x, y = torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)
            loss = torch.nn.functional.mse_loss(model(x).float(), y) / MICRO
            model.set_requires_gradient_sync(micro == MICRO - 1)
            loss.backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            losses.append(mean.item())
        opt.step()
    # The full parameters (every rank takes part in the all-gather).
    params = {name: p.full_tensor().detach().float() for name, p in model.named_parameters()}
    return torch.tensor(losses, dtype=torch.float64), params


def run(backend, out_path):
    dist.init_process_group(backend, timeout=timedelta(seconds=30))
    rank, size = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == backend, dist.get_backend()
    mesh = init_device_mesh("cpu", (size,))
    results = {}
    for name, policy in (
        ("fp32", None),
        ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
        ("bf16-reduce", MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
    ):
        losses, params = train(mesh, rank, policy)
        results[name] = {"losses": losses, **{f"param/{k}": v for k, v in params.items()}}
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.write(f"fsdp ok: {backend} rank {rank} of {size}\n")


backends = sys.argv[1].split(",")
for backend in backends:
    run(backend, f"{sys.argv[2]}/{backend}.pt")
if "gloo" in backends:
    # torch's gloo groups abort the interpreter's exit now and then ("terminate called without
    # an active exception", SIGABRT) after destroy_process_group, with ddlcore not imported at
    # all (TORCH_DEVICE_BACKEND_AUTOLOAD=0, this job with gloo alone: 2 of 74 runs). Everything
    # is written and flushed: end without the interpreter's finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
