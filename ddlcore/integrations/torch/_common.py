"""What the PyTorch integration's parts share: argument checks, packing many tensors into one flat
buffer (the fused pack kernels), and the check that every rank holds the same tensors."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch

from ddlcore.communicator import Communicator
from ddlcore.errors import CollectiveMismatchError
from ddlcore.kernels import pack, unpack

_WIRE_DTYPES = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def communicator(comm: Any, what: str) -> Communicator:
    """``comm``, checked to be a ddlcore Communicator (``what`` names the caller)."""
    if not isinstance(comm, Communicator):
        raise TypeError(
            f"{what} needs a ddlcore Communicator (comm = ddlcore.init()), "
            f"not {type(comm).__name__}"
        )
    return comm


def wire_dtype(compression: Any) -> torch.dtype | None:
    """The dtype gradients travel in for a ``compression`` argument (None: their own)."""
    if compression is None or compression in (torch.float16, torch.bfloat16):
        return compression
    if isinstance(compression, str) and compression.lower() in _WIRE_DTYPES:
        return _WIRE_DTYPES[compression.lower()]
    raise ValueError(f"compression={compression!r}: use None, 'fp16' or 'bf16'")


def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def _ranges(tensors: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Addresses and byte counts of host tensors, as the pack/unpack kernels take them."""
    addrs = np.fromiter((t.data_ptr() for t in tensors), np.uint64, len(tensors))
    sizes = np.fromiter((nbytes(t) for t in tensors), np.uint64, len(tensors))
    return addrs, sizes


_KERNEL_DTYPES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int32: "int32",
    torch.int64: "int64",
}


def _cuda_pack(flat: torch.Tensor, tensors: list[torch.Tensor], to_flat: bool) -> bool:
    """Pack (``to_flat``) or unpack CUDA ``tensors`` with the fused kernel: one launch on torch's
    current stream, whatever their number. The kernel takes data_ptr()s directly (no per-tensor
    Numba array to build); bfloat16 is named, as Numba has no such type. False (nothing done)
    where it does not apply: numba-cuda missing, another dtype or device, a non-contiguous
    tensor."""
    dtype = _KERNEL_DTYPES.get(flat.dtype)
    if dtype is None or not all(
        t.dtype == flat.dtype and t.device == flat.device and t.is_contiguous() for t in tensors
    ):
        return False
    try:
        from numba import cuda

        from ddlcore.kernels import cuda as kcuda
    except ImportError:
        return False
    addresses = np.fromiter((t.data_ptr() for t in tensors), np.uint64, len(tensors))
    counts = np.fromiter((t.numel() for t in tensors), np.int64, len(tensors))
    if counts.sum() > flat.numel():
        raise ValueError(f"flat holds {flat.numel()} elements, the tensors {counts.sum()}")
    with cuda.gpus[flat.device.index]:  # else Numba makes GPU 0 current on this thread
        stream = cuda.external_stream(torch.cuda.current_stream(flat.device).cuda_stream)
        move = kcuda.pack_addresses if to_flat else kcuda.unpack_addresses
        move(flat.data_ptr(), addresses, counts, dtype, stream=stream)
    return True


def pack_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``tensors`` one after another into ``flat`` (same dtype and device)."""
    if flat.is_cuda and _cuda_pack(flat, tensors, to_flat=True):
        return
    if flat.is_cuda or not all(t.is_contiguous() for t in tensors):
        torch.cat([t.reshape(-1) for t in tensors], out=flat)  # one launch too
        return
    pack(flat.data_ptr(), *_ranges(tensors))


def unpack_from(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """The inverse of `pack_into`: write consecutive pieces of ``flat`` into ``tensors``."""
    if flat.is_cuda and _cuda_pack(flat, tensors, to_flat=False):
        return
    if flat.is_cuda or not all(t.is_contiguous() for t in tensors):
        for t, piece in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            t.copy_(piece.view_as(t))
        return
    unpack(flat.data_ptr(), *_ranges(tensors))


def check_same_layout(
    comm: Communicator, entries: list[tuple[str, torch.Tensor]], what: str
) -> None:
    """Every rank has the same tensors (names, shapes, dtypes, in order), or every rank raises
    `CollectiveMismatchError` naming the first rank that differs from rank 0."""
    layout = ";".join(f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in entries)
    mine = np.array(
        [len(entries), sum(t.numel() for _, t in entries), zlib.crc32(layout.encode())], np.int64
    )
    every = comm.allgather(mine).reshape(comm.size, 3)
    for rank in range(1, comm.size):
        if not np.array_equal(every[rank], every[0]):
            raise CollectiveMismatchError(
                f"{what}: rank {rank} has {every[rank][0]} tensors with {every[rank][1]} "
                f"elements, rank 0 has {every[0][0]} with {every[0][1]}"
                + (
                    " (same counts, different shapes, dtypes or names)"
                    if np.array_equal(every[rank][:2], every[0][:2])
                    else ""
                )
                + "; build the same model on every rank"
            )
