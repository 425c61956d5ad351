"""``python -m ddlcore info``: versions, transports, kernels, configuration and algorithm choice.

    python -m ddlcore info            # this process
    python -m ddlcore info --np 8     # what an 8-rank job on this host would choose
    python -m ddlcore info --np 8 --hosts 2 --bytes 16e6   # ... on 2 hosts of 4 ranks
    ddlrun -np 4 python -m ddlcore info --init   # join the job and show per-pair transports
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys

import ddlcore.transports as transports
from ddlcore import __version__, config, links, topology, tuning
from ddlcore.algorithms import ALGORITHMS
from ddlcore.errors import TransportUnavailableError

_OPTIONAL = ("numpy", "ml_dtypes", "Cython", "mpi4py", "ucxx", "numba", "numba_cuda", "torch")


def _version(module: str) -> str:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # not installed, or broken: say which
        return f"not available ({type(exc).__name__})"
    return str(getattr(mod, "__version__", "installed"))


def _kernels() -> str:
    try:
        import ddlcore.kernels as kernels

        return kernels.describe()
    except Exception as exc:
        return f"NOT BUILT: {exc} (reinstall: pip install -e .)"


def info(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddlcore info")
    parser.add_argument("--np", type=int, default=None, help="world size to plan for")
    parser.add_argument("--hosts", type=int, default=1, help="hosts the --np ranks are spread over")
    parser.add_argument("--bytes", type=float, default=64e6,
                        help="message size to plan for: each rank's input, as comm.describe")
    parser.add_argument("--init", action="store_true", help="join the job (under a launcher)")
    args = parser.parse_args(argv)

    print(f"ddlcore {__version__} on Python {platform.python_version()} ({platform.machine()})")
    print("packages:")
    for name in _OPTIONAL:
        print(f"  {name:12s} {_version(name)}")
    print(f"kernels:\n  cpu          {_kernels()}")
    try:
        import ddlcore.kernels.cuda as kcuda

        print(f"  cuda         {kcuda.describe()}")
    except ImportError as exc:
        print(f"  cuda         not available ({exc})")
    print("transports:")
    for name, (ok, why) in transports.available().items():
        print(f"  {name:12s} {'available' if ok else 'unavailable: ' + why}")
    spec = config.get("DDL_TRANSPORT")
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
        topo = topology.build(host_ids, [""] * size, level_transports)
    algo = config.get("DDL_ALGO")
    chunk = config.get("DDL_CHUNK_BYTES")
    print(f"topology ({size} ranks on {len(set(topo.node_of(r) for r in range(size)))} "
          f"host(s)): box {topo.shape}: {topo.describe()}")
    print(f"algorithms for {args.bytes:.3g} bytes in from each rank (DDL_ALGO={algo}; cost model: "
          f"ddlcore.tuning):")
    for coll in ALGORITHMS:
        choice = comm.describe(coll, int(args.bytes)) if comm is not None else \
            tuning.choose(coll, topo, tuning.model_bytes(coll, int(args.bytes), size), algo,
                          chunk)
        print(f"  {coll:15s} {choice.describe()}")
    for coll in tuning.SELECTABLE:
        ranked = ", ".join(f"{c.algorithm}{'' if c.dim_order is None else list(c.dim_order)} "
                           f"{c.predicted_s * 1e6:.0f} us"
                           for c in tuning.candidates(
                               coll, topo, tuning.model_bytes(coll, int(args.bytes), size))[:4])
        print(f"    {coll} candidates: {ranked}")
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
