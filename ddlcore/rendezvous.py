"""Rendezvous: find out who we are (rank, size, where the master is) from whichever launcher
started us, then meet the other ranks at the master's store.

Sources, first match wins: explicit arguments to `ddlcore.init`; ddlrun's ``DDL_*`` variables;
torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``; MPI launchers (``PMI_RANK``/
``PMI_SIZE`` from MPICH's mpiexec, ``OMPI_COMM_WORLD_*`` from Open MPI, ``SLURM_PROCID`` from
srun). An MPI launcher gives no master address: then rank 0 opens the store on a free port and
the address is broadcast with mpi4py (a fixed-size byte buffer, never a pickle). With none of
these the process is a world of one.

The job's secret (``ddlcore.auth``) travels with that broadcast: when neither ``DDL_SECRET`` nor
``DDL_SECRET_FILE`` is set on rank 0, it draws a fresh one and every rank uses it, so an mpiexec
job is authenticated with nothing to configure. When the master address is given explicitly
(``DDL_MASTER_ADDR``/``MASTER_ADDR``), nothing goes over MPI, under any launcher: the secret then
comes from ``DDL_SECRET``, ``DDL_SECRET_FILE`` or the per-user secret, as for torchrun.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from ddlcore import config
from ddlcore.auth import job_secret, new_secret
from ddlcore.errors import DDLError, RendezvousError

_ADDR_BYTES = 256
# The broadcast after the address: one byte (1: a secret follows, drawn by rank 0; 0: rank 0
# has its own from the environment), then the secret as new_secret() makes it (hex).
_SECRET_BYTES = 64
_SECRET_DRAWN, _SECRET_UNREADABLE = 1, 2  # the broadcast's flag byte (0: rank 0 has its own)
SECRET_ORIGIN_MPI = "a secret rank 0 drew and broadcast over MPI"


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


def _first(names: tuple[str, ...], environ: Mapping[str, str] | None):
    for name in names:
        if config.is_set(name, environ):
            return config.get(name, environ)
    return None


_SOURCES = (
    # (label, rank var, size var, local rank var, local size var, addr var, port var)
    ("ddlrun", "DDL_RANK", "DDL_SIZE", "DDL_LOCAL_RANK", "DDL_LOCAL_SIZE", "DDL_MASTER_ADDR",
     "DDL_MASTER_PORT"),
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
     "MASTER_PORT"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", None, None),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", None, None),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None, None, None),
)


def detect(environ: Mapping[str, str] | None = None) -> RendezvousInfo:
    """Read rank, size and master address from the launcher's variables (see module doc)."""
    for label, rank_var, size_var, lrank_var, lsize_var, addr_var, port_var in _SOURCES:
        if not (config.is_set(rank_var, environ) and config.is_set(size_var, environ)):
            continue
        rank, size = config.get(rank_var, environ), config.get(size_var, environ)
        if rank >= size:
            raise ValueError(f"{rank_var}={rank} is not below {size_var}={size}")
        # An explicit master address (DDL_* or torchrun's) wins over an MPI broadcast.
        addr = _first(tuple(v for v in (addr_var, "DDL_MASTER_ADDR", "MASTER_ADDR") if v), environ)
        port = _first(tuple(v for v in (port_var, "DDL_MASTER_PORT", "MASTER_PORT") if v), environ)
        local_rank = config.get(lrank_var, environ) if lrank_var else None
        local_size = config.get(lsize_var, environ) if lsize_var else None
        return RendezvousInfo(rank, size, addr, port, label, local_rank, local_size)
    return RendezvousInfo(0, 1, None, None, "single process", 0, 1)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def resolve_master(info: RendezvousInfo, environ: Mapping[str, str] | None = None) -> RendezvousInfo:
    """Fill in the master address of an MPI-launched job by broadcasting it with mpi4py."""
    if info.size == 1 or (info.master_addr and info.master_port):
        return info
    if info.source not in ("mpich", "openmpi", "slurm"):
        raise RendezvousError(
            f"rank {info.rank}: launched by {info.source} but no master address/port is set; "
            "set DDL_MASTER_ADDR and DDL_MASTER_PORT (or MASTER_ADDR/MASTER_PORT)")
    try:
        import numpy as np
        from mpi4py import MPI
    except ImportError as exc:
        raise RendezvousError(
            f"rank {info.rank}: started by an MPI launcher ({info.source}) without "
            "DDL_MASTER_ADDR/DDL_MASTER_PORT; install mpi4py (pip install 'ddlcore[mpi]') so the "
            f"store address can be broadcast, or set those variables ({exc})") from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != info.size or comm.Get_rank() != info.rank:
        raise RendezvousError(
            f"MPI says rank {comm.Get_rank()} of {comm.Get_size()}, the launcher's variables say "
            f"rank {info.rank} of {info.size}; set DDL_MASTER_ADDR/DDL_MASTER_PORT explicitly")
    own_secret = bool(config.get("DDL_SECRET", environ) or config.get("DDL_SECRET_FILE", environ))
    own_error: DDLError | None = None
    buf = np.zeros(_ADDR_BYTES + 1 + _SECRET_BYTES, np.uint8)
    if info.rank == 0:
        host = info.master_addr or _master_host(info, environ)
        raw = f"{host}:{info.master_port or _free_port(host)}".encode()
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
            buf[_ADDR_BYTES + 1:] = np.frombuffer(drawn, np.uint8)
    comm.Bcast(buf, root=0)
    raw_buf = buf.tobytes()
    buf[:] = 0  # the secret stays in one place: the RendezvousInfo
    host, _, port = raw_buf[:_ADDR_BYTES].rstrip(b"\0").decode().rpartition(":")
    flag = raw_buf[_ADDR_BYTES]
    secret = raw_buf[_ADDR_BYTES + 1:] if flag == _SECRET_DRAWN else None
    # Every rank learns whether any rank's own secret disagrees with rank 0's choice (one
    # integer, summed: nothing pickled), so that all of them fail at once, saying why.
    differ = np.array([int(own_secret != (flag != _SECRET_DRAWN))], np.int64)
    comm.Allreduce(MPI.IN_PLACE, differ, op=MPI.SUM)
    if own_error is not None:
        raise own_error
    if flag == _SECRET_UNREADABLE:
        raise RendezvousError(f"rank {info.rank}: rank 0 cannot read the job's secret "
                              "(DDL_SECRET_FILE); its own error says why")
    if differ[0]:
        rank0_drew = flag == _SECRET_DRAWN
        rank0_has = "has no" if rank0_drew else "has"
        raise RendezvousError(
            f"rank {info.rank}: the ranks disagree on the job's secret: rank 0 {rank0_has} "
            f"DDL_SECRET or DDL_SECRET_FILE, {int(differ[0])} other rank(s) "
            f"{'have one' if rank0_drew else 'have neither'}; set the "
            "same one on every rank (or on none: rank 0 then draws one and shares it over MPI)")
    return RendezvousInfo(info.rank, info.size, host, int(port), info.source,
                          info.local_rank, info.local_size, secret)
