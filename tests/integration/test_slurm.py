"""Jobs started by Slurm's ``srun`` for real: a one-node Slurm cluster of this machine (munged,
slurmctld and slurmd from Debian's ``slurm-wlm`` and ``munge`` packages, which ``.ci/run``
installs), started for this module on free ports with its state in a temporary directory.

ddlcore.init() under ``srun --mpi=pmi2`` takes rank and size from SLURM_* and meets through
MPI (the MPICH wheel speaks Slurm's PMI2), with no address set; without a PMI plugin it says
what to do. The torch backend under srun takes rank and size from SLURM_* as a Slurm script
hands them to ``init_process_group`` (torch reads no SLURM_* variable).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.harness import free_port, require
from tests.integration.test_launchers_real import _env

_SLURM_CONF = """\
ClusterName=ddltest
SlurmctldHost={host}
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmUser={user}
SlurmdUser={user}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
MpiDefault=none
ReturnToService=2
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""

HELLO = """\
import numpy as np
import ddlcore

with ddlcore.init() as comm:
    x = np.random.default_rng(comm.rank).standard_normal(1031).astype(np.float32)
    y = comm.allreduce(x)
    want = sum(np.random.default_rng(r).standard_normal(1031).astype(np.float32)
               for r in range(comm.size))
    np.testing.assert_allclose(y, want, rtol=1e-5)
    print(f"srun ok: rank {comm.rank} of {comm.size}, local {comm.local_rank} of "
          f"{comm.local_size}", flush=True)
"""

TORCH = """\
import os

import torch
import torch.distributed as dist

rank, size = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("ddl", rank=rank, world_size=size)
t = torch.arange(6, dtype=torch.float32) * (rank + 1)
dist.all_reduce(t)
assert torch.equal(t, torch.arange(6, dtype=torch.float32) * size * (size + 1) / 2), t
print(f"srun torch ok: rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
dist.destroy_process_group()
"""


def _wait_for(what: str, ok, log: pathlib.Path, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not ok():
        if time.monotonic() > deadline:
            tail = log.read_text()[-2000:] if log.exists() else "(no log)"
            raise TimeoutError(f"{what} not up after {limit:g} s:\n{tail}")
        time.sleep(0.2)


def _munge_running() -> bool:
    return subprocess.run(["munge", "-n"], capture_output=True, timeout=10).returncode == 0


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[dict[str, str]]:
    """A one-node Slurm cluster for this module; the environment that reaches it."""
    needed = ("munged", "munge", "slurmctld", "slurmd", "srun", "sinfo")
    missing = [tool for tool in needed if shutil.which(tool) is None]
    require(
        not missing,
        f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge",
    )
    require(os.geteuid() == 0, "a private Slurm cluster needs root (slurmd runs jobs as users)")
    if not _munge_running():  # munge's socket dir; munged makes its own key on install
        os.makedirs("/run/munge", exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["munged", "--force"], check=True, capture_output=True, timeout=30)
        _wait_for("munged", _munge_running, pathlib.Path("/var/log/munge/munged.log"))
    base = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (base / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    conf = base / "slurm.conf"
    conf.write_text(
        _SLURM_CONF.format(
            host=host,
            user="root",
            dir=base,
            ctld_port=free_port(),
            d_port=free_port(),
            cpus=os.cpu_count() or 1,
        )
    )
    env = {**_env(), "SLURM_CONF": str(conf)}
    daemons = [
        subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(conf)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        ),
        subprocess.Popen(
            ["slurmd", "-D", "-N", host, "-f", str(conf)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        ),
    ]
    try:

        def idle() -> bool:
            res = subprocess.run(
                ["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=10
            )
            return res.stdout.strip() in ("idle", "mix", "alloc")

        _wait_for("the Slurm node", idle, base / "slurmd.log")
        yield env
    finally:
        for proc in daemons:
            proc.terminate()
        for proc in daemons:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _srun(env: dict[str, str], cwd: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["srun", "--overcommit", "--kill-on-bad-exit=1", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_init_under_srun_with_pmi2(slurm, tmp_path):
    (tmp_path / "hello.py").write_text(HELLO)
    res = _srun(slurm, tmp_path, "--mpi=pmi2", "-n", "3", sys.executable, "hello.py")
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(line for line in res.stdout.splitlines() if "srun ok" in line) == [
        f"srun ok: rank {r} of 3, local {r} of 3" for r in range(3)
    ], res.stdout + res.stderr


def test_init_under_srun_without_a_pmi_says_what_to_do(slurm, tmp_path):
    (tmp_path / "hello.py").write_text(HELLO)
    res = _srun(slurm, tmp_path, "-n", "2", sys.executable, "hello.py")
    assert res.returncode != 0, res.stdout
    assert "srun --mpi=pmi2" in res.stderr and "DDL_MASTER_ADDR" in res.stderr, res.stderr


def test_torch_backend_under_srun(slurm, tmp_path):
    (tmp_path / "job.py").write_text(TORCH)
    env = {**slurm, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    res = _srun(env, tmp_path, "-n", "2", sys.executable, "job.py")
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(line for line in res.stdout.splitlines() if "srun torch ok" in line) == [
        f"srun torch ok: rank {r} of 2" for r in range(2)
    ], res.stdout + res.stderr
