"""PyTorch's own generic distributed test suite against the backend "ddl".

    python .ci/torch_distributed_suite.py [--world-size 2] [unittest args, e.g. -k all_reduce]

The suite ships in the torch wheel (`torch/testing/_internal/distributed/distributed_test.py`,
`DistributedTest._DistTestBase`); this drives it the way PyTorch's
`test/distributed/test_distributed_spawn.py` does: BACKEND=ddl, a fresh TEMP_DIR, one spawned
process per rank for every test, each joining through the file store torch hands the backend.
"ddl" is declared a DDP-, subgroup- and CUDA-capable plugin backend before the suite is
imported (its decorators read that at import), so the suite runs the tests it runs for gloo,
except those it keeps for NCCL, MPI or UCC, or that need GPUs. Needs the `expecttest` package (the `test` extra has it).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

# Module level, not in a function: every rank is a spawned process that imports this file again
# (as __mp_main__) and must find the test class by name; the variables set here reach it.
if __name__ == "__main__":
    import argparse

    _parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    _parser.add_argument("--world-size", type=int, default=2)
    _args, _rest = _parser.parse_known_args()
    os.environ["WORLD_SIZE"] = str(_args.world_size)
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="ddl-torch-suite-")
    # Ours to remove (the ranks, spawned, re-import this file without running this block).
    atexit.register(shutil.rmtree, os.environ["TEMP_DIR"], ignore_errors=True)
    sys.argv = [sys.argv[0], *_rest]
os.environ["BACKEND"] = "ddl"
# torch's test runner takes CI=... for PyTorch's own CI: it would write XML reports through
# xmlrunner (not installed) and load PyTorch's CI profiles. This is not that CI.
os.environ.pop("CI", None)
os.environ.setdefault("WORLD_SIZE", "2")
# A failing rank fails its test in seconds, not after DDL_TIMEOUT's 600 s default; the suite's
# own process-group timeouts (60 s, some 5 s) still apply through init_process_group.
os.environ.setdefault("DDL_TIMEOUT", "60")

import torch.distributed as dist  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

if not dist.is_available() or "DDL" not in dist.Backend._plugins:
    sys.exit("the ddl backend is not registered: pip install -e . (its torch.backends entry)")
# "gpu" and "cuda": the backend takes CUDA tensors (tests that need a GPU still skip without one).
for _feature in ("ddp", "subgroup", "plugin", "gpu", "cuda"):
    DistTestCases.backend_feature[_feature].add("ddl")

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

# Tests the suite keeps for other backends although they ask nothing of a backend that "ddl"
# lacks (coalesced allreduce, DDP's no_sync, get_future, scatter_object_list, all_to_all on
# CPU tensors): "ddl" runs them too, by the reason torch gives for skipping. The
# monitored_barrier tests stay gloo's: they test gloo's own API and its error messages.
_ALSO_FOR_DDL = (
    ("test_all_reduce_coalesced_", "to be one of {'gloo'}"),
    ("test_grads_same_across_ranks_with_no_sync", "to be one of {'gloo'}"),
    ("test_scatter_object_list", "to be one of {'gloo'}"),
    ("test_all_to_all", "Only MPI supports CPU all_to_all_single"),
    ("test_all_to_all", "Only MPI supports all_to_all"),
    ("test_get_future", "get_future is only supported on mpi, nccl and gloo"),
)
for _name, _test in vars(DistributedTest._DistTestBase).items():
    _why = getattr(_test, "__unittest_skip_why__", "")
    if any(_name.startswith(n) and _why.endswith(w) for n, w in _ALSO_FOR_DDL):
        _test.__unittest_skip__ = False


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
