"""Transport registry: the backends found through the ``ddlcore.transports`` entry-point group,
with an in-tree fallback so a source checkout works without installed metadata.

`load(name)` returns a transport class after checking its API version; `available()` says, for
every known transport, whether it can run here and why not. `is_available` and `create_context`
call a transport the way its API version expects (version 1 took no `TransportOptions`).
Choosing a transport per peer pair is the job of ``ddlcore.job.links``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from importlib import metadata

from ddlcore.transports.base import (
    API_VERSION,
    SUPPORTED_API_VERSIONS,
    Context,
    Store,
    Transport,
    TransportOptions,
)

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
    return dict(_installed())


# Once per process: reading every distribution's metadata costs ~30 ms with torch installed, and
# every communicator asks (tests and users that make many saw it at each init).
@functools.cache
def _installed() -> dict[str, str]:
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
    if version not in SUPPORTED_API_VERSIONS:
        raise TransportUnavailableError(
            f"transport {name!r} ({spec}) implements transport API version {version}, "
            f"this ddlcore speaks versions {', '.join(map(str, SUPPORTED_API_VERSIONS))}; "
            "upgrade the plug-in or ddlcore"
        )
    if version == API_VERSION and not _takes_options(cls):
        raise TransportUnavailableError(
            f"transport {name!r} ({spec}) says transport API version {version} (inherited "
            "from ddlcore.transports.base.Transport?) but its create_context takes no options "
            "argument: set api_version = 1 on the class, or take TransportOptions (version 2)"
        )
    return cls


def _takes_options(cls: type[Transport]) -> bool:
    try:
        inspect.signature(cls.create_context).bind(None, 0, 1, None, 1.0, None)
    except (TypeError, ValueError):
        return False
    return True


def is_available(cls: type[Transport], options: TransportOptions) -> tuple[bool, str]:
    """``cls.is_available``, with ``options`` where its API version takes them."""
    if getattr(cls, "api_version", 1) == 1:
        return cls.is_available()
    return cls.is_available(options)


def create_context(
    transport: Transport,
    rank: int,
    size: int,
    store: Store,
    timeout: float,
    options: TransportOptions,
) -> Context:
    """``transport``'s context for ``rank``, with ``options`` where its API version takes
    them (version 1: only the local rank, through ``create_context_local``)."""
    if getattr(transport, "api_version", 1) == 1:
        local = type(transport).create_context_local
        if local is not Transport.create_context_local:
            return transport.create_context_local(rank, size, store, timeout, options.local_rank)
        return transport.create_context(rank, size, store, timeout)
    return transport.create_context(rank, size, store, timeout, options)


def available(options: TransportOptions | None = None) -> dict[str, tuple[bool, str]]:
    """For each known transport: (can run here, reason when not), under ``options`` (None:
    the process environment's)."""
    options = TransportOptions.from_environ() if options is None else options
    out = {}
    for name in names():
        try:
            out[name] = is_available(load(name), options)
        except TransportUnavailableError as exc:
            out[name] = (False, str(exc))
    return out
