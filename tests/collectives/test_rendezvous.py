"""Rendezvous end to end: torchrun's variables, a missing rank, DDL_DEBUG's per-collective log."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from tests.harness import barrier, free_port, run_ranks


def _torchrun_style(rank, size):
    import ddlcore

    with ddlcore.init() as comm:
        assert comm.source == "torchrun"
        return comm.allreduce(np.array([rank + 1], np.int64)).tolist()


def test_torchrun_variables():
    port = free_port()
    ddl_vars = {
        v: None
        for v in (
            "DDL_RANK",
            "DDL_SIZE",
            "DDL_LOCAL_RANK",
            "DDL_LOCAL_SIZE",
            "DDL_MASTER_ADDR",
            "DDL_MASTER_PORT",
        )
    }
    per_rank = {r: {"RANK": str(r), "LOCAL_RANK": str(r)} for r in range(3)}
    env = {**ddl_vars, "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    assert run_ranks(_torchrun_style, 3, env=env, rank_envs=per_rank, timeout=60) == [[6]] * 3


def _missing_rank(rank, size, answered):
    import ddlcore

    try:
        ddlcore.init(size=3, timeout=3.0)  # only two of three ranks exist
    except ddlcore.RendezvousError as exc:
        answered.wait(50)  # rank 0 serves the store: it stays until rank 1 knows who is missing
        return str(exc)
    raise AssertionError("init succeeded with a rank missing")


def test_missing_rank_is_reported_with_counts():
    for message in run_ranks(_missing_rank, 2, barrier(2), timeout=60):
        assert "2 of 3 ranks" in message and "missing ranks: [2]" in message, message


def test_debug_logs_algorithm_box_and_chunking(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import numpy as np, ddlcore\n"
        "with ddlcore.init() as comm:\n"
        "    comm.allreduce(np.ones(1000, np.float32))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    env.update({"DDL_DEBUG": "1", "DDL_CHUNK_BYTES": "1K"})
    res = subprocess.run(
        [sys.executable, "-m", "ddlcore.launcher", "-np", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    # Both ranks on this host over shm: the host collectives take it, through the shared slots.
    assert (
        "allreduce #0 (1000 x float32, sum) via direct, through the shared slots" in res.stderr
    ), res.stderr
    assert "transports ['shm']" in res.stderr  # auto: shared memory between ranks of one host
    # Over TCP the schedules run: 4 KB on two ranks, the cost model takes recursive doubling.
    env["DDL_TRANSPORT"] = "tcp"
    res = subprocess.run(
        [sys.executable, "-m", "ddlcore.launcher", "-np", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert "allreduce #0 (1000 x float32, sum) via rd, chunks of 1024 B, predicted" in res.stderr, (
        res.stderr
    )
    assert "box 2," in res.stderr


def test_a_process_without_a_launcher_is_told_it_is_alone():
    """No launcher variables: a world of one, and DDL_DEBUG=1 says why and what to run."""
    from ddlcore import config

    env = {k: v for k, v in os.environ.items() if k not in config.VARS}
    env["DDL_DEBUG"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", "import ddlcore; c = ddlcore.init(); print(c.rank, c.size)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1"]
    assert "no launcher variables are set" in done.stderr
    assert "ddlrun -np N" in done.stderr


def _close_late(rank, size):
    import time

    import ddlcore

    comm = ddlcore.init()
    comm.barrier()
    if rank != 0:
        time.sleep(0.5)  # still busy after the last collective; rank 0 must not take the store
    began = time.time()
    comm.close()
    return began, time.time()


def test_rank_0_closes_after_every_rank_began_closing():
    """Rank 0's process serves the store: its close waits for the other ranks' closes, so that
    its exit cannot take the store from a rank still finishing (a lazy connection looks its
    peer up there)."""
    env = {"DDL_TRANSPORT": "tcp", "DDL_TIMEOUT": "30"}
    times = run_ranks(_close_late, 3, env=env, timeout=60)
    rank0_done = times[0][1]
    assert all(rank0_done >= began for began, _ in times[1:]), times
