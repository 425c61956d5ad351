"""Rendezvous: find out who we are (rank, size, where the master is) from whichever launcher
started us, then meet the other ranks at the master's store.

Sources, first match wins: explicit arguments to `ddlcore.init`; ddlrun's ``DDL_*`` variables;
torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``; MPI launchers (``PMI_RANK``/
``PMI_SIZE`` from MPICH's mpiexec, ``OMPI_COMM_WORLD_*`` from Open MPI, ``SLURM_PROCID`` from
srun). The store's address is ``DDL_MASTER_ADDR``/``DDL_MASTER_PORT`` when set, else
``MASTER_ADDR``/``MASTER_PORT``. With none of these the process is a world of one.

``MASTER_PORT`` is torch's, and ddlcore's rank 0 then serves on a free port of its own, when
torch holds it (``DDL_MASTER_PORT`` set by hand wins):
- torchrun's agent serves torch's c10d store there (``TORCHELASTIC_USE_AGENT_STORE=True``): rank 0
  publishes its store's "host:port" in it, under a key of the run and restart, and the others
  read it;
- the script called ``init_process_group`` first (the DDP recipe, under a launcher without an
  agent, by hand or with srun): the same, through the default process group's store.
With ``MASTER_PORT`` and neither, rank 0 serves ddlcore's store on it. An MPI launcher gives no
master address: the address is broadcast with mpi4py (a fixed-size byte buffer, never a pickle).

The job's secret (``ddlcore.security.auth``) travels with that broadcast: when neither ``DDL_SECRET`` nor
``DDL_SECRET_FILE`` is set on rank 0, it draws a fresh one and every rank uses it, so an mpiexec
job is authenticated with nothing to configure. When the master address is given explicitly
(``DDL_MASTER_ADDR``/``MASTER_ADDR``), nothing goes over MPI, under any launcher: the secret then
comes from ``DDL_SECRET``, ``DDL_SECRET_FILE`` or the per-user secret, as for torchrun (torch's
store authenticates no one: no secret goes through it).
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ddlcore import config
from ddlcore.errors import DDLError, RendezvousError
from ddlcore.job import store_listen
from ddlcore.security.auth import job_secret, new_secret

_ADDR_BYTES = 256
# The broadcast after the address: one byte (1: a secret follows, drawn by rank 0; 0: rank 0
# has its own from the environment), then the secret as new_secret() makes it (hex).
_SECRET_BYTES = 64
_SECRET_DRAWN, _SECRET_UNREADABLE = 1, 2  # the broadcast's flag byte (0: rank 0 has its own)
SECRET_ORIGIN_MPI = "a secret rank 0 drew and broadcast over MPI"
TORCH_PROCESS_GROUP = "torch process group"  # the source of a communicator a process group made


@dataclass(frozen=True)
class RendezvousInfo:
    rank: int
    size: int
    master_addr: str | None
    master_port: int | None
    source: str  # which launcher's variables were used
    local_rank: int | None = None
    local_size: int | None = None
    # The job's secret when rank 0 drew it and broadcast it over MPI; else None (environment).
    secret: bytes | None = field(default=None, repr=False, compare=False)
    # master_addr:master_port is torchrun's agent store, where rank 0 publishes its own store's
    # address (`resolve_master`), not the address of ddlcore's store.
    torch_store: bool = False


def _first(names: tuple[str, ...], environ: Mapping[str, str] | None):
    for name in names:
        if config.is_set(name, environ):
            return config.get(name, environ)
    return None


_SOURCES = (
    # (label, rank var, size var, local rank var, local size var)
    ("ddlrun", "DDL_RANK", "DDL_SIZE", "DDL_LOCAL_RANK", "DDL_LOCAL_SIZE"),
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
)


def detect(environ: Mapping[str, str] | None = None) -> RendezvousInfo:
    """Read rank, size and master address from the launcher's variables (see module doc)."""
    for label, rank_var, size_var, lrank_var, lsize_var in _SOURCES:
        if not (config.is_set(rank_var, environ) and config.is_set(size_var, environ)):
            continue
        rank, size = config.get(rank_var, environ), config.get(size_var, environ)
        if rank >= size:
            raise ValueError(f"{rank_var}={rank} is not below {size_var}={size}")
        # ddlcore's own names first: MASTER_PORT is torch's (its store, init_process_group's).
        addr = _first(("DDL_MASTER_ADDR", "MASTER_ADDR"), environ)
        port = _first(("DDL_MASTER_PORT", "MASTER_PORT"), environ)
        # torchrun's agent serves torch's store at MASTER_ADDR:MASTER_PORT (both torch's own:
        # a DDL_MASTER_ADDR or DDL_MASTER_PORT set by hand names ddlcore's store instead)
        torch_store = (
            label == "torchrun"
            and not config.is_set("DDL_MASTER_PORT", environ)
            and not config.is_set("DDL_MASTER_ADDR", environ)
            and config.get("TORCHELASTIC_USE_AGENT_STORE", environ) == "True"
        )
        local_rank = config.get(lrank_var, environ) if lrank_var else None
        local_size = config.get(lsize_var, environ) if lsize_var else None
        return RendezvousInfo(
            rank, size, addr, port, label, local_rank, local_size, torch_store=torch_store
        )
    return RendezvousInfo(0, 1, None, None, "single process", 0, 1)


def _master_host(info: RendezvousInfo, environ: Mapping[str, str] | None) -> str:
    """Address rank 0 serves the store on when the launcher named none."""
    if info.local_size is not None and info.local_size == info.size:
        return "127.0.0.1"  # every rank on this host
    from ddlcore.transports.sockets import rail_address

    # DDL_SOCKET_IFNAME's first interface (rail 0, that of local rank 0) when it lists any
    address = rail_address(config.get("DDL_SOCKET_IFNAME", environ), info.rank, 0)
    if address:
        return address
    return socket.gethostbyname(socket.getfqdn())


def _host_beside(info: RendezvousInfo, environ: Mapping[str, str] | None) -> str:
    """Where rank 0 serves its store when torch's is at MASTER_ADDR: DDL_SOCKET_IFNAME's
    interface when set, else its own address on the route to MASTER_ADDR, which every rank
    reaches (the hostname may resolve to 127.0.1.1, as Debian's /etc/hosts has it)."""
    if (
        config.get("DDL_SOCKET_IFNAME", environ)
        or info.master_addr is None
        or (info.local_size is not None and info.local_size == info.size)
    ):
        return _master_host(info, environ)
    from ddlcore.transports.sockets import route_address

    try:
        return route_address(info.master_addr)
    except OSError:  # MASTER_ADDR does not resolve here: the hostname's address, as before
        return _master_host(info, environ)


# Rank 0's own store per torchrun store and run: another init in this process serves no other.
_published: dict[tuple[str, int, str], tuple[str, int]] = {}


def _torch_store_key(environ: Mapping[str, str] | None) -> str:
    """The key of this run and restart (a restart's ranks must not read the last one's)."""
    run_id = config.get("TORCHELASTIC_RUN_ID", environ) or "none"
    restart = config.get("TORCHELASTIC_RESTART_COUNT", environ) or 0
    return f"ddlcore/{run_id}/{restart}/store"


def _process_group_store(info: RendezvousInfo) -> Any:
    """The store of this process's torch.distributed default process group, when the script
    made one (``init_process_group`` before ``ddlcore.init``) over these same ranks; else None.
    torch is not imported for this."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    try:
        if (dist.get_rank(), dist.get_world_size()) != (info.rank, info.size):
            return None
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):  # not a group ddlcore can use
        return None


def _agent_store(info: RendezvousInfo, timeout: float) -> Any:
    """A client of the store torchrun's agent serves at MASTER_ADDR:MASTER_PORT."""
    assert info.master_addr is not None and info.master_port is not None
    try:
        from datetime import timedelta

        import torch.distributed as dist
    except ImportError as exc:
        raise RendezvousError(
            f"rank {info.rank}: started by torchrun, but torch.distributed does not import "
            f"({exc}); set DDL_MASTER_ADDR and DDL_MASTER_PORT for ddlcore's own store"
        ) from None
    try:
        return dist.TCPStore(
            info.master_addr, info.master_port, is_master=False, timeout=timedelta(seconds=timeout)
        )
    except Exception as exc:  # torch raises RuntimeError or its DistError subclasses
        raise RendezvousError(
            f"rank {info.rank}: cannot reach torchrun's store at {info.master_addr}:"
            f"{info.master_port} within {timeout:g} s ({exc}); is the torchrun agent running, "
            "and do MASTER_ADDR/MASTER_PORT name it?"
        ) from None


def _via_torch_store(
    info: RendezvousInfo,
    environ: Mapping[str, str] | None,
    timeout: float,
    store: Any,
    where: str,
    key: str | None = None,
    mine: tuple[str, int, str] | None = None,
) -> RendezvousInfo:
    """Rank 0 picks a free port for its own store and publishes "host:port" in torch's
    ``store`` (MASTER_PORT is torch's: ddlcore never serves there); the others read it.
    ``key``: where in ``store`` (default: this run's); ``mine``: what rank 0's port is kept
    under, for another init of this process (default: torch's store and ``key``)."""
    from datetime import timedelta

    key = _torch_store_key(environ) if key is None else key
    if info.rank == 0:
        if mine is None:
            assert info.master_addr is not None and info.master_port is not None
            mine = (info.master_addr, info.master_port, key)
        if mine not in _published:
            host = _host_beside(info, environ)
            _published[mine] = (host, store_listen.reserve(host))
        host, port = _published[mine]
        try:
            store.set(key, f"{host}:{port}")
        except Exception as exc:  # torch's DistError family or a lost connection
            raise RendezvousError(
                f"rank 0: cannot publish its store's address in {where} ({exc}); did the "
                "launcher (torchrun's agent, or the process group) stop?"
            ) from None
        return replace(info, master_addr=host, master_port=port, torch_store=False)
    try:
        store.wait([key], timedelta(seconds=timeout))
        raw = bytes(store.get(key))
    except Exception as exc:  # torch's DistStoreError (a RuntimeError) or a lost connection
        raise RendezvousError(
            f"rank {info.rank}: rank 0 did not publish its store's address in {where} within "
            f"{timeout:g} s (key {key!r}: {exc}); did rank 0 fail, or not call "
            "ddlcore.init()?"
        ) from None
    host, _, port_text = raw.decode("utf-8", "replace").rpartition(":")
    if not host or not port_text.isdigit():
        raise RendezvousError(
            f"rank {info.rank}: {where} holds {raw[:80]!r} under {key!r}, not a host:port"
        )
    return replace(info, master_addr=host, master_port=int(port_text), torch_store=False)


# Communicators made from a torch store in this process (`via_torch_store`): the n-th one of
# every rank reads the n-th key, so a process group made again after destroy_process_group (whose
# store prefix torch reuses) never reads the address of the last one's store.
_store_inits = [0]


def via_torch_store(
    store: Any, rank: int, size: int, timeout: float, environ: Mapping[str, str] | None = None
) -> RendezvousInfo:
    """Where ddlcore's store is, for ranks that share a torch.distributed ``store`` (the one
    ``init_process_group`` hands a backend: torch's own rank and size, no launcher variable
    needed). Rank 0 serves ddlcore's store on a free port of its own (the same one for every
    communicator this process makes this way) and publishes "host:port" in ``store``; the
    others read it, waiting up to ``timeout`` seconds.

    Raises
    ------
    RendezvousError
        Rank 0 did not publish within ``timeout``, or ``store`` cannot be written.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank={rank} must be in [0, size={size})")
    found = detect(environ)
    same_job = (found.rank, found.size) == (rank, size)
    # The launcher's host facts only describe these ranks when its rank and size are torch's.
    info = RendezvousInfo(
        rank,
        size,
        found.master_addr if same_job else None,
        None,
        TORCH_PROCESS_GROUP,
        found.local_rank if same_job else None,
        found.local_size if same_job else None,
    )
    if size == 1:
        return info
    _store_inits[0] += 1
    key = f"{_torch_store_key(environ)}/pg{_store_inits[0]}"
    return _via_torch_store(
        info,
        environ,
        timeout,
        store,
        "the process group's store",
        key,
        mine=(info.master_addr or "", 0, TORCH_PROCESS_GROUP),
    )


def resolve_master(
    info: RendezvousInfo, environ: Mapping[str, str] | None = None, timeout: float | None = None
) -> RendezvousInfo:
    """Fill in the address of ddlcore's store: through torch's store (torchrun's agent's, or the
    process group's the script made first), or, for an MPI-launched job, by broadcasting it
    with mpi4py. ``timeout``: DDL_TIMEOUT's."""
    if info.size == 1:
        return info
    wait_s = config.get("DDL_TIMEOUT", environ) if timeout is None else timeout
    if info.torch_store:
        store = _agent_store(info, wait_s)
        try:
            return _via_torch_store(
                info,
                environ,
                wait_s,
                store,
                f"torchrun's store at {info.master_addr}:{info.master_port}",
            )
        finally:
            del store  # closes the connection
    if (
        info.master_port is not None
        and not config.is_set("DDL_MASTER_PORT", environ)
        and info.master_port == config.get("MASTER_PORT", environ)
    ):
        group_store = _process_group_store(info)
        if group_store is not None:  # init_process_group serves torch's store on MASTER_PORT
            return _via_torch_store(
                info,
                environ,
                wait_s,
                group_store,
                "the store of torch.distributed's default process group",
            )
    if info.master_addr and info.master_port:
        return info
    if info.source not in ("mpich", "openmpi", "slurm"):
        raise RendezvousError(
            f"rank {info.rank}: launched by {info.source} but no master address/port is set; "
            "set DDL_MASTER_ADDR and DDL_MASTER_PORT (or MASTER_ADDR/MASTER_PORT)"
        )
    try:
        import numpy as np
        from mpi4py import MPI
    except ImportError as exc:
        raise RendezvousError(
            f"rank {info.rank}: started by an MPI launcher ({info.source}) without "
            "DDL_MASTER_ADDR/DDL_MASTER_PORT; install mpi4py (pip install 'ddlcore[mpi]') so the "
            f"store address can be broadcast, or set those variables ({exc})"
        ) from None
    comm = MPI.COMM_WORLD
    if info.source == "slurm" and comm.Get_size() == 1 and info.size > 1:
        raise RendezvousError(
            f"rank {info.rank} of {info.size}: started by srun without a PMI that MPI can "
            "use (MPI sees a world of one), so the ranks cannot share the store's address; "
            "run srun --mpi=pmi2 ... (the MPICH wheel speaks PMI2), or set DDL_MASTER_ADDR "
            "and DDL_MASTER_PORT (or MASTER_ADDR/MASTER_PORT) to the first node and a free port"
        )
    if comm.Get_size() != info.size or comm.Get_rank() != info.rank:
        raise RendezvousError(
            f"MPI says rank {comm.Get_rank()} of {comm.Get_size()}, the launcher's variables say "
            f"rank {info.rank} of {info.size}; set DDL_MASTER_ADDR/DDL_MASTER_PORT explicitly"
        )
    own_secret = bool(config.get("DDL_SECRET", environ) or config.get("DDL_SECRET_FILE", environ))
    own_error: DDLError | None = None
    buf = np.zeros(_ADDR_BYTES + 1 + _SECRET_BYTES, np.uint8)
    if info.rank == 0:
        host = info.master_addr or _master_host(info, environ)
        raw = f"{host}:{info.master_port or store_listen.reserve(host)}".encode()
        buf[: len(raw)] = np.frombuffer(raw, np.uint8)
        if own_secret:
            try:  # read now: the others must not wait out DDL_TIMEOUT for a store never served
                job_secret(environ)
            except DDLError as exc:
                own_error = exc
                buf[_ADDR_BYTES] = _SECRET_UNREADABLE
        else:
            drawn = new_secret().encode()
            assert len(drawn) == _SECRET_BYTES
            buf[_ADDR_BYTES] = _SECRET_DRAWN
            buf[_ADDR_BYTES + 1 :] = np.frombuffer(drawn, np.uint8)
    comm.Bcast(buf, root=0)
    raw_buf = buf.tobytes()
    buf[:] = 0  # the secret stays in one place: the RendezvousInfo
    host, _, port = raw_buf[:_ADDR_BYTES].rstrip(b"\0").decode().rpartition(":")
    flag = raw_buf[_ADDR_BYTES]
    secret = raw_buf[_ADDR_BYTES + 1 :] if flag == _SECRET_DRAWN else None
    # Every rank learns whether any rank's own secret disagrees with rank 0's choice (one
    # integer, summed: nothing pickled), so that all of them fail at once, saying why.
    differ = np.array([int(own_secret != (flag != _SECRET_DRAWN))], np.int64)
    comm.Allreduce(MPI.IN_PLACE, differ, op=MPI.SUM)
    if own_error is not None:
        raise own_error
    if flag == _SECRET_UNREADABLE:
        raise RendezvousError(
            f"rank {info.rank}: rank 0 cannot read the job's secret "
            "(DDL_SECRET_FILE); its own error says why"
        )
    if differ[0]:
        rank0_drew = flag == _SECRET_DRAWN
        rank0_has = "has no" if rank0_drew else "has"
        raise RendezvousError(
            f"rank {info.rank}: the ranks disagree on the job's secret: rank 0 {rank0_has} "
            f"DDL_SECRET or DDL_SECRET_FILE, {int(differ[0])} other rank(s) "
            f"{'have one' if rank0_drew else 'have neither'}; set the "
            "same one on every rank (or on none: rank 0 then draws one and shares it over MPI)"
        )
    return RendezvousInfo(
        info.rank, info.size, host, int(port), info.source, info.local_rank, info.local_size, secret
    )
