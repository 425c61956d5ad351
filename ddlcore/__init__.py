"""ddlcore: topology-aware collectives for distributed deep learning."""

from ddlcore.errors import (
    CollectiveMismatchError,
    CommunicatorClosedError,
    DDLError,
    DDLTimeoutError,
    PeerFailureError,
    RendezvousError,
    TransportUnavailableError,
)
from ddlcore.ops import Op

__version__ = "0.1.0"
