"""Every environment variable ddlcore reads is declared here, once, with its type, default and doc.

No other module touches ``os.environ`` for a ``DDL_*`` variable (or for the launcher variables of
torchrun and the MPI launchers, which are declared here too). Values are parsed on each `get` so
tests can use ``unittest.mock.patch.dict(os.environ, ...)``; an invalid value raises `ValueError`
naming the variable. Explicit arguments (``ddlcore.init(timeout=...)``) take precedence over the
environment, which takes precedence over the defaults below. A ``DDL_*`` variable that is set but
declared nowhere (a misspelling: ``DDL_TRANSPROT``) is not silently ignored: `warn_unknown`
(at ``ddlcore.init``) names it and the declared name it resembles, once per process.

Over 500 lines for a reason: the declarations are one list, the only one, kept in one place.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_TRUE = {"1", "true", "yes", "on", "y"}
_FALSE = {"0", "false", "no", "off", "n", ""}
_SUFFIX = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
}


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"expected one of 1/0, true/false, yes/no, got {text!r}")


def parse_size(text: str) -> int:
    """Parse a byte count with an optional binary suffix: "4096", "64K", "1M", "2G"."""
    stripped = text.strip().upper()
    digits = stripped.rstrip("KMGIB")
    suffix = stripped[len(digits) :]
    if suffix not in _SUFFIX or not digits:
        raise ValueError(f"expected a byte count like 4096, 64K, 1M or 1G, got {text!r}")
    value = float(digits) * _SUFFIX[suffix]
    if value < 0 or value != int(value):
        raise ValueError(f"expected a whole, non-negative byte count, got {text!r}")
    return int(value)


def parse_dims(text: str) -> tuple[int, ...]:
    """Parse a box shape like "4x2" or "4x16x4" (empty means: derive it)."""
    if not text.strip():
        return ()
    try:
        dims = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"expected a box shape like 4x2 or 4x16x4, got {text!r}") from None
    if any(d < 1 for d in dims):
        raise ValueError(f"every dimension must be >= 1, got {text!r}")
    return dims


def _float_list(text: str) -> tuple[float, ...]:
    """Comma-separated positive numbers, e.g. "20e9,10e9"; empty means unset."""
    if not text.strip():
        return ()
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"expected comma-separated numbers like 20e9,10e9, got {text!r}") from None
    if any(not v > 0 for v in values):
        raise ValueError(f"every value must be positive, got {text!r}")
    return values


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"expected a positive number of seconds, got {text!r}")
    return value


def _nonneg_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise ValueError(f"expected a number >= 0, got {text!r}")
    return value


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"expected a non-negative integer, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise ValueError(f"expected a TCP port 1..65535, got {text!r}")
    return value


def _transport_spec(text: str) -> str:
    """``auto``, ``tcp|shm|mpi|ucx``, or ``auto:ucx,tcp`` (auto with an explicit network order)."""
    spec = text.strip().lower()
    names = {"tcp", "shm", "mpi", "ucx"}
    if spec == "auto" or spec in names:
        return spec
    if spec.startswith("auto:"):
        order = [n for n in spec[5:].split(",") if n]
        bad = [n for n in order if n not in names]
        if order and not bad:
            return spec
    raise ValueError(
        f"expected auto, tcp, shm, mpi, ucx or auto:<order> like auto:ucx,tcp, got {text!r}"
    )


def _link_probe(text: str) -> str:
    """``auto``, or a boolean as "1" / "0"."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return "1" if parse_bool(text) else "0"
    except ValueError:
        raise ValueError(f"expected auto, 1 or 0, got {text!r}") from None


def _auto_or_off(text: str) -> str:
    """``auto``, or ``off`` for any false boolean ("0", "off", "false", "no")."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        if not parse_bool(text):
            return "off"
    except ValueError:
        pass
    raise ValueError(f"expected auto or off (0), got {text!r}") from None


def _gpu_direct(text: str) -> str:
    value = text.strip().lower()
    if value in ("auto", "on", "off"):
        return value
    raise ValueError(f"expected auto, on or off, got {text!r}")


@dataclass(frozen=True)
class Var:
    """One environment variable: how to parse it, its default, and what it does."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    external: bool = False  # set by another tool (torchrun, mpiexec, srun), read for rendezvous
    secret: bool = False  # its value is never shown (`resolved` redacts it)


VARS: dict[str, Var] = {}


def _declare(
    name: str,
    parse: Callable[[str], Any],
    default: Any,
    doc: str,
    external: bool = False,
    secret: bool = False,
) -> None:
    VARS[name] = Var(name, parse, default, doc, external, secret)


def _bind_mode(text: str) -> str:
    """``auto``, ``block``, or ``none`` for it or any false boolean."""
    low = text.strip().lower()
    if low in ("auto", "block", "none") or low in _FALSE:
        return low if low in ("auto", "block") else "none"
    raise ValueError(f"expected auto, block or none, got {text!r}")


# --- behaviour ------------------------------------------------------------------------------
_declare(
    "DDL_TRANSPORT",
    _transport_spec,
    "auto",
    "Transport for every peer pair: tcp, shm, mpi, ucx; 'auto' picks per pair "
    "(shm within a host, else the first available network transport); 'auto:ucx,tcp' sets that order.",
)
_declare(
    "DDL_ALGO",
    lambda s: s.strip().lower(),
    "auto",
    "Algorithm of allreduce, reduce_scatter and allgather: 'auto' (the host collectives "
    "when every rank is on one host over shm, else the lowest time predicted by the cost "
    "model), 'direct' (the host collectives), 'ring', 'mdring' (multi-dimensional ring "
    "over the box), 'rhd' (recursive halving-doubling) or 'rd' (recursive doubling, "
    "allreduce of small messages).",
)
_declare(
    "DDL_TOPOLOGY",
    parse_dims,
    (),
    "Box shape of the ranks, fastest level first, e.g. 4x2 (4 ranks per host, 2 hosts). "
    "Empty: derived from the hosts found at init.",
)
_declare(
    "DDL_RACK_ID",
    str,
    "",
    "Rack (or switch) of this host; hosts with the same id form the box's rack level "
    "(ranks-per-host x hosts-per-rack x racks). Empty: no rack level.",
)
_declare(
    "DDL_LINK_BW",
    _float_list,
    (),
    "Link bandwidth in bytes/s along each box dimension, fastest first, comma-separated "
    "(e.g. 20e9,10e9,9.5e9; one value applies to all; the last repeats). Empty: the "
    "defaults of the transport carrying each level. Feeds the cost model.",
)
_declare(
    "DDL_LINK_LAT",
    _float_list,
    (),
    "Per-message latency in seconds along each box dimension, like DDL_LINK_BW.",
)
_declare(
    "DDL_LINK_PROBE",
    _link_probe,
    "auto",
    "Measure box dimensions' bandwidth and latency with a short ping-pong at init (~0.15 s "
    "per dimension on a 1 Gbit/s link, less on faster ones) instead of using transport "
    "defaults: 'auto' "
    "those that cross hosts when the job spans hosts, 1 every dimension, 0 none. "
    "DDL_LINK_BW / DDL_LINK_LAT, where given, win over the measurement.",
)
_declare(
    "DDL_HOST_COLLECTIVES",
    _auto_or_off,
    "auto",
    "Whether the shm transport's host collectives (the shared-memory boards) run the part of "
    "a collective inside a host: 'auto' wherever shm links a host's ranks (a one-host job's "
    "collectives, mdring's host phases), 'off' never: the schedules then run over the shm "
    "pairs (to compare the paths, or to step around a problem in the boards).",
)
_declare(
    "DDL_BIND",
    _bind_mode,
    "auto",
    "Pinning of each rank that shares a machine (one running kernel) with others of the job "
    "to a block of CPUs of its own (the i-th on the i-th of equal blocks of the CPUs the "
    "launcher gave, a NUMA node's and a core's CPUs together): 'auto' where the launcher did "
    "not place the ranks, "
    "there are no more local ranks than CPUs and the host has no NVIDIA GPU; 'block' on GPU "
    "hosts too; 'none' never. The thread that calls init() is pinned, with what it starts "
    "later (threads, data loader workers), until the communicator closes; CPUs where another "
    "job of the same user pinned its ranks are left alone.",
)
_declare(
    "DDL_TIMEOUT",
    _positive_float,
    600.0,
    "Seconds any blocking wait (rendezvous, a collective, a handle) may last before it "
    "fails with DDLTimeoutError naming the rank and collective.",
)
_declare(
    "DDL_HEARTBEAT_TIMEOUT",
    _nonneg_float,
    1.0,
    "Seconds of silence after which a rank is excluded from its communicators (a heartbeat "
    "thread outside Python pings each peer ten times in that): a rank stopped, hung in the "
    "kernel or cut off by the network fails the collectives waiting on it with "
    "PeerFailureError on every other rank, and shrink() goes on without it. 0 turns the "
    "heartbeat off (a hung rank is then found only by DDL_TIMEOUT).",
)
_declare(
    "DDL_CHUNK_BYTES",
    parse_size,
    1 << 20,
    "Pipeline chunk size in bytes (suffixes K, M, G): one chunk is on the wire while the "
    "previous one is reduced. 1 MiB measured best on TCP loopback (BENCHMARKS.md). Unset, "
    "device (CUDA) buffers on the stream engine take 4 MiB chunks (measured best on an H100).",
)
_declare(
    "DDL_FUSION_BYTES",
    parse_size,
    25 << 20,
    "Gradient fusion threshold of the PyTorch DistributedOptimizer (suffixes K, M, G): "
    "gradients are packed into buckets of up to this many bytes, each allreduced as soon as "
    "backward has produced it. 25 MiB is DDP's default bucket size; smaller buckets start "
    "communicating earlier in backward, larger ones pay the per-collective latency less.",
)
_declare(
    "DDL_SEGMENTS",
    _nonneg_int,
    0,
    "The mdring allreduce in this many segments pipelined across the box's dimensions (a "
    "segment on the network while the next is reduced inside the hosts): 0 lets the cost "
    "model choose (python -m ddlcore info shows it), 1 runs the phases one after another.",
)
_declare(
    "DDL_PIPELINE_DEPTH",
    _positive_int,
    8,
    "How many chunks the engine keeps posted ahead of the one it is reducing.",
)
_declare(
    "DDL_GPU_DIRECT",
    _gpu_direct,
    "auto",
    "GPU buffers over transports that can carry device memory (UCX with its CUDA "
    "transports, a CUDA-aware MPI): 'auto' sends and receives device memory directly when "
    "the transport reports CUDA support, 'on' always does on those transports (trusting "
    "them: a MPI that is not CUDA-aware then crashes), 'off' stages every chunk through "
    "pinned host memory. tcp and shm always stage.",
)
_declare(
    "DDL_NCHANNELS",
    _positive_int,
    1,
    "Number of TCP connections (channels) per peer pair; messages are striped across "
    "them round-robin so several sender/receiver threads share the link.",
)
_declare(
    "DDL_SOCKET_IFNAME",
    str,
    "",
    "Network interface the TCP transport binds to (e.g. eth0). Empty: the interface "
    "that reaches the master address. A comma list (eth0,eth1) names one interface per "
    "network adapter (rail, one subnet each): local rank i listens on the "
    "(i mod A)-th, and the topology counts A adapters per host.",
)
_declare(
    "DDL_HOST_ID",
    str,
    "",
    "Overrides host identity (default: hostname plus network namespace); ranks with "
    "the same id count as one host.",
)
_declare(
    "DDL_DEBUG",
    parse_bool,
    False,
    "Log the algorithm, chunking and transport of each collective to stderr, and check "
    "fully that all ranks call the same collective with the same size, dtype and op.",
)
_declare(
    "DDL_REQUIRE_ALL",
    parse_bool,
    False,
    "Tests only: a test that would skip because a component is missing fails instead.",
)

# --- security and diagnostics ----------------------------------------------------------------
_declare(
    "DDL_SECRET",
    str,
    "",
    "The job's shared secret: every connection (store, TCP) proves it with an HMAC "
    "challenge-response before anything else is acted on. ddlrun and MPI launchers provide a "
    "fresh one per job; empty: DDL_SECRET_FILE, else the per-user ~/.config/ddlcore/secret.",
    secret=True,
)

_declare(
    "DDL_SECRET_FILE",
    str,
    "",
    "File holding the job's secret (owned by you or root, readable by you only), used when "
    "DDL_SECRET is empty.",
)
_declare(
    "DDL_FLIGHT_RECORDER",
    str,
    "",
    "Directory where each rank writes its flight record (its last collectives: sequence "
    "number, collective, size, dtype, op, algorithm, path, times, state), as JSON in "
    "rankR.json, when a collective fails (timeout, peer failure, mismatch: the error names "
    "the file), when the communicator is closed, and on SIGTERM (unless the program has "
    "its own handler); python -m ddlcore.trace DIR merges them and says which rank was "
    "behind. Empty: kept in memory only (Communicator.flight_record()).",
)
_declare(
    "DDL_FLIGHT_RECORDER_ENTRIES",
    _nonneg_int,
    1024,
    "How many of the last collectives the flight recorder keeps per communicator (0: off).",
)

# --- rendezvous (set by ddlrun, or by hand) --------------------------------------------------
_declare("DDL_RANK", _nonneg_int, None, "This process's rank (set by ddlrun).")
_declare("DDL_SIZE", _positive_int, None, "Number of ranks in the job (set by ddlrun).")
_declare("DDL_LOCAL_RANK", _nonneg_int, None, "Rank among the ranks of this host (set by ddlrun).")
_declare("DDL_LOCAL_SIZE", _positive_int, None, "Ranks on this host (set by ddlrun).")
_declare("DDL_MASTER_ADDR", str, None, "Address of rank 0's rendezvous store.")
_declare("DDL_MASTER_PORT", _port, None, "Port of rank 0's rendezvous store.")
_declare(
    "DDL_STORE_SOCKETS",
    str,
    "",
    "Set by ddlrun for rank 0: the abstract Unix socket (@name) from which rank 0 receives the "
    "store's listening sockets, bound by ddlrun on DDL_MASTER_ADDR:DDL_MASTER_PORT before the "
    "ranks start, so that no other process can take the port in between.",
)
_declare(
    "DDL_FAILURE_DIR",
    str,
    "",
    "Set by ddlrun: where a rank whose collective failed reports which rank failed first "
    "(itself, or the peer it names): ddlrun's pipe, /proc/<pid>/fd/<n>, so that ddlrun "
    "reports the root cause.",
)

# --- other launchers' variables, understood for rendezvous ----------------------------------
_EXTERNAL: list[tuple[str, Callable[[str], Any], str]] = [
    ("RANK", _nonneg_int, "Torchrun: global rank."),
    ("WORLD_SIZE", _positive_int, "Torchrun: number of ranks."),
    ("LOCAL_RANK", _nonneg_int, "Torchrun: rank on this host."),
    ("LOCAL_WORLD_SIZE", _positive_int, "Torchrun: ranks on this host."),
    ("MASTER_ADDR", str, "Torchrun: rendezvous address."),
    ("MASTER_PORT", _port, "Torchrun: rendezvous port."),
    (
        "TORCHELASTIC_USE_AGENT_STORE",
        str,
        "Torchrun: 'True' when its agent serves the store at MASTER_ADDR:MASTER_PORT.",
    ),
    ("TORCHELASTIC_RUN_ID", str, "Torchrun: the job's run id."),
    ("TORCHELASTIC_RESTART_COUNT", _nonneg_int, "Torchrun: how many times the workers restarted."),
    ("PMI_RANK", _nonneg_int, "MPICH/Hydra (mpiexec): global rank."),
    ("PMI_SIZE", _positive_int, "MPICH/Hydra (mpiexec): number of ranks."),
    ("MPI_LOCALRANKID", _nonneg_int, "MPICH/Hydra: rank on this host."),
    ("MPI_LOCALNRANKS", _positive_int, "MPICH/Hydra: ranks on this host."),
    ("OMPI_COMM_WORLD_RANK", _nonneg_int, "Open MPI: global rank."),
    ("OMPI_COMM_WORLD_SIZE", _positive_int, "Open MPI: number of ranks."),
    ("OMPI_COMM_WORLD_LOCAL_RANK", _nonneg_int, "Open MPI: rank on this host."),
    ("OMPI_COMM_WORLD_LOCAL_SIZE", _positive_int, "Open MPI: ranks on this host."),
    ("SLURM_PROCID", _nonneg_int, "Slurm (srun): global rank."),
    ("SLURM_NTASKS", _positive_int, "Slurm (srun): number of ranks."),
    ("SLURM_LOCALID", _nonneg_int, "Slurm (srun): rank on this host."),
]
for _name, _parse, _doc in _EXTERNAL:
    _declare(_name, _parse, None, _doc, external=True)

# The MPI launchers' global-rank variables: one of them set means an MPI launcher started us
# (the mpi transport runs only then).
MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


# DDL_* names other tools set, which ddlcore itself never reads: known, not misspellings.
KNOWN_ELSEWHERE: dict[str, str] = {
    "DDL_CI_VENV": "The CI script (.ci/run): a virtual environment to keep between runs.",
}
_warned: set[str] = set()  # the unknown names warned of in this process


def unknown(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The ``DDL_*`` variables of the environment that are neither declared here nor in
    `KNOWN_ELSEWHERE`, each with the declared name it most resembles (None: none is close)."""
    env = os.environ if environ is None else environ
    # Compared without the prefix every name shares, which would make any two look alike.
    known = [name[4:] for name in VARS if name.startswith("DDL_")]
    found: dict[str, str | None] = {}
    for name in sorted(env):
        if name.startswith("DDL_") and name not in VARS and name not in KNOWN_ELSEWHERE:
            near = difflib.get_close_matches(name[4:], known, n=1, cutoff=0.6)
            found[name] = f"DDL_{near[0]}" if near else None
    return found


def warn_unknown(environ: Mapping[str, str] | None = None, stacklevel: int = 2) -> None:
    """Warn (`RuntimeWarning`, which Python shows by default) of every `unknown` ``DDL_*``
    variable, naming the declared one it resembles; once per name and process."""
    for name, near in unknown(environ).items():
        if name in _warned:
            continue
        _warned.add(name)
        hint = f"; did you mean {near}?" if near else ""
        warnings.warn(
            f"environment variable {name} is set but ddlcore has no such setting, so it has no "
            f"effect{hint} (python -m ddlcore info lists the DDL_* variables)",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """Return the parsed value of a declared variable, or its default when unset.

    Raises
    ------
    KeyError
        ``name`` is not declared here (a programming error).
    ValueError
        The variable is set to something that does not parse; the message names it.
    """
    var = VARS[name]
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None:
        return var.default
    try:
        return var.parse(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is invalid: {exc}") from None


def debug(environ: Mapping[str, str] | None = None) -> bool:
    """``DDL_DEBUG``, False where its value does not parse: for the command lines' error paths,
    which must say their one line whatever the environment holds."""
    try:
        return bool(get("DDL_DEBUG", environ))
    except ValueError:
        return False


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a declared variable is present in the environment (even if empty)."""
    if name not in VARS:
        raise KeyError(name)
    env = os.environ if environ is None else environ
    return name in env


def without(environ: Mapping[str, str] | None, *names: str) -> dict[str, str]:
    """A copy of the environment (``os.environ`` when None) without the declared ``names``."""
    for name in names:
        if name not in VARS:
            raise KeyError(name)
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k not in names}


def resolved(environ: Mapping[str, str] | None = None, external: bool = False) -> dict[str, Any]:
    """All declared variables (the ``DDL_*`` ones unless ``external``) with their parsed values;
    a secret's value is replaced by a note saying whether it is set (what `python -m ddlcore
    info` prints ends up in bug reports)."""
    return {
        name: (_redacted(get(name, environ)) if var.secret else get(name, environ))
        for name, var in VARS.items()
        if external or not var.external
    }


def _redacted(value: Any) -> str:
    return f"<set, {len(value)} characters, not shown>" if value else ""
