"""``dist.init_process_group("ddl")`` as written under mpiexec and srun.

torch's default rendezvous, ``env://``, reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``, none of which an MPI launcher or srun sets. `install` (run where the backend is
registered) wraps it: where one of them is missing (and not given to ``init_process_group``) and
an MPI launcher or srun started the process, rank and size come from the launcher's variables
(``PMI_RANK``, ``OMPI_COMM_WORLD_RANK``, ``SLURM_PROCID``...: `ddlcore.job.rendezvous.detect`)
and torch's store is at ``MASTER_ADDR``:``MASTER_PORT`` where both are set (or ddlcore's
``DDL_MASTER_ADDR``/``DDL_MASTER_PORT``; torch's ``tcp://`` rendezvous), else rank 0 serves it on a port the system gives it and ddlcore's rendezvous
(`ddlcore.job.rendezvous.resolve_master`, as ``ddlcore.init()`` meets under MPI) broadcasts its
address over MPI; srun needs a PMI that MPI can use for that (``srun --mpi=pmi2``). Everywhere
else (torchrun, ddlrun, variables set by hand) torch's handler runs untouched; any backend (gloo
too) gains the same. ``init_method="ddl://"`` names this rendezvous explicitly.

Nothing is read at import and ``os.environ`` is never written: the work happens inside
``init_process_group``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlparse

if TYPE_CHECKING:
    from ddlcore.job.rendezvous import RendezvousInfo

SCHEME = "ddl"
_LAUNCHERS = ("mpich", "openmpi", "slurm")  # `detect`'s sources that torch does not understand
_TORCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_MARK = "_ddlcore_launchers"  # on our wrapper of env://, so that it is installed once

Handler = Callable[..., Iterator[tuple[Any, int, int]]]


def install() -> None:
    """Register the ``ddl://`` rendezvous and wrap torch's ``env://`` (again: no effect)."""
    module = importlib.import_module("torch.distributed.rendezvous")
    # torch has no public way to extend a scheme it registered: its table it is. A torch
    # without that table keeps its own env:// (mpiexec and srun then need torch's variables).
    handlers: dict[str, Handler] | None = getattr(module, "_rendezvous_handlers", None)
    if not isinstance(handlers, dict) or "env" not in handlers:
        return
    torch_env = handlers["env"]
    if getattr(torch_env, _MARK, False):
        return
    handlers["env"] = _wrapped(torch_env, module.rendezvous)
    if SCHEME not in handlers:
        module.register_rendezvous_handler(SCHEME, _wrapped(torch_env, module.rendezvous))


def _wrapped(torch_env: Handler, rendezvous: Callable[..., Any]) -> Handler:
    def env_or_launcher(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        yield from _rendezvous(url, torch_env, rendezvous, **kwargs)

    setattr(env_or_launcher, _MARK, True)
    env_or_launcher.__wrapped__ = torch_env  # type: ignore[attr-defined]
    return env_or_launcher


def _rendezvous(
    url: str, torch_env: Handler, rendezvous: Callable[..., Any], **kwargs: Any
) -> Iterator[tuple[Any, int, int]]:
    """torch's ``env://`` where its variables are there (or where no launcher that ddlcore
    understands and torch does not started us: torch then names what is missing); else the
    launcher's rank and size, at torch's store."""
    from ddlcore import config
    from ddlcore.job.rendezvous import detect

    parsed = urlparse(url)
    env_url = parsed._replace(scheme="env").geturl()
    query = dict(parse_qsl(parsed.query))
    given = {
        "RANK": int(query.get("rank", -1)) >= 0,
        "WORLD_SIZE": int(query.get("world_size", -1)) > 0,
    }
    if all(given.get(name) or config.is_set(name) for name in _TORCH_VARS):
        yield from torch_env(env_url, **kwargs)
        return
    info = detect()
    rank = int(query["rank"]) if given["RANK"] else info.rank
    size = int(query["world_size"]) if given["WORLD_SIZE"] else info.size
    if info.source not in _LAUNCHERS or (rank, size) != (info.rank, info.size):
        yield from torch_env(env_url, **kwargs)  # torch's error, which names the variable
        return
    # torch's names first; ddlcore's, which its errors suggest, name the store here too (in
    # this process ddlcore's own store is one rank 0 publishes in torch's: `via_torch_store`)
    addr = config.get("MASTER_ADDR") or config.get("DDL_MASTER_ADDR")
    port = config.get("MASTER_PORT") or config.get("DDL_MASTER_PORT")
    if addr and port:  # only rank and size were missing: torch's tcp:// there
        host = f"[{addr}]" if ":" in addr else addr  # an IPv6 address
        rest = {k: v for k, v in query.items() if k not in ("rank", "world_size")}
        tcp = f"tcp://{host}:{port}" + (f"?{urlencode(rest)}" if rest else "")
        yield from rendezvous(tcp, rank, size, **kwargs)
        return
    yield from _store_over_mpi(info, rank, size, kwargs.get("timeout"))


def _store_over_mpi(
    info: RendezvousInfo, rank: int, size: int, timeout: timedelta | None
) -> Iterator[tuple[Any, int, int]]:
    """torch's store, served by rank 0 on a port the system gives it (so that nobody takes it
    in between), its address broadcast to the others over MPI by ddlcore's rendezvous."""
    import torch.distributed as dist

    from ddlcore.job.rendezvous import resolve_master

    timeout = timeout or timedelta(minutes=30)  # torch's default_pg_timeout
    server = None
    if rank == 0:
        server = dist.TCPStore(
            "127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False
        )
    # Rank 0 broadcasts its address and the store's port; an srun without a PMI that MPI can
    # use gets ddlcore's error, which says what to do.
    master = resolve_master(
        replace(info, master_addr=None, master_port=server.port if server else None),
        timeout=timeout.total_seconds(),
    )
    assert master.master_addr is not None and master.master_port is not None
    store = server or dist.TCPStore(
        master.master_addr, master.master_port, size, is_master=False, timeout=timeout
    )
    yield store, rank, size
    raise RuntimeError("the ddl rendezvous cannot run again: call init_process_group anew")
