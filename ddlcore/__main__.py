"""``python -m ddlcore info``: versions, transports, kernels, configuration and algorithm choice.

python -m ddlcore info            # this process
python -m ddlcore info --np 8     # what an 8-rank job on this host would choose
python -m ddlcore info --np 8 --hosts 2 --bytes 16e6   # ... on 2 hosts of 4 ranks
ddlrun -np 4 python -m ddlcore info --init   # join the job and show per-pair transports
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
from collections.abc import Mapping
from typing import Any

import ddlcore.transports as transports
from ddlcore import __version__, config, topology
from ddlcore.algorithms import ALGORITHMS
from ddlcore.errors import TransportUnavailableError
from ddlcore.job import links, placement, probe
from ddlcore.planning import tuning

_OPTIONAL = ("numpy", "ml_dtypes", "mpi4py", "ucxx", "numba", "numba_cuda", "torch")
# Needed to build the extensions from source only, never at run time.
_BUILD_ONLY = ("Cython",)


@functools.cache
def _distributions() -> Mapping[str, list[str]]:
    # Reads every installed distribution's file list (~0.5 s with torch installed): once.
    return importlib.metadata.packages_distributions()


def _version(module: str) -> str:
    """The installed version of ``module``'s distribution, read from its metadata: importing
    it could load native libraries (ucxx's UCX beside an MPI that started with its own).

    The distribution is looked up by the module's own name first, then by the CUDA-suffixed
    names RAPIDS publishes (``ucxx-cu12``); only a module found under neither pays for the
    scan of every installed distribution's file list."""
    names = [module] + [f"{module}-cu{major}" for major in (12, 13, 11)]
    for dist in names:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    for dist in _distributions().get(module, []):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    if importlib.util.find_spec(module) is None:
        return "not installed"
    return "installed"


def _kernels() -> str:
    try:
        import ddlcore.kernels as kernels

        return kernels.describe()
    except Exception as exc:
        return f"NOT BUILT: {exc} (reinstall: pip install -e .)"


def job_choice(
    collective: str,
    topo: topology.Topology,
    in_bytes: int,
    algo: str,
    chunk_bytes: int,
    host_transport: str | None,
    direct_reads: bool | None = None,
    host_collectives: bool = True,
) -> tuning.Choice:
    """What `Communicator.describe` says in a job of ``topo``'s shape for a collective of
    ``in_bytes`` of input, without joining one: every rank on one host over shm runs
    ``direct`` (the boards) where the slots hold the call or direct reads are allowed; with
    host and network dimensions, mdring may run its host dimensions on the boards; otherwise
    the cost model's choice (`tuning.choose`). ``host_transport``: what two ranks of one host
    talk; ``direct_reads``: whether process_vm_readv works between them (default: what this
    kernel's Yama setting allows); ``host_collectives``: False under DDL_HOST_COLLECTIVES=off."""
    from ddlcore.algorithms import mdring
    from ddlcore.execution import hostcoll
    from ddlcore.execution.paths import ON_BOARDS, host_staged

    if direct_reads is None:
        direct_reads = hostcoll.cma_allowed()

    size, per_node = topo.size, topo.ranks_per_node

    def mode(nbytes: int) -> int:  # as this host's boards take it (per_node ranks)
        if nbytes <= hostcoll.slots_max(per_node):
            return hostcoll.SLOTS
        return hostcoll.DIRECT if direct_reads else hostcoll.SYNC_ONLY

    shm = host_transport == "shm" and host_collectives  # the boards: shm's capability
    one_host = per_node == size
    if (
        one_host
        and shm
        and algo in ("auto", hostcoll.NAME)
        and 1 < size <= hostcoll.MAX_RANKS
        and collective in ON_BOARDS
    ):
        how = mode(in_bytes)
        if how != hostcoll.SYNC_ONLY:
            return tuning.Choice(
                hostcoll.NAME, hostcoll.CHUNK_BYTES if how == hostcoll.DIRECT else in_bytes
            )
    node = (
        not one_host
        and shm
        and algo in ("auto", mdring.NAME)
        and 0 < topo.host_dims < len(topo.dims)
        and 1 < per_node <= hostcoll.MAX_RANKS
    )
    boards = (
        node
        and collective in host_staged.COLLECTIVES
        and mode(host_staged.board_bytes(collective, in_bytes, topo)) != hostcoll.SYNC_ONLY
    )
    choice = tuning.choose(
        collective, topo, tuning.model_bytes(collective, in_bytes, size), algo, chunk_bytes, boards
    )
    if boards and choice.algorithm == mdring.NAME and tuning.host_first(topo, choice.dim_order):
        return dataclasses.replace(choice, host_path=hostcoll.NAME)
    return choice


def _links_source(joined: bool, nhosts: int) -> str:
    """Where the links above come from: the defaults, or a probe a job runs at init."""
    mode = config.get("DDL_LINK_PROBE")
    if probe.wanted(mode, nhosts):
        if joined:
            which = "" if mode == "1" else " across hosts"
            return f"links{which}: measured at init (DDL_LINK_PROBE={mode}, ddlcore.job.probe)"
        which = "every link" if mode == "1" else "the links across hosts"
        return (
            f"links: defaults; a job on {nhosts} host(s) measures {which} at init "
            f"(DDL_LINK_PROBE={mode}, ddlcore.job.probe) and chooses from the measurement"
        )
    if config.get("DDL_LINK_BW") and config.get("DDL_LINK_LAT"):
        return "links: given (DDL_LINK_BW, DDL_LINK_LAT)"
    why = " on one host" if mode == "auto" else ""
    return f"links: the transports' defaults (DDL_LINK_PROBE={mode}: not measured{why})"


def _placement_lines(nlocal: int, comm: Any) -> list[str]:
    """Where ``nlocal`` ranks of a job on this host would run (init's pinning, DDL_BIND), or,
    with ``comm``, where this rank runs."""
    mode = config.get("DDL_BIND")
    if comm is not None:
        where = placement.encode(os.sched_getaffinity(0))
        return [f"placement (DDL_BIND={mode}): rank {comm.rank} runs on CPUs {where}"]
    given = placement.launcher_cpus()
    lines = [
        f"placement (DDL_BIND={mode}) of {nlocal} rank(s) on this host, given CPUs "
        f"{placement.encode(given)}:"
    ]
    gpu = placement.host_has_gpu()
    for local_rank in range(nlocal):
        cpus, why = placement.plan(mode, local_rank, [given] * nlocal, gpu)
        if cpus is None:
            lines.append(f"  not pinned: {why}")
            break
        lines.append(f"  local rank {local_rank}: CPUs {placement.encode(cpus)}")
    lines.append(
        "  (ranks a launcher placed, and CPUs where another job of yours has ranks pinned, "
        "are left alone)"
    )
    return lines


def info(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddlcore info", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--np",
        type=int,
        default=None,
        help="world size to plan for; not given: 2, or the job's with --init",
    )
    parser.add_argument(
        "--hosts", type=int, default=1, help="hosts the --np ranks are spread over, evenly"
    )
    parser.add_argument(
        "--bytes",
        type=float,
        default=64e6,
        help="message size to plan for: each rank's input, as comm.describe",
    )
    parser.add_argument(
        "--init", action="store_true", help="join the job (under a launcher) and show what it chose"
    )
    args = parser.parse_args(argv)

    spec = config.get("DDL_TRANSPORT")
    try:  # start what a job starts first (MPI_Init under mpiexec): some answers depend on it
        links.local_transports(spec)
    except TransportUnavailableError:
        pass  # said below, transport by transport
    print(f"ddlcore {__version__} on Python {platform.python_version()} ({platform.machine()})")
    print("packages:")
    for name in _OPTIONAL:
        print(f"  {name:12s} {_version(name)}")
    for name in _BUILD_ONLY:
        found = _version(name)
        print(f"  {name:12s} {found} (needed only to build the extensions from source)")
    print(f"kernels:\n  cpu          {_kernels()}")
    try:
        import ddlcore.kernels.cuda as kcuda

        reason = kcuda.unusable_reason()
        if importlib.util.find_spec("numba") is None:
            print(f"  cuda         not available: {reason}")
        else:
            print(f"  cuda         {kcuda.describe()}")
            if reason is not None:
                print(f"               cannot run here: {reason}")
    except ImportError as exc:
        print(f"  cuda         not available ({exc})")
    print("transports:")
    for name, (ok, why) in transports.available().items():
        print(f"  {name:12s} {'available' if ok else 'unavailable: ' + why}")
    print(f"links (DDL_TRANSPORT={spec}):")
    level_transports: dict[str, str] = {}
    try:
        for level, name in links.plan(spec).items():
            print(f"  {level:12s} {name}")
            if not name.startswith("none"):
                level_transports["host" if level == "same host" else "network"] = name
    except TransportUnavailableError as exc:
        print(f"  {exc}")
    print("configuration (environment, parsed):")
    for name, value in config.resolved().items():
        print(f"  {name:20s} {value!r}")
    size = args.np
    comm = None
    if args.init:
        import ddlcore

        comm = ddlcore.init()
        size = comm.size
        print(f"job: {comm!r}")
        for peer, name in sorted(comm.transports.items()):
            print(f"  rank {comm.rank} <-> rank {peer}: {name}")
    size = size or 2
    if comm is not None:
        topo = comm.topology
    else:
        hosts = max(1, min(args.hosts, size))
        host_ids = [f"host{r * hosts // size}" for r in range(size)]
        # Each host as this machine: its CPUs shared by the host's ranks.
        mine = ("", "", placement.launcher_cpus())
        share = placement.cpu_share([mine] * size, host_ids)
        topo = topology.build(host_ids, [""] * size, level_transports, cpu_share=share)
    algo = config.get("DDL_ALGO")
    chunk = config.get("DDL_CHUNK_BYTES")
    nhosts = len(set(topo.node_of(r) for r in range(size)))
    print(f"topology ({size} ranks on {nhosts} host(s)): box {topo.shape}: {topo.describe()}")
    print(f"  {_links_source(comm is not None, nhosts)}")
    nlocal = sum(1 for r in range(size) if topo.node_of(r) == topo.node_of(0))
    print("\n".join(_placement_lines(nlocal, comm)))
    print(
        f"algorithms for {args.bytes:.3g} bytes in from each rank (DDL_ALGO={algo}; cost model: "
        f"ddlcore.planning.tuning):"
    )
    chosen = {}
    for coll in ALGORITHMS:
        choice = (
            comm.describe(coll, int(args.bytes))
            if comm is not None
            else job_choice(
                coll,
                topo,
                int(args.bytes),
                algo,
                chunk,
                level_transports.get("host"),
                host_collectives=config.get("DDL_HOST_COLLECTIVES") != "off",
            )
        )
        chosen[coll] = choice
        print(f"  {coll:15s} {choice.describe()}")
    if any(c.algorithm == tuning.DIRECT for c in chosen.values()):
        print(
            f"    ({tuning.DIRECT}: every rank on one host over shm, so the collectives run "
            "through the shared boards, not as schedules; the schedules' candidates below "
            "are what DDL_ALGO=ring|rhd|... would predict)"
        )
    for coll in tuning.SELECTABLE:
        ranked = ", ".join(
            f"{c.algorithm}{'' if c.dim_order is None else list(c.dim_order)} "
            f"{c.predicted_s * 1e6:.0f} us"
            for c in tuning.candidates(coll, topo, tuning.model_bytes(coll, int(args.bytes), size))[
                :4
            ]
        )
        print(f"    {coll} candidates: {ranked}")
    print(
        f"    (predictions within {tuning.TIE:.0%} of the fastest count as a tie, won by the "
        "simplest algorithm: ring, mdring, rhd, rd in that order)"
    )
    if comm is not None:
        comm.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "info":
        try:
            return info(argv[1:])
        except ValueError as exc:  # a bad environment variable: say which, no traceback
            print(f"ddlcore: {exc}", file=sys.stderr)
            return 2
    print(f"unknown command {argv[0]!r}; try: python -m ddlcore info", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
