"""The PyTorch integration's CUDA pack/unpack branch (``_common._cuda_pack``) without a GPU: on
Numba's simulator, whose "device" memory is host memory, CPU tensors stand in for CUDA ones, and
the three CUDA-only calls (torch's current stream, Numba's external stream and device context)
are stubbed. What it checks is the bookkeeping: data_ptr()s and counts, dtypes (bfloat16 named),
what falls back to torch, the size check."""

from __future__ import annotations

import contextlib

import pytest

from tests.kernels.cuda.helpers import run_in_process


def _torch_pack_branch() -> int:
    import torch
    from numba import cuda

    from ddlcore.integrations.torch import _common

    class _Stream:
        cuda_stream = 0

    class _Devices:
        def __getitem__(self, index):
            return contextlib.nullcontext()

    cuda.external_stream = lambda pointer: 0
    cuda.gpus = _Devices()
    torch.cuda.current_stream = lambda device=None: _Stream()
    checked = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        tensors = [
            torch.randn(n).to(dtype) if dtype.is_floating_point else torch.arange(n, dtype=dtype)
            for n in (3, 0, 7, 1)
        ]
        flat = torch.zeros(11, dtype=dtype)
        assert _common._cuda_pack(flat, tensors, to_flat=True)
        assert torch.equal(flat, torch.cat(tensors)), dtype
        outs = [torch.empty_like(t) for t in tensors]
        assert _common._cuda_pack(flat, outs, to_flat=False)
        assert all(torch.equal(a, b) for a, b in zip(outs, tensors, strict=True)), dtype
        checked += 1
    # torch does what the kernel does not take: int16, a strided tensor, mixed dtypes
    assert not _common._cuda_pack(
        torch.zeros(4, dtype=torch.int16), [torch.zeros(4, dtype=torch.int16)], to_flat=True
    )
    assert not _common._cuda_pack(torch.zeros(4), [torch.zeros(8)[::2]], to_flat=True)
    assert not _common._cuda_pack(torch.zeros(4), [torch.zeros(4, dtype=torch.float64)], True)
    with contextlib.suppress(ValueError):
        _common._cuda_pack(torch.zeros(4), [torch.zeros(5)], to_flat=True)
        raise AssertionError("a flat buffer too small was accepted")
    return checked


def test_torch_cuda_pack_branch_on_the_simulator():
    pytest.importorskip("torch")
    assert run_in_process(_torch_pack_branch) == 4
