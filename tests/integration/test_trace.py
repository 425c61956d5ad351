"""The flight recorder end to end: real ranks, one of them behind (busy elsewhere until the
others have given up on a collective at DDL_TIMEOUT, then calling it late or leaving without it,
or busy until ddlrun stops it, waiting in a recv) or calling another collective; every surviving rank writes its record into DDL_FLIGHT_RECORDER and names it in its
error, and ``python -m ddlcore.trace DIR`` (a subprocess) says which rank was behind, in which
collective."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.harness import run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 3.0  # the ranks' DDL_TIMEOUT: short, each test waits it out once
ODD = 2  # the rank that misbehaves


def _warm_up(comm, rank: int) -> int:
    """A few collectives every rank calls alike (random data, odd sizes); returns how many."""
    rng = np.random.default_rng(rank)
    x = rng.standard_normal(1009).astype(np.float32)
    total = comm.allreduce(x)
    np.testing.assert_allclose(total, comm.allreduce(x), rtol=0, atol=0)
    comm.broadcast(rng.integers(0, 100, 7, dtype=np.int64), root=1)
    comm.allgather(rng.standard_normal(1).astype(np.float64))
    comm.barrier()
    return 5


def _await_records(ranks: list[int], limit: float = 60.0) -> None:
    """Wait until ``ranks`` have written their records (they failed), at most ``limit`` s."""
    directory = os.environ["DDL_FLIGHT_RECORDER"]
    deadline = time.monotonic() + limit
    while not all(os.path.exists(os.path.join(directory, f"rank{r}.json")) for r in ranks):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no records from ranks {ranks} in {directory} after {limit} s")
        time.sleep(0.05)


def _behind(rank: int, size: int, how: str):
    import ddlcore

    comm = ddlcore.init()
    seq = _warm_up(comm, rank)
    x = np.random.default_rng(rank).standard_normal(4099).astype(np.float32)
    if rank == ODD and how in ("leaves", "sleeps"):
        # Busy elsewhere until the others have given up on the next collective (DDL_TIMEOUT).
        _await_records([r for r in range(size) if r != ODD])
        if how == "leaves":  # then leaves without calling it
            comm.close()
            return "left", seq
    try:
        if rank == ODD and how == "mismatch":
            comm.broadcast(x, root=0)
        else:
            comm.allreduce(x)
    except ddlcore.DDLError as exc:
        return type(exc).__name__, str(exc), seq
    finally:
        comm.close()
    return "completed", seq


def _trace(directory: str, *extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    res = subprocess.run(
        [sys.executable, "-m", "ddlcore.trace", directory, *extra],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def _check_errors(results, directory: str, kinds: tuple[str, ...]) -> None:
    """Every rank but the odd one failed, and its error names its record, which exists."""
    for rank, res in enumerate(results):
        if rank == ODD:
            continue
        assert len(res) == 3, f"rank {rank} did not fail: {res}"
        name, message, _ = res
        assert name in kinds, (rank, name, message)
        path = os.path.join(directory, f"rank{rank}.json")
        assert f"flight record: {path}" in message, message
        assert os.path.exists(path)


@pytest.mark.parametrize(
    "how,transport", [("sleeps", "auto"), ("leaves", "auto"), ("leaves", "tcp")]
)
def test_trace_names_the_rank_behind(tmp_path, how, transport):
    directory = str(tmp_path / "flight")
    env = {
        "DDL_FLIGHT_RECORDER": directory,
        "DDL_TIMEOUT": str(TIMEOUT_S),
        "DDL_TRANSPORT": transport,
    }
    results = run_ranks(_behind, 3, how, env=env, timeout=120)
    _check_errors(results, directory, ("DDLTimeoutError", "PeerFailureError"))
    seq = results[0][2]
    assert sorted(os.listdir(directory)) == ["rank0.json", "rank1.json", "rank2.json"]
    out = _trace(directory)
    verdict = out.split("verdict:")[1].split("ranks:")[0]
    if how == "leaves":
        assert (
            f"rank {ODD} is behind: it never started allreduce #{seq} (4099 x float32, "
            "sum), which ranks 0, 1 started" in verdict
        ), out
        assert "closed its communicator" in verdict, out
    else:  # it started the allreduce only after the others had given up on it
        assert (
            f"rank {ODD} is behind: it started allreduce #{seq} (4099 x float32, sum)" in verdict
        ), out
        assert "after ranks 0, 1" in verdict, out
    assert "left no record" not in out
    table = _trace(directory, "--table", "--rank", str(ODD), "--last", "3")
    path = "boards" if transport == "auto" else "schedule"
    assert f"\nrank {ODD}: its last 3 collectives" in table and path in table, table


def test_trace_names_the_rank_that_called_another_collective(tmp_path):
    directory = str(tmp_path / "flight")
    env = {"DDL_FLIGHT_RECORDER": directory, "DDL_TIMEOUT": "30"}
    results = run_ranks(_behind, 3, "mismatch", env=env, timeout=120)
    _check_errors(results, directory, ("CollectiveMismatchError", "PeerFailureError"))
    seq = results[0][2]
    out = _trace(directory)
    assert (
        f"collective #{seq}: rank {ODD} called broadcast (4099 x float32, root 0) where "
        "ranks 0, 1 called allreduce (4099 x float32, sum)" in out
    ), out


_BUSY_ELSEWHERE = """
import time
import numpy as np
import ddlcore

comm = ddlcore.init()
x = np.random.default_rng(comm.rank).standard_normal(4099).astype(np.float32)
for _ in range(3):
    comm.allreduce(x)
comm.barrier()
if comm.rank == 2:
    # Busy elsewhere, waiting for a message rank 0 never sends: ddlrun stops it once another
    # rank has failed, and its record shows the receive in flight.
    end = time.monotonic() + 120
    while time.monotonic() < end:
        try:
            comm.recv(np.empty(3, np.int64), 0, tag=7)
        except ddlcore.DDLError:  # timed out, or failed as the others aborted: wait on
            time.sleep(0.05)
comm.allreduce(x)
"""


def test_trace_under_ddlrun_names_the_rank_it_stopped(tmp_path):
    directory = str(tmp_path / "flight")
    script = tmp_path / "busy_elsewhere.py"
    script.write_text(_BUSY_ELSEWHERE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    env.update(DDL_FLIGHT_RECORDER=directory, DDL_TIMEOUT=str(TIMEOUT_S))
    res = subprocess.run(
        [sys.executable, "-m", "ddlcore.launcher", "-np", "3", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert res.returncode != 0, res.stderr
    assert f"flight record: {os.path.join(directory, 'rank0.json')}" in res.stderr, res.stderr
    out = _trace(directory)
    assert (
        "rank 2 is behind: it never started allreduce #4 (4099 x float32, sum), which "
        "ranks 0, 1 started; its last collective was barrier #3" in out
    ), out
    assert "it was stopped by SIGTERM" in out, out
    assert "; point-to-point: recv of 24 bytes from rank 0 tag 7 " in out, out
