"""Training on the backend "ddl" as torch's own parallelisms do it, under the real torchrun:
FSDP2 (``fully_shard`` on CPU, in float32 and bfloat16 mixed precision) in a program that never
imports ddlcore, against the same program on gloo. (DDP's check is in test_torch_backend.)
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess

import pytest

from tests.harness import free_port, require
from tests.integration.test_launchers_real import TORCHRUN, _env

SCRIPTS = pathlib.Path(__file__).parent / "scripts"


@pytest.fixture(autouse=True)
def _needs_torch():
    require(
        importlib.util.find_spec("torch") is not None,
        "torch is not installed (pip install 'ddlcore[torch]')",
    )


def _torchrun(script: pathlib.Path, args: list[str], cwd: pathlib.Path) -> str:
    argv = TORCHRUN + ["--nproc-per-node", "2", "--master-port", str(free_port())]
    res = subprocess.run(
        argv + [str(script), *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, f"{args} exited {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res.stdout


def test_fsdp2_on_ddl_matches_gloo(tmp_path):
    import torch

    script = SCRIPTS / "torch_fsdp_job.py"
    assert "import ddlcore" not in script.read_text()
    # Both backends in one job, one after the other (torch starts once).
    out = _torchrun(script, ["ddl,gloo", str(tmp_path)], tmp_path)
    results = {}
    for backend in ("ddl", "gloo"):
        # Matched, not split at newlines: the ranks share torchrun's pipe.
        assert sorted(re.findall(rf"fsdp ok: {backend} rank \d of \d", out)) == [
            f"fsdp ok: {backend} rank {r} of 2" for r in range(2)
        ], out
        results[backend] = torch.load(tmp_path / f"{backend}.pt", weights_only=True)
    ddl, gloo = results["ddl"], results["gloo"]
    assert sorted(ddl) == sorted(gloo) == ["bf16", "bf16-reduce", "fp32"], sorted(ddl)
    for policy in gloo:
        assert sorted(ddl[policy]) == sorted(gloo[policy]), policy
        assert len(gloo[policy]) > 2, sorted(gloo[policy])  # losses and parameters
        for name, want in gloo[policy].items():
            torch.testing.assert_close(
                ddl[policy][name], want, rtol=1e-5, atol=1e-5, msg=f"{policy} {name}"
            )
        assert not torch.equal(gloo[policy]["losses"][0], gloo[policy]["losses"][-1]), policy
