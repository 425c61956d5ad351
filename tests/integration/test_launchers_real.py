"""Every launcher for real: jobs started by torchrun itself (its agent, its store on MASTER_PORT,
its restarts), by ddlrun and by hand, running the README's quick start and its DDP-hook recipe,
whose ``init_process_group("gloo")`` serves torch's store beside ddlcore's.

torchrun is run as ``python -m torch.distributed.run``: the module the ``torchrun`` command runs
(its console entry point), started with this interpreter so that the ranks import the ddlcore
under test. MPI launchers are run for real in test_launcher.py (``ddlrun --hosts``, which hands the
job to mpiexec) and tests/collectives (``launcher="mpiexec"``).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.harness import require, run_like_torchrun

README = pathlib.Path(__file__).parents[2] / "README.md"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
DDLRUN = [sys.executable, "-m", "ddlcore.launcher"]
_LAUNCHER_VARS = re.compile(
    r"(DDL_|TORCHELASTIC_|PMI_|OMPI_|SLURM_|MPI_LOCAL)|"
    r"(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|"
    r"MASTER_ADDR|MASTER_PORT)$"
)

# The README's DDP-hook recipe, made a whole program: DDP's gradients averaged by ddlcore's hook
# are checked against the mean of every rank's own gradient, computed here without communication,
# and gloo's process group still works beside ddlcore.
DDP_SCRIPT = """\
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddlcore
from ddlcore.integrations.torch import allreduce_hook

dist.init_process_group("gloo")
comm = ddlcore.init()                                     # after dist.init_process_group(...)
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 3))
model.register_comm_hook(comm, allreduce_hook)            # each bucket averaged by ddlcore


def batch(rank):
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(100 + rank))


model(batch(comm.rank)).square().sum().backward()
ref = torch.nn.Linear(8, 3)
ref.load_state_dict(model.module.state_dict())
grads = []
for r in range(comm.size):
    ref.zero_grad()
    ref(batch(r)).square().sum().backward()
    grads.append(ref.weight.grad.clone())
expected = torch.stack(grads).mean(0)
assert torch.allclose(model.module.weight.grad, expected, rtol=1e-5, atol=1e-6), \\
    (model.module.weight.grad, expected)
total = torch.tensor([comm.rank + 1.0])
dist.all_reduce(total)
sys.stdout.write(f"ddp ok: rank {comm.rank} of {comm.size}, gloo sum {total.item():g}\\n")
comm.close()
dist.destroy_process_group()
"""

# ddlcore.init() and an allreduce checked against NumPy, twice in one process (a second init
# finds rank 0's store again); rank 1 of torchrun's first attempt fails before init, so that the
# second attempt must not read the first one's store address.
ALLREDUCE_SCRIPT = """\
import os, sys
import numpy as np
import ddlcore

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 0 and os.environ["RANK"] == "1":
    sys.exit(3)
for _ in range(2):
    with ddlcore.init() as comm:
        assert comm.source == "torchrun", comm.source
        xs = [np.random.default_rng(r).standard_normal(1001) for r in range(comm.size)]
        y = comm.allreduce(xs[comm.rank])
        np.testing.assert_allclose(y, np.sum(xs, axis=0), rtol=1e-12)
sys.stdout.write(f"allreduce ok: rank {comm.rank} of {comm.size}, attempt {attempt}\\n")
"""


@pytest.fixture(autouse=True)
def _needs_torch():
    require(
        importlib.util.find_spec("torch") is not None,
        "torch is not installed (pip install 'ddlcore[torch]'): no torchrun",
    )


def _env() -> dict[str, str]:
    """This environment without any launcher's variables (a test may itself run under one)."""
    env = {k: v for k, v in os.environ.items() if not _LAUNCHER_VARS.match(k)}
    env["DDL_TIMEOUT"] = "30"  # a failure fails in seconds, not DDL_TIMEOUT's default 600
    return env


def _launch(argv: list[str], cwd: pathlib.Path) -> str:
    res = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{argv} exited {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res.stdout


def _quick_start() -> str:
    """The README's quick-start program, as a user copies it."""
    text = README.read_text()
    section = text[text.index("## Quick start") :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_quick_start_under_torchrun(tmp_path):
    program = _quick_start()
    assert "torchrun --nproc-per-node 4 hello.py" in program  # the command the README gives
    (tmp_path / "hello.py").write_text(program)
    out = _launch(TORCHRUN + ["--nproc-per-node", "2", "hello.py"], tmp_path)
    # Lines, not split at newlines: torchrun's ranks share one pipe, and print() writes a line
    # and its newline apart, so one rank's line can land between another's and its newline.
    lines = sorted(re.findall(r"rank \d of \d: sum .*?avg \d", out))
    assert lines == [
        f"rank {r} of 2: sum 1, reduce_scatter [2. 2. 2. 2.], allgather [0 1], avg 1"
        for r in range(2)
    ], out


def test_allreduce_under_torchrun_and_its_restart(tmp_path):
    (tmp_path / "job.py").write_text(ALLREDUCE_SCRIPT)
    out = _launch(TORCHRUN + ["--nproc-per-node", "2", "--max-restarts", "1", "job.py"], tmp_path)
    assert sorted(re.findall(r"allreduce ok: rank \d of \d, attempt \d", out)) == [
        f"allreduce ok: rank {r} of 2, attempt 1" for r in range(2)
    ], out


@pytest.mark.parametrize("launcher", ["torchrun", "ddlrun"])
def test_readme_ddp_hook_recipe(tmp_path, launcher):
    (tmp_path / "train.py").write_text(DDP_SCRIPT)
    readme = README.read_text()
    if launcher == "torchrun":
        command = "torchrun --nproc-per-node 4 train.py"
        argv = TORCHRUN + ["--nproc-per-node", "2", "train.py"]
    else:
        command = "ddlrun -np 4 python train.py"
        argv = DDLRUN + ["-np", "2", "train.py"]
    recipe = readme[
        readme.index("An existing DDP script") : readme.index("A single-process script")
    ]
    assert command in recipe, f"the README's DDP recipe no longer says {command!r}"
    for line in (
        'dist.init_process_group("gloo")',
        "comm = ddlcore.init()",
        "model.register_comm_hook(comm, allreduce_hook)",
    ):
        assert line in recipe and line in DDP_SCRIPT, line
    out = _launch(argv, tmp_path)
    assert sorted(re.findall(r"ddp ok: rank \d of \d, gloo sum \d+", out)) == [
        f"ddp ok: rank {r} of 2, gloo sum 3" for r in range(2)
    ], out


def test_ddp_hook_recipe_started_by_hand(tmp_path):
    """torch's variables set by hand (a Slurm script's way): no agent holds MASTER_PORT, the
    script's init_process_group serves torch's store there, and ddlcore meets through it."""
    (tmp_path / "train.py").write_text(DDP_SCRIPT)
    outs = run_like_torchrun([sys.executable, "train.py"], tmp_path, _env())
    for rank, out in enumerate(outs):
        assert out == f"ddp ok: rank {rank} of 2, gloo sum 3\n", out
