"""What the UCX transport asks of UCX and of the process: importing ucxx without leaving its
``UCX_*`` defaults in the environment, the UCX config (our defaults, explicit environment first,
one rail per local rank), whether UCX moves CUDA memory, and a foreign UCX already loaded.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

from ddlcore.transports.common import loaded_libraries

# Our defaults for the UCX context, each used only when the user has not set UCX_<NAME>.
# KEEPALIVE_INTERVAL: UCX's default (20 s) lets a silently dead peer (host down, cable pulled)
# go unnoticed for that long on transports where no socket breaks; 1 s costs a few bytes per
# endpoint per second.
_UCX_DEFAULTS = {"KEEPALIVE_INTERVAL": "1s"}

# ucp_context_query: the field_mask bit asking for memory types, the 64-bit word that holds them
# in ucp_context_attr_t (after field_mask, request_size and the padded thread_mode), and CUDA's
# bit in them (ucs_memory_type_t); ucp.h and memory_type.h of UCX 1.x.
_UCP_ATTR_FIELD_MEMORY_TYPES = 1 << 2
_MEMORY_TYPES_WORD = 3
_UCS_MEMORY_TYPE_CUDA = 1

_import_lock = threading.Lock()


def _foreign_ucx() -> str:
    """The path of a UCX library loaded into this process from somewhere other than the libucx
    wheel (the MPICH wheel bundles its own), or "" when there is none."""
    if "mpi4py.MPI" not in sys.modules or "ucxx" in sys.modules:
        return ""
    return next((p for p in loaded_libraries("/libucs.so") if "/libucx/" not in p), "")


def cuda_memory(ucx_context: Any) -> bool:
    """Whether a UCX context moves CUDA memory: ``UCS_MEMORY_TYPE_CUDA`` among the memory
    types ``ucp_context_query`` reports (UCX found its CUDA modules and a driver). ucxx's
    ``cuda_support`` only reads UCX_TLS, and says yes on a machine without a GPU."""
    for path in loaded_libraries("/libucp.so"):
        try:
            query = ctypes.CDLL(path).ucp_context_query
        except (OSError, AttributeError):
            continue
        attr = (ctypes.c_uint64 * 64)()  # ucp_context_attr_t, with room to spare
        attr[0] = _UCP_ATTR_FIELD_MEMORY_TYPES
        if query(ctypes.c_void_p(ucx_context.handle), attr) != 0:
            return False
        return bool(attr[_MEMORY_TYPES_WORD] & (1 << _UCS_MEMORY_TYPE_CUDA))
    return False


def _import_ucxx() -> tuple[Any, Any]:
    """``ucxx._lib.libucxx`` and ucxx's ``Array`` (its buffer wrapper), imported on first use.

    ucxx's package ``__init__`` sets UCX_MEMTYPE_CACHE, UCX_RNDV_THRESH, UCX_RNDV_FRAG_MEM_TYPE
    and UCX_MAX_RNDV_RAILS in ``os.environ`` when they are unset; UCX would then take them for
    the user's settings (and warn about the ones it no longer knows), and child processes would
    inherit them. When this import is the first of ucxx in the process, the ``UCX_*`` variables
    are put back as they were before it.
    """
    # The process environment, not the configuration's (`TransportOptions`): it is what ucxx
    # writes into and what UCX reads its settings from.
    with _import_lock:
        first = "ucxx" not in sys.modules
        before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
        try:
            from ucxx._lib import libucxx
            from ucxx._lib.arr import Array
        finally:
            if first:
                for key in [k for k in os.environ if k.startswith("UCX_") and k not in before]:
                    del os.environ[key]
                for key, value in before.items():
                    if os.environ.get(key) != value:
                        os.environ[key] = value
    return libucxx, Array


def ucx_options(environ: Mapping[str, str] | None = None, local_rank: int = 0) -> dict[str, str]:
    """The UCX config this transport passes to ``UCXContext``: our defaults, minus every name
    the user set as ``UCX_<NAME>`` (explicit environment wins; UCX reads it itself). When
    ``UCX_NET_DEVICES`` lists several devices (rails), local rank i's context takes the
    (i mod A)-th alone (`net_device_rails`). ``environ``: the ``UCX_*`` variables of the
    configuration (`TransportOptions.ucx_environ`); None: the process environment, which is
    where UCX itself reads them."""
    env = os.environ if environ is None else environ
    options = {k: v for k, v in _UCX_DEFAULTS.items() if f"UCX_{k}" not in env}
    rails = net_device_rails(env)
    if len(rails) > 1:
        options["NET_DEVICES"] = rails[local_rank % len(rails)]
    return options


def net_device_rails(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The network devices ``UCX_NET_DEVICES`` lists, one per rail ("mlx5_0:1,mlx5_1:1"); none
    for UCX's default ("all", or unset)."""
    env = os.environ if environ is None else environ
    names = tuple(n.strip() for n in env.get("UCX_NET_DEVICES", "").split(",") if n.strip())
    return () if names in ((), ("all",)) or "all" in names else names


def _features(lib: Any) -> tuple[Any, ...]:
    return (lib.Feature.TAG, lib.Feature.WAKEUP)
