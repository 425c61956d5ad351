"""Every CUDA kernel test needs numba-cuda (the simulator or a GPU come with it)."""

from __future__ import annotations

import pytest

from tests.harness import require
from tests.kernels.cuda.helpers import numba_cuda_installed


@pytest.fixture(autouse=True)
def _needs_numba_cuda():
    require(numba_cuda_installed(), "numba-cuda not installed (pip install 'ddlcore[cuda]')")
