"""Transport registry: the backends found through the ``ddlcore.transports`` entry-point group,
with an in-tree fallback so a source checkout works without installed metadata.

`load(name)` returns a transport class after checking its API version; `available()` says, for
every known transport, whether it can run here and why not. Choosing a transport per peer pair
is the job of ``ddlcore.links``.
"""

from __future__ import annotations

import importlib
from importlib import metadata

from ddlcore.transports.base import API_VERSION, Transport

from ddlcore.errors import TransportUnavailableError

GROUP = "ddlcore.transports"

# Fallback when the package metadata (entry points) is not installed, e.g. a bare source tree.
IN_TREE = {
    "tcp": "ddlcore.transports.tcp:TcpTransport",
    "mpi": "ddlcore.transports.mpi:MpiTransport",
    "shm": "ddlcore.transports.shm:ShmTransport",
    "ucx": "ddlcore.transports.ucx:UcxTransport",
}

# Order in which "auto" tries network transports (DDL_TRANSPORT=auto:... overrides it).
NETWORK_ORDER = ("ucx", "mpi", "tcp")


def _entry_points() -> dict[str, str]:
    found = dict(IN_TREE)
    try:
        for ep in metadata.entry_points(group=GROUP):
            found[ep.name] = ep.value
    except Exception:  # broken metadata must not break the in-tree transports
        pass
    return found


def names() -> list[str]:
    """Every transport name known (installed or in-tree), whether available or not."""
    return sorted(_entry_points())


def load(name: str) -> type[Transport]:
    """The transport class called ``name``.

    Raises
    ------
    TransportUnavailableError
        Unknown name, import failure, or a plug-in written for another API version.
    """
    spec = _entry_points().get(name)
    if spec is None:
        raise TransportUnavailableError(f"no transport named {name!r}; known: {', '.join(names())}")
    module_name, _, attr = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:
        raise TransportUnavailableError(
            f"transport {name!r} ({spec}) failed to import: {exc}"
        ) from exc
    version = getattr(cls, "api_version", None)
    if version != API_VERSION:
        raise TransportUnavailableError(
            f"transport {name!r} ({spec}) implements transport API version {version}, "
            f"this ddlcore speaks version {API_VERSION}; upgrade the plug-in or ddlcore"
        )
    return cls


def available() -> dict[str, tuple[bool, str]]:
    """For each known transport: (can run here, reason when not)."""
    out = {}
    for name in names():
        try:
            out[name] = load(name).is_available()
        except TransportUnavailableError as exc:
            out[name] = (False, str(exc))
    return out
