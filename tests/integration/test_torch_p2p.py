"""send/recv, batch_isend_irecv and new_group over some of the ranks on the "ddl" backend, in a
torch program that never imports ddlcore (scripts/torch_p2p_job.py), 3 ranks started the way a
Slurm script starts them."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

from tests.harness import require, run_like_torchrun
from tests.integration.test_launchers_real import _env

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "torch_p2p_job.py"


def test_p2p_and_subgroups_on_ddl(tmp_path):
    require(
        importlib.util.find_spec("torch") is not None,
        "torch is not installed (pip install 'ddlcore[torch]')",
    )
    assert "import ddlcore" not in SCRIPT.read_text()
    outs = run_like_torchrun([sys.executable, str(SCRIPT)], tmp_path, _env(), size=3)
    assert [o.strip() for o in outs] == [f"torch p2p ok: rank {r} of 3" for r in range(3)], outs
