"""The torch.distributed backend "ddl" for real: programs that never import ddlcore call
``dist.init_process_group("ddl")`` under torchrun, ddlrun, mpiexec and srun's variables (as
written: nothing set by hand) and by hand (a Slurm script's way), run every supported
collective against a reference (bool tensors against gloo's), train with DDP against gloo, and
see a dead or silent peer as torch's DistBackendError with ddlcore's message.

The programs reach ddlcore through the ``torch.backends`` entry point of the installed package
(``pip install -e .`` registers it).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

from tests.harness import free_port, mpiexec_path, require, run_like_torchrun
from tests.integration.test_launchers_real import DDLRUN, TORCHRUN, _env

SCRIPTS = pathlib.Path(__file__).parent / "scripts"

# One rank leaves (exits, or stays silent past the process group's 3 s timeout) after a barrier;
# the other's allreduce must fail with torch's error type carrying ddlcore's words.
FAILURE_SCRIPT = """\
import os, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist

how = sys.argv[1]
dist.init_process_group("ddl", timeout=timedelta(seconds=3))
rank = dist.get_rank()
store = dist.distributed_c10d._get_default_store()  # torch's, served by rank 0
dist.barrier()
if rank == 1:
    if how == "silent":  # alive, in no collective, until rank 0 failed
        store.wait(["failed"], timedelta(seconds=60))
        store.set("bye", "1")
    os._exit(0)
time.sleep(0.5)
t0 = time.monotonic()
try:
    dist.all_reduce(torch.ones(1000))
except dist.DistBackendError as exc:
    cause = type(exc.__cause__)
    sys.stdout.write(f"failed after {time.monotonic() - t0:.1f} s "
                     f"({cause.__module__}.{cause.__name__}): {exc}\\n")
    if how == "silent":
        store.set("failed", "1")
        store.wait(["bye"], timedelta(seconds=60))
    sys.exit(0)
sys.exit("the allreduce did not fail")
"""


@pytest.fixture(autouse=True)
def _needs_torch():
    require(
        importlib.util.find_spec("torch") is not None,
        "torch is not installed (pip install 'ddlcore[torch]')",
    )


def _run(argv: list[str], cwd: pathlib.Path, **env: str) -> str:
    res = subprocess.run(
        argv, cwd=cwd, env={**_env(), **env}, capture_output=True, text=True, timeout=180
    )
    assert res.returncode == 0, f"{argv} exited {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res.stdout


def test_entry_point_registers_the_backend_at_import_torch(tmp_path):
    points = importlib.metadata.entry_points(group="torch.backends")
    assert any(p.name == "ddl" and p.value.startswith("ddlcore.") for p in points), (
        "ddlcore's torch.backends entry point is not installed: pip install -e . again"
    )
    # Cheap: what torch imports for it is the backend module, not the engine, not the kernels.
    out = _run(
        [
            sys.executable,
            "-c",
            "import sys, torch.distributed as dist; "
            "print(dist.Backend.DDL, dist.Backend.backend_capability['ddl']); "
            "print(sorted(m for m in sys.modules if m.startswith('ddlcore.')))",
        ],
        tmp_path,
    )
    registered, imported = out.splitlines()
    assert registered == "ddl ['cpu', 'cuda']", out
    assert "ddlcore.integrations.torch.backend" in imported, out
    for heavy in ("communicator", "engine", "bootstrap", "kernels", "transports"):
        assert f"'ddlcore.{heavy}" not in imported, out


def test_autoload_never_raises(monkeypatch):
    """torch turns an exception of the entry point into a failed ``import torch``."""
    import torch.distributed as dist

    from ddlcore.integrations.torch import autoload

    def broken(*args, **kwargs):
        raise RuntimeError("a torch that changed its registration API")

    monkeypatch.delitem(dist.Backend._plugins, "DDL", raising=False)
    monkeypatch.setattr(dist.Backend, "register_backend", broken)
    autoload.register_ddl()  # the entry point (and the package's import): no exception
    assert "DDL" not in dist.Backend._plugins


def test_importing_the_integration_before_torch(tmp_path):
    """torch's entry point runs inside the backend's own ``import torch`` then; the backend is
    still registered, and the import does not fail."""
    out = _run(
        [
            sys.executable,
            "-c",
            "import ddlcore.integrations.torch, torch.distributed as dist; print(dist.Backend.DDL)",
        ],
        tmp_path,
    )
    assert out == "ddl\n", out


@pytest.mark.parametrize("launcher", ["torchrun", "ddlrun"])
def test_collectives_and_ddp_on_ddl(tmp_path, launcher):
    script = SCRIPTS / "torch_backend_job.py"
    assert "import ddlcore" not in script.read_text()
    if launcher == "torchrun":
        argv = TORCHRUN + ["--nproc-per-node", "2", str(script)]
    else:
        argv = DDLRUN + ["-np", "2", str(script)]
    out = _run(argv, tmp_path)
    assert sorted(re.findall(r"torch backend ok: rank \d of \d", out)) == [
        f"torch backend ok: rank {r} of 2" for r in range(2)
    ], out


def test_collectives_and_ddp_on_ddl_with_cuda_tensors(tmp_path):
    """The same program on CUDA tensors (rank r on GPU r modulo the GPUs there are): ddlcore's
    device path under torch's collectives, DDP against gloo's CUDA allreduce."""
    import torch

    if not torch.cuda.is_available():  # a skip DDL_REQUIRE_ALL allows: CI has no GPU
        pytest.skip("needs a real GPU (torch.cuda.is_available() is False)")
    script = SCRIPTS / "torch_backend_job.py"
    out = _run(TORCHRUN + ["--nproc-per-node", "2", str(script), "cuda"], tmp_path)
    assert sorted(re.findall(r"torch backend ok: rank \d of \d", out)) == [
        f"torch backend ok: rank {r} of 2" for r in range(2)
    ], out


# A 2 x 2 DeviceMesh: its groups are ddl groups over some of the ranks, made from the world's;
# collectives on each dimension and DTensor placements over both.
MESH_SCRIPT = """\
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

dist.init_process_group("ddl")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
for name, members in (("dp", [rank % 2, rank % 2 + 2]), ("tp", [rank // 2 * 2, rank // 2 * 2 + 1])):
    group = mesh.get_group(name)
    assert dist.get_backend(group) == "ddl", dist.get_backend(group)
    assert dist.get_process_group_ranks(group) == members, (name, members)
    x = torch.tensor([rank + 0.5, -rank])
    dist.all_reduce(x, group=group)
    assert x.tolist() == [sum(members) + 1.0, -sum(members)], (name, x)
full = torch.randn(8, 6, generator=torch.Generator().manual_seed(7))
t = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
assert t.to_local().shape == (4, 3), t.to_local().shape
assert torch.equal(t.full_tensor(), full)
moved = t.redistribute(mesh, [Replicate(), Shard(0)])
assert torch.equal(moved.to_local(), full.chunk(2, dim=0)[rank % 2])
sys.stdout.write(f"mesh ok: rank {rank}\\n")
dist.destroy_process_group()
"""


def test_two_dimensional_device_mesh(tmp_path):
    """init_device_mesh over 4 ranks as 2 x 2: each dimension's groups reduce over their own
    members, and a DTensor sharded on both dimensions gathers and redistributes exactly."""
    (tmp_path / "mesh.py").write_text(MESH_SCRIPT)
    out = _run(TORCHRUN + ["--nproc-per-node", "4", "mesh.py"], tmp_path)
    assert sorted(re.findall(r"mesh ok: rank \d", out)) == [
        f"mesh ok: rank {r}" for r in range(4)
    ], out


# Under an MPI launcher torch reads no PMI_* variable and no address is set: the program as
# written, rank and size from the launcher, torch's store's address broadcast over MPI by
# ddlcore's rendezvous (`ddlcore.integrations.torch.launchers`); gloo beside it gets the same.
MPI_SCRIPT = """\
import sys

import torch
import torch.distributed as dist

init_method = sys.argv[1] if len(sys.argv) > 1 else None
dist.init_process_group("ddl", init_method=init_method)
rank, size = dist.get_rank(), dist.get_world_size()
t = torch.full((5,), rank + 1.0)
dist.all_reduce(t)
assert torch.equal(t, torch.full((5,), size * (size + 1) / 2)), t
comm = dist.group.WORLD.communicator
assert (comm.rank, comm.size) == (rank, size), (comm, rank, size)
g = dist.new_group(backend="gloo")
u = torch.full((3,), rank + 1.0)
dist.all_reduce(u, group=g)
assert torch.equal(u, t[:3]), u
sys.stdout.write(f"mpiexec ok: rank {comm.rank} of {comm.size}, local size {comm.local_size}\\n")
# The gloo group first, while both ranks are here: left to the interpreter's exit, its threads
# can outlive the peer's sockets (once in CI: "terminate called without an active exception").
dist.barrier(group=g)
dist.destroy_process_group(g)
dist.destroy_process_group()
"""


def _mpiexec() -> str:
    mpiexec = mpiexec_path()
    require(mpiexec is not None, "mpiexec is not installed (pip install 'ddlcore[mpi]')")
    assert mpiexec is not None
    return mpiexec


@pytest.mark.parametrize("init_method", ["", "ddl://"], ids=["as-written", "ddl-url"])
def test_under_mpiexec(tmp_path, init_method):
    """``init_process_group("ddl")`` with nothing set by hand: no rank, size or address."""
    (tmp_path / "job.py").write_text(MPI_SCRIPT)
    argv = [_mpiexec(), "-n", "2", sys.executable, "job.py"] + (
        [init_method] if init_method else []
    )
    out = _run(argv, tmp_path)
    assert sorted(re.findall(r"mpiexec ok: .*", out)) == [
        f"mpiexec ok: rank {r} of 2, local size 2" for r in range(2)
    ], out


def test_under_mpiexec_with_torchs_variables_set_by_hand(tmp_path):
    """Where the script hands rank and size over and MASTER_ADDR/MASTER_PORT are set (the
    habit this makes unneeded), torch's own rendezvous runs, as before."""
    script = MPI_SCRIPT.replace(
        'dist.init_process_group("ddl", init_method=init_method)',
        "import os\n"
        'dist.init_process_group("ddl", rank=int(os.environ["PMI_RANK"]), '
        'world_size=int(os.environ["PMI_SIZE"]))',
    )
    (tmp_path / "job.py").write_text(script)
    # The rendezvous address in mpiexec's own environment, which every MPI's launcher passes on
    # to local ranks (MPICH's -genv is not Open MPI's -x).
    out = _run(
        [_mpiexec(), "-n", "2", sys.executable, "job.py"],
        tmp_path,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    assert len(re.findall(r"mpiexec ok: .*", out)) == 2, out


def test_bool_tensors_give_gloos_results(tmp_path):
    """A bool tensor reduces on "ddl" as on gloo (sum and max: or; prod and min: and), with
    every collective, beside a gloo group in the same processes; 3 ranks under mpiexec, as
    written, through ``init_method="ddl://"``."""
    script = SCRIPTS / "torch_bool_job.py"
    assert "import ddlcore" not in script.read_text()
    out = _run([_mpiexec(), "-n", "3", sys.executable, str(script), "ddl://"], tmp_path)
    assert sorted(re.findall(r"torch bool ok: rank \d of \d", out)) == [
        f"torch bool ok: rank {r} of 3" for r in range(3)
    ], out


def test_bool_tensors_under_torchrun(tmp_path):
    script = SCRIPTS / "torch_bool_job.py"
    out = _run(TORCHRUN + ["--nproc-per-node", "2", str(script)], tmp_path)
    assert sorted(re.findall(r"torch bool ok: rank \d of \d", out)) == [
        f"torch bool ok: rank {r} of 2" for r in range(2)
    ], out


def _run_like_srun(cwd: pathlib.Path, script: str, size: int, **env: str) -> list[str]:
    """``size`` ranks with Slurm's variables only (srun's way; no PMI that MPI can use)."""
    procs = [
        subprocess.Popen(
            [sys.executable, script],
            cwd=cwd,
            env={**_env(), **env, "SLURM_PROCID": str(r), "SLURM_NTASKS": str(size)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(size)
    ]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [f"exit {p.returncode}\n{out}{err}" for p, (out, err) in zip(procs, outs, strict=True)]


def test_under_srun_with_an_address_set_by_hand(tmp_path):
    """A Slurm script that exports MASTER_ADDR and MASTER_PORT (the first node, a free port)
    needs no RANK and WORLD_SIZE: they come from SLURM_PROCID and SLURM_NTASKS."""
    (tmp_path / "job.py").write_text(MPI_SCRIPT.replace("mpiexec ok", "srun ok"))
    outs = _run_like_srun(
        tmp_path, "job.py", 2, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    for rank, out in enumerate(outs):
        assert out.startswith("exit 0\n") and f"srun ok: rank {rank} of 2" in out, out


def test_under_srun_without_a_pmi_or_an_address_says_what_to_do(tmp_path):
    (tmp_path / "job.py").write_text(MPI_SCRIPT)
    for out in _run_like_srun(tmp_path, "job.py", 2):
        assert not out.startswith("exit 0"), out
        assert "srun --mpi=pmi2" in out and "MASTER_ADDR" in out, out


@pytest.mark.parametrize(
    ("how", "cause", "words"),
    [
        ("exit", "PeerFailureError", r"rank 1 \(pid \d+\) exited"),
        ("silent", "DDLTimeoutError", r"rank 1 did not reach .* within .*=3 s"),
    ],
    ids=["peer-exits", "peer-silent"],
)
def test_a_failed_peer_is_a_dist_backend_error(tmp_path, how, cause, words):
    """Started by hand (torch's variables, no agent): the surviving rank's allreduce raises
    DistBackendError with ddlcore's error as its cause and its message, within the process
    group's timeout."""
    (tmp_path / "job.py").write_text(FAILURE_SCRIPT)
    outs = run_like_torchrun([sys.executable, "job.py", how], tmp_path, _env())
    out = outs[0]
    match = re.fullmatch(r"failed after ([\d.]+) s \(ddlcore\.errors\.(\w+)\): (.*)\n", out)
    assert match, out
    seconds, raised, message = float(match[1]), match[2], match[3]
    assert raised == cause, out
    assert message.startswith("ddl backend, allreduce: rank 0: allreduce #"), message
    assert re.search(words, message), message
    assert seconds < 10, out  # the process group's 3 s, not DDL_TIMEOUT's 30


def test_init_with_a_store_needs_rank_and_size():
    import torch.distributed as dist

    import ddlcore

    store = dist.HashStore()
    for kwargs in ({}, {"rank": 0}, {"size": 2}, {"rank": 0, "size": 2, "master_port": 1}):
        with pytest.raises(ValueError, match="store= needs rank= and size="):
            ddlcore.init(store=store, **kwargs)
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, size=2\)"):
        ddlcore.init(store=store, rank=2, size=2)
