"""ddlcore: topology-aware collectives for distributed deep learning.

    import ddlcore
    comm = ddlcore.init()                 # ddlrun, torchrun, mpiexec or srun variables
    y = comm.allreduce(x, op="sum")
    h = comm.allreduce_async(x, op="avg"); ...; y = h.wait()
    comm.close()

The README documents the API; docs/ARCHITECTURE.md how the package is built.
"""

from importlib import metadata as _metadata

from ddlcore.bootstrap import init
from ddlcore.communicator import Communicator
from ddlcore.errors import (
    CollectiveMismatchError,
    CommunicatorClosedError,
    DDLError,
    DDLTimeoutError,
    ParametersDifferError,
    PeerFailureError,
    RendezvousError,
    TransportUnavailableError,
)
from ddlcore.handles import Handle
from ddlcore.ops import Op

try:  # one version source: pyproject.toml, through the installed metadata
    __version__ = _metadata.version("ddlcore")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "CollectiveMismatchError",
    "CommunicatorClosedError",
    "Communicator",
    "DDLError",
    "DDLTimeoutError",
    "Handle",
    "Op",
    "ParametersDifferError",
    "PeerFailureError",
    "RendezvousError",
    "TransportUnavailableError",
    "__version__",
    "init",
]
