"""Spawn real rank processes for multi-rank tests.

`run_ranks(fn, nprocs, *args)` starts ``nprocs`` rank processes, sets the rendezvous variables
(``DDL_RANK``, ``DDL_SIZE``, ``DDL_MASTER_ADDR``, ``DDL_MASTER_PORT``, ``DDL_LOCAL_RANK``,
``DDL_LOCAL_SIZE``) plus any ``env`` given, and calls
``fn(rank, size, *args)`` in each. It returns the list of return values, ordered by rank.

When a rank raises, its traceback is forwarded; the others get a short grace period to report
their own errors, then the whole group is killed and `RankFailure` is raised with every rank's
story. Every join has a deadline, so a hung rank fails the test instead of hanging the suite.
Ranks listed in ``may_die`` are allowed to exit without reporting (tests that kill a rank).

Rank processes come from a fork server (multiprocessing "forkserver"): one single-threaded
process per test session (per pytest-xdist worker) that has done what every rank does first
(tests/fork_preload.py: NumPy, ml_dtypes, pytest and ddlcore's API imported; never numba, ucxx,
mpi4py or torch, which read their settings at import) and forks a fresh child per rank. Each
child then takes the parent's environment as it is at that call and the parent's standard output
and error, as a spawned interpreter would; what fork skips is an interpreter start and ~0.5 s of
imports per rank. Never a fork of the pytest process itself, which runs threads. Unlike
processes that launchers start, forked ranks share the server's string hash seed, so their sets
iterate alike (ddlrun's and torchrun's tests start interpreters of their own).
`event` and `barrier` make objects ranks share, to wait on each other instead of sleeping.
`RankPool` keeps rank processes for many calls, where the processes are not the subject;
`RankPools` keeps one per world size (and per process-wide setting: see `PROCESS_WIDE`), and the
``pools`` fixture (tests/conftest.py) gives each test module its own.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import pickle
import random
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

GRACE_S = 5.0

# What the fork server does once for every rank it forks (imports, caches).
PRELOAD = ["tests.fork_preload"]


def _context() -> Any:
    """The multiprocessing context rank processes come from (see the module doc)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_fork_server() -> None:
    """Start the fork server now (the session fixture does, before any test changes the
    environment), rather than at the first rank of whichever test comes first."""
    _context()
    from multiprocessing import forkserver

    # The server finds tests/fork_preload.py through PYTHONPATH (it takes no sys.path from
    # here, and skips a preload it cannot import without a word), wherever pytest runs from.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([root] + ([before] if before else []))
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


class _InheritedFd:
    """A file descriptor of the parent that a rank process gets a duplicate of (passed while
    the process starts, as multiprocessing passes a Connection's)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        return (_detach_fd, (reduction.DupFd(self.fd),))


def _detach_fd(dup: Any) -> int:
    return dup.detach()


def _inherit(parent: dict[str, str], stdio: tuple[int, int]) -> None:
    """In a new rank process: the parent's environment and standard output and error."""
    os.environ.clear()
    os.environ.update(parent)
    for fd, target in zip(stdio, (1, 2), strict=True):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)


def _stdio() -> tuple[_InheritedFd, _InheritedFd]:
    return (_InheritedFd(1), _InheritedFd(2))


def require(available: bool, reason: str) -> None:
    """Skip the calling test when ``available`` is false, unless DDL_REQUIRE_ALL=1 says fail."""
    import pytest

    from ddlcore import config

    if available:
        return
    if config.get("DDL_REQUIRE_ALL"):
        pytest.fail(f"DDL_REQUIRE_ALL=1 but a required component is missing: {reason}")
    pytest.skip(reason)


class RankFailure(AssertionError):
    """One or more ranks failed; the message holds each rank's traceback or exit status."""


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux: 32768 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on now, for a job's store. Chosen below the ephemeral range: a
    port the kernel picked there can be handed to an outgoing connection (every TCP pair's
    connect, on every test running beside this one) before rank 0 binds it; below it, only a
    listener that chose the same port can take it first."""
    low = _ephemeral_low()
    for _ in range(100 if low > 11000 else 0):
        port = random.randrange(10000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(
    rank: int, size: int, port: int, env: Mapping[str, str | None] | None = None
) -> dict[str, str | None]:
    """The environment a rank of a local job gets (what ddlrun would set)."""
    out: dict[str, str | None] = {
        "DDL_RANK": str(rank),
        "DDL_SIZE": str(size),
        "DDL_LOCAL_RANK": str(rank),
        "DDL_LOCAL_SIZE": str(size),
        "DDL_MASTER_ADDR": "127.0.0.1",
        "DDL_MASTER_PORT": str(port),
    }
    out.update(env or {})
    return out


_PATCHED: list[tuple[Any, str, Any]] = []


def patch(owner: Any, name: str, value: Any) -> None:
    """In a rank: set ``owner.name`` to ``value`` for this job only (a pooled rank's next job
    gets the original back), like pytest's monkeypatch in the parent."""
    _PATCHED.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def count_python_calls() -> list[Any]:
    """In a rank: the collectives that go through the communicator's Python path from now on
    (``calls.prepare``, which the compiled front end skips), in a list that grows."""
    from ddlcore import calls, communicator

    seen: list[Any] = []
    real = calls.prepare

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen.append(args[0])
        return real(*args, **kwargs)

    patch(communicator.calls, "prepare", counted)
    return seen


def _run_job(
    fn: Callable[..., Any],
    rank: int,
    size: int,
    args: tuple,
    env: Mapping[str, str | None],
    conn: Any,
) -> None:
    before = dict(os.environ)
    try:
        _set_env(env)
        _answer(conn, fn, rank, size, args)
    finally:  # a pooled rank's next job starts as it was spawned
        while _PATCHED:
            owner, name, value = _PATCHED.pop()
            setattr(owner, name, value)
        os.environ.clear()
        os.environ.update(before)


def _set_env(env: Mapping[str, str | None]) -> None:
    for key in [k for k in os.environ if k.startswith("DDL_")]:
        if key not in env:
            del os.environ[key]
    for key, value in env.items():
        if value is None:  # None in ``env`` removes a variable
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _answer(conn: Any, fn: Callable[..., Any], rank: int, size: int, args: tuple) -> None:
    try:
        result = fn(rank, size, *args)
    except BaseException:  # noqa: BLE001 - forwarded to the parent verbatim
        conn.send(("error", traceback.format_exc()))
    else:
        try:
            conn.send(("ok", result))
        except Exception:  # result not picklable
            conn.send(("error", traceback.format_exc()))


@contextlib.contextmanager
def _rank_process(parent: dict[str, str], stdio: tuple[int, int], conn: Any) -> Iterator[None]:
    """The life of a new rank process around its jobs: first the parent's environment and
    standard output and error (`_inherit`); last, ``conn`` closed and what a spawned interpreter
    did at its end and a forked child (which leaves with os._exit) does not: the atexit
    functions, the shm segments' finalizers among them."""
    _inherit(parent, stdio)
    try:
        yield
        conn.close()
    finally:
        atexit._run_exitfuncs()


def _child(
    fn: Callable[..., Any],
    rank: int,
    size: int,
    args: tuple,
    env: dict[str, str | None],
    conn: Any,
    parent: dict[str, str],
    stdio: tuple[int, int],
) -> None:
    with _rank_process(parent, stdio, conn):
        _run_job(fn, rank, size, args, env, conn)


def _serve(rank: int, size: int, conn: Any, parent: dict[str, str], stdio: tuple[int, int]) -> None:
    """A `RankPool` rank: run the jobs the parent sends, one at a time, until it sends None."""
    with _rank_process(parent, stdio, conn):
        while (job := conn.recv()) is not None:
            fn, args, env = job
            _run_job(fn, rank, size, args, env, conn)


def _remove_shared_memory(procs: list) -> None:
    """Like ddlrun: ranks killed (or crashed) without closing leave shm segments named by pid."""
    try:
        from ddlcore.transports.shm import remove_segments_of
    except ImportError:
        return
    remove_segments_of({p.pid for p in procs if p.pid is not None and not p.is_alive()})


def run_ranks(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    timeout: float = 120.0,
    env: Mapping[str, str | None] | None = None,
    rank_envs: Mapping[int, Mapping[str, str | None]] | None = None,
    may_die: Iterable[int] = (),
    launcher: str = "spawn",
) -> list[Any]:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` new processes; see the module doc.

    ``launcher="mpiexec"`` starts the ranks with mpiexec instead (for the MPI transport); a rank
    dying then ends the whole job, as MPI launchers do, so ``may_die`` does not apply.
    """
    if launcher == "mpiexec":
        return _run_mpiexec(fn, nprocs, args, timeout, env, rank_envs)
    ctx = _context()
    port = free_port()
    procs, conns = [], []
    for rank in range(nprocs):
        child_env = rank_env(rank, nprocs, port, env)
        child_env.update((rank_envs or {}).get(rank, {}))
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_child,
            args=(fn, rank, nprocs, args, child_env, child_end, dict(os.environ), _stdio()),
            name=f"rank{rank}",
            daemon=True,
        )
        proc.start()
        child_end.close()
        procs.append(proc)
        conns.append(parent_end)

    try:
        results = _collect(procs, conns, timeout, set(may_die))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(5)
        for conn in conns:
            conn.close()
        _remove_shared_memory(procs)
    return results


def _collect(procs: list, conns: list, timeout: float, allowed_dead: set[int]) -> list[Any]:
    """Each rank's answer, in rank order; `RankFailure` (after the others' grace period) when
    one fails or dies, or when the deadline passes. The caller kills what is left."""
    nprocs = len(procs)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    pending = set(range(nprocs))
    while pending:
        now = time.monotonic()
        limit = deadline if failed_at is None else min(deadline, failed_at + GRACE_S)
        if now >= limit:
            break
        ready = mp.connection.wait(
            [conns[r] for r in pending] + [procs[r].sentinel for r in pending],
            timeout=min(0.2, limit - now),
        )
        for rank in list(pending):
            conn = conns[rank]
            got = None
            if conn in ready or conn.poll():
                try:
                    got = conn.recv()
                except EOFError:
                    got = None
            if got is not None:
                status, payload = got
                if status == "ok":
                    results[rank] = payload
                else:
                    errors[rank] = payload
                    failed_at = failed_at or time.monotonic()
                pending.discard(rank)
            elif procs[rank].sentinel in ready and not procs[rank].is_alive():
                procs[rank].join(1)
                if rank not in allowed_dead:
                    errors[rank] = f"exited with code {procs[rank].exitcode} without reporting"
                    failed_at = failed_at or time.monotonic()
                pending.discard(rank)
    for rank in pending:
        if rank not in errors:
            errors[rank] = "killed by the harness: still running " + (
                "after another rank failed"
                if failed_at
                else f"after the {timeout:.0f} s test timeout"
            )
    if errors:
        story = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
        raise RankFailure(f"{len(errors)} of {nprocs} ranks failed:\n{story}")
    return [results.get(r) for r in range(nprocs)]


def event() -> Any:
    """An event that ranks of `run_ranks` share when passed as an argument: a
    rank waits for what another rank did (``ev.wait(deadline)``) instead of sleeping long enough
    to be (probably) after it."""
    return _context().Event()


def barrier(parties: int) -> Any:
    """A barrier shared like `event`: e.g. the rank serving the store leaves only after every
    rank has had its answer."""
    return _context().Barrier(parties)


class RankPool:
    """``nprocs`` rank processes kept for many `run` calls: `run_ranks` without a new process
    per call. Each call gets a fresh rendezvous port and environment, as `run_ranks`
    gives; a call that fails kills the ranks, and the next call spawns new ones. Only for tests
    whose subject is not the processes themselves (a test that kills a rank, or is about what a
    process leaves behind, uses `run_ranks`); ``close`` when done."""

    def __init__(self, nprocs: int) -> None:
        self.nprocs = nprocs
        self._procs: list = []
        self._conns: list = []

    def _start(self) -> None:
        ctx = _context()
        for rank in range(self.nprocs):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_serve,
                args=(rank, self.nprocs, child_end, dict(os.environ), _stdio()),
                name=f"pooled-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = 120.0,
        env: Mapping[str, str | None] | None = None,
        rank_envs: Mapping[int, Mapping[str, str | None]] | None = None,
    ) -> list[Any]:
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        port = free_port()
        try:
            for rank, conn in enumerate(self._conns):
                job_env = rank_env(rank, self.nprocs, port, env)
                job_env.update((rank_envs or {}).get(rank, {}))
                conn.send((fn, args, job_env))
            return _collect(self._procs, self._conns, timeout, set())
        except BaseException:
            self.close(kill=True)
            raise

    def close(self, kill: bool = False) -> None:
        for conn in self._conns:
            if not kill:
                try:
                    conn.send(None)
                except OSError:
                    pass
        for proc in self._procs:
            proc.join(0 if kill else 5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        _remove_shared_memory(self._procs)
        self._procs, self._conns = [], []


# Variables a process reads once (at an import, or its first context), not per call: jobs that
# set them differently get processes of their own. Numba picks the simulator or the driver when
# numba.cuda is first imported; UCX reads its UCX_* settings when the process's context is made.
PROCESS_WIDE = ("NUMBA_ENABLE_CUDASIM", "UCX_")


class RankPools:
    """One `RankPool` per world size and per value of the `PROCESS_WIDE` variables, made on
    first use: ``run(fn, nprocs, *args, env=..., rank_envs=...)`` is `run_ranks` for a test
    module whose cases share processes (a module-scoped fixture ``close``-s it)."""

    def __init__(self) -> None:
        self._pools: dict[tuple, RankPool] = {}

    def run(
        self,
        fn: Callable[..., Any],
        nprocs: int,
        *args: Any,
        env: Mapping[str, str | None] | None = None,
        rank_envs: Mapping[int, Mapping[str, str | None]] | None = None,
        **kw: Any,
    ) -> list[Any]:
        every = [dict(env or {})] + [dict(e) for e in (rank_envs or {}).values()]
        wide = sorted(
            {(k, v) for e in every for k, v in e.items() if k.startswith(PROCESS_WIDE)},
            key=str,
        )
        key = (nprocs, tuple(wide))
        if key not in self._pools:
            self._pools[key] = RankPool(nprocs)
        return self._pools[key].run(fn, *args, env=env, rank_envs=rank_envs, **kw)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def run_like_torchrun(
    argv: list[str], cwd: Any, env: Mapping[str, str], size: int = 2, timeout: float = 120.0
) -> list[str]:
    """Start ``argv`` as ``size`` processes with torch's variables set by hand (RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT: a Slurm script's way, no agent), wait for
    them all, assert that each exited 0 and return their standard outputs."""
    port = free_port()
    procs = []
    for rank in range(size):
        rank_env = {
            **env,
            "RANK": str(rank),
            "WORLD_SIZE": str(size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                argv,
                cwd=cwd,
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}\n{out}\n{err}"
    return [out for out, _ in outs]


def mpiexec_path() -> str | None:
    """The mpiexec ddlrun would use (next to this Python, else on PATH)."""
    from ddlcore.launcher import find_mpiexec

    return find_mpiexec()


def _run_mpiexec(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple,
    timeout: float,
    env: Mapping[str, str | None] | None,
    rank_envs: Mapping[int, Mapping[str, str | None]] | None,
) -> list[Any]:
    mpiexec = mpiexec_path()
    if mpiexec is None:
        raise RankFailure("mpiexec is not installed (pip install 'ddlcore[mpi]')")
    port = free_port()
    job_env = {
        k: v
        for k, v in rank_env(0, nprocs, port, env).items()
        if k not in ("DDL_RANK", "DDL_LOCAL_RANK")
    }
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(prefix="ddl-mpi-") as jobdir:
        with open(os.path.join(jobdir, "job.pkl"), "wb") as f:
            pickle.dump((fn, args, job_env, {r: dict(e) for r, e in (rank_envs or {}).items()}), f)
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
        try:
            proc = subprocess.run(
                [mpiexec, "-n", str(nprocs), sys.executable, "-m", "tests.mpi_child", jobdir],
                cwd=root,
                env=child_env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise RankFailure(
                f"mpiexec job still running after {timeout:.0f} s:\n"
                f"{exc.stdout or ''}{exc.stderr or ''}"
            ) from None
        results, errors = [], {}
        for rank in range(nprocs):
            path = os.path.join(jobdir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                errors[rank] = f"no result (mpiexec exit {proc.returncode}):\n{proc.stderr[-3000:]}"
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, payload = pickle.load(f)  # our own child's file, not the network
            if status == "ok":
                results.append(payload)
            else:
                errors[rank] = payload
                results.append(None)
    if errors:
        story = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
        raise RankFailure(f"{len(errors)} of {nprocs} ranks failed under mpiexec:\n{story}")
    return results
