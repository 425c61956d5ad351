"""ddlcore: topology-aware collectives for distributed deep learning.

    import ddlcore
    comm = ddlcore.init()                 # ddlrun, torchrun, mpiexec or srun variables
    y = comm.allreduce(x, op="sum")
    h = comm.allreduce_async(x, op="avg"); ...; y = h.wait()
    comm.close()

The README documents the API; docs/ARCHITECTURE.md how the package is built.
"""

from importlib import import_module as _import_module
from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

from ddlcore.errors import (
    CollectiveMismatchError,
    CommunicatorClosedError,
    CommunicatorRevokedError,
    DDLError,
    DDLTimeoutError,
    ExcludedError,
    ParametersDifferError,
    PeerFailureError,
    RendezvousError,
    TransportUnavailableError,
)
from ddlcore.handles import Handle
from ddlcore.ops import Op

if TYPE_CHECKING:
    from ddlcore.bootstrap import init
    from ddlcore.communicator import Communicator
    from ddlcore.p2p import ANY_SOURCE

# Imported on first use: torch imports this package at every ``import torch`` (the backend's
# entry point), which must not pay for the engine, the transports and the kernels.
_LAZY = {
    "init": "ddlcore.bootstrap",
    "Communicator": "ddlcore.communicator",
    "ANY_SOURCE": "ddlcore.p2p",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'ddlcore' has no attribute {name!r}")
    value = getattr(_import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


try:  # one version source: pyproject.toml, through the installed metadata
    __version__ = _metadata.version("ddlcore")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "ANY_SOURCE",
    "CollectiveMismatchError",
    "CommunicatorClosedError",
    "CommunicatorRevokedError",
    "Communicator",
    "DDLError",
    "DDLTimeoutError",
    "ExcludedError",
    "Handle",
    "Op",
    "ParametersDifferError",
    "PeerFailureError",
    "RendezvousError",
    "TransportUnavailableError",
    "__version__",
    "init",
]
