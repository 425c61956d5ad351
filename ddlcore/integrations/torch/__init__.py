"""PyTorch integration: DDP communication hooks, a Horovod-style optimizer wrapper, broadcasts.

Three ways in, all over a `ddlcore.Communicator` (``comm = ddlcore.init()``):

* DDP keeps its bucketing and hands each gradient bucket to ddlcore (`hooks`)::

      model = DDP(model)                                  # needs torch.distributed (gloo) for setup
      model.register_comm_hook(comm, allreduce_hook)      # or fp16_/bf16_allreduce_hook

* No DDP at all, Horovod's way (`optimizer`, `broadcast`)::

      broadcast_parameters(model, comm)                   # every rank starts from rank 0's weights
      opt = DistributedOptimizer(opt, comm, model.named_parameters())
      broadcast_optimizer_state(opt, comm)

  Gradients are fused into buckets of up to ``DDL_FUSION_BYTES``, each allreduced
  asynchronously the moment backward has produced it; `step()` waits for the last ones.

* Or torch.distributed itself on ddlcore: ``dist.init_process_group("ddl")`` (`backend`;
  importing this package registers it, and torch registers it through an entry point even when
  the script never imports ddlcore).

Tensors are handed to ddlcore without copies (DLPack on the host, ``__cuda_array_interface__``
on a GPU, whose data takes ddlcore's GPU path). ``pip install 'ddlcore[torch]'``.
"""

from importlib import import_module as _import_module
from typing import TYPE_CHECKING, Any

from ddlcore.errors import ParametersDifferError
from ddlcore.integrations.torch.autoload import register_ddl
from ddlcore.integrations.torch.backend import ProcessGroupDDL

if TYPE_CHECKING:
    from ddlcore.integrations.torch.broadcast import (
        broadcast_optimizer_state,
        broadcast_parameters,
    )
    from ddlcore.integrations.torch.hooks import (
        allreduce_hook,
        bf16_allreduce_hook,
        fp16_allreduce_hook,
    )
    from ddlcore.integrations.torch.optimizer import DistributedOptimizer

# Imported on first use: torch imports this package at every ``import torch`` (the backend's
# entry point), which must not pay for the Communicator and the kernels.
_LAZY = {
    "broadcast_optimizer_state": "broadcast",
    "broadcast_parameters": "broadcast",
    "allreduce_hook": "hooks",
    "bf16_allreduce_hook": "hooks",
    "fp16_allreduce_hook": "hooks",
    "DistributedOptimizer": "optimizer",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


register_ddl()  # registers "ddl"; quietly, as torch's entry point imports this package too

__all__ = [
    "DistributedOptimizer",
    "ParametersDifferError",
    "ProcessGroupDDL",
    "allreduce_hook",
    "bf16_allreduce_hook",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "fp16_allreduce_hook",
]
