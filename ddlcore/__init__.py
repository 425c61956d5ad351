"""ddlcore: topology-aware collectives for distributed deep learning.

    import ddlcore
    comm = ddlcore.init()                 # ddlrun, torchrun, mpiexec or srun variables
    y = comm.allreduce(x, op="sum")
    h = comm.allreduce_async(x, op="avg"); ...; y = h.wait()
    comm.close()

See DESIGN.md for the architecture and the public contract.
"""

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

__version__ = "0.1.0"

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
