"""Buffer intake: any array a user hands us becomes one `BufferDesc` (the paper's "DDL object").

A descriptor is a pointer, a byte count, an element type, a memory kind (host or cuda) and a
device id, plus the object that owns the memory (kept alive while we use it) and a way to build a
result of the same kind. Layers below this one see descriptors only, never NumPy or a framework.

Accepted: NumPy arrays (including ml_dtypes bfloat16, and bool, whose bytes reduce as uint8:
``ddlcore.kernels.dtypes``), objects exporting the buffer protocol,
host objects exporting DLPack (e.g. PyTorch CPU tensors), and CUDA device memory through
``__cuda_array_interface__`` (CuPy, Numba device arrays, PyTorch CUDA tensors; see ``device``).
Results come back as the same kind of object on the same device.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from ddlcore import device
from ddlcore.kernels.cpu import array_address
from ddlcore.kernels.dtypes import ACCEPTED_DTYPES, BOOL_CODE, DType, dtype_code


class MemoryKind(str, enum.Enum):
    HOST = "host"
    CUDA = "cuda"


@dataclass(slots=True)
class BufferDesc:
    """One contiguous buffer as the engine sees it (treat as immutable; not frozen because
    frozen dataclasses cost microseconds to build, and one is built per buffer per call)."""

    ptr: int
    nbytes: int
    count: int
    dtype: np.dtype
    code: DType
    shape: tuple[int, ...]
    memory: MemoryKind = MemoryKind.HOST
    device: int = -1
    readonly: bool = False
    array: Any = field(default=None, repr=False, compare=False)  # host view as a NumPy array
    wrap: Callable[[np.ndarray], Any] = field(default=lambda a: a, repr=False, compare=False)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def logical(self) -> bool:
        """A bool buffer: ``code`` is UINT8 (what its bytes reduce as), its ops `ops.logical`."""
        return self.dtype.kind == "b"

    @property
    def check_code(self) -> int:
        """The dtype's code where ranks compare calls: ``code``, or `BOOL_CODE` for bool (which
        the kernels reduce as uint8, but which must not pass for uint8)."""
        return BOOL_CODE if self.dtype.kind == "b" else int(self.code)

    def view(self, start: int = 0, stop: int | None = None) -> memoryview:
        """A writable byte view of elements [start, stop) of a host buffer."""
        stop = self.count if stop is None else stop
        flat = self.array.reshape(-1).view(np.uint8)
        return memoryview(flat[start * self.itemsize : stop * self.itemsize])


def _dtype_name(dtype: np.dtype) -> str:
    return str(dtype)


def _from_numpy(arr: np.ndarray, argname: str, wrap: Callable[[np.ndarray], Any]) -> BufferDesc:
    code = dtype_code(arr.dtype)
    if code is None:
        names = ", ".join(_dtype_name(d) for d in ACCEPTED_DTYPES)
        raise TypeError(
            f"{argname} has dtype {arr.dtype}, which ddlcore cannot reduce; supported: {names}"
        )
    if not arr.flags.c_contiguous:
        raise ValueError(
            f"{argname} is not C-contiguous (strides {arr.strides}); "
            f"pass np.ascontiguousarray({argname})"
        )
    return BufferDesc(
        ptr=array_address(arr) if arr.size else 0,
        nbytes=arr.nbytes,
        count=arr.size,
        dtype=arr.dtype,
        code=code,
        shape=arr.shape,
        readonly=not arr.flags.writeable,
        array=arr,
        wrap=wrap,
    )


def _from_device(obj: Any, argname: str) -> BufferDesc:
    try:
        nb = device.numba_view(obj)
    except ImportError:
        raise TypeError(
            f"{argname} is a CUDA array; the GPU path needs numba-cuda "
            "(pip install 'ddlcore[cuda]')"
        ) from None
    except Exception as exc:  # numba's CudaSupportError and friends: no driver, no device
        raise TypeError(
            f"{argname} is a CUDA array but CUDA is not usable in this process: {exc}"
        ) from None
    # a PyTorch bfloat16 tensor arrives as its int16 bits (Numba has no bfloat16 arrays)
    dtype = np.dtype(ml_dtypes.bfloat16) if device.torch_bfloat16(obj) else np.dtype(nb.dtype)
    code = dtype_code(dtype)
    if code is None:
        names = ", ".join(_dtype_name(d) for d in ACCEPTED_DTYPES)
        raise TypeError(
            f"{argname} has dtype {dtype}, which ddlcore cannot reduce; supported: {names}"
        )
    if not nb.is_c_contiguous():
        raise ValueError(f"{argname} is not C-contiguous; make a contiguous copy on the device")
    shape = tuple(int(s) for s in nb.shape)
    count = int(np.prod(shape, dtype=np.int64))
    return BufferDesc(
        ptr=device.pointer_of(nb),
        nbytes=count * dtype.itemsize,
        count=count,
        dtype=dtype,
        code=code,
        shape=shape,
        memory=MemoryKind.CUDA,
        device=device.device_of(obj),
        array=nb,
        wrap=device.result_wrapper(obj),
    )


def _torch_wrap(arr: np.ndarray) -> Any:
    import torch

    if arr.dtype.kind == "V":  # bfloat16: DLPack has no code for it, share the bits as int16
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _torch_host_view(obj: Any) -> np.ndarray | None:
    """A NumPy view of a PyTorch CPU tensor: ``obj.numpy()`` (a third of the cost of DLPack
    plus the CUDA-interface probe, per call), or for bfloat16, which NumPy's DLPack import
    refuses, its bits as int16 viewed as ml_dtypes' bfloat16. None for anything else, which
    takes the general route (CUDA, a tensor that requires grad: that route names the problem)."""
    torch = sys.modules["torch"]  # imported: obj is one of its objects
    if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
        return None
    if obj.dtype == torch.bfloat16:
        from ml_dtypes import bfloat16

        return np.from_dlpack(obj.detach().view(torch.int16)).view(bfloat16)
    try:
        return obj.numpy()  # type: ignore[no-any-return]
    except (RuntimeError, TypeError):
        return None


def as_buffer(obj: Any, argname: str = "x") -> BufferDesc:
    """Describe ``obj`` as a `BufferDesc`, without copying.

    Raises
    ------
    TypeError
        ``obj`` is not an array, or its dtype is unsupported; the message names ``argname``.
    ValueError
        ``obj`` is not contiguous.
    """
    if isinstance(obj, np.ndarray):
        return _from_numpy(obj, argname, lambda a: a)
    if type(obj).__module__.startswith("torch") and (arr := _torch_host_view(obj)) is not None:
        return _from_numpy(arr, argname, _torch_wrap)
    if device.is_device_array(obj):
        return _from_device(obj, argname)
    if hasattr(obj, "__dlpack__"):
        module = type(obj).__module__.split(".")[0]
        try:
            arr = np.from_dlpack(obj)
        except (BufferError, TypeError, RuntimeError) as exc:
            raise TypeError(
                f"{argname} ({type(obj).__name__}) exports DLPack but not host memory "
                f"NumPy can view: {exc}"
            ) from None
        return _from_numpy(arr, argname, _torch_wrap if module == "torch" else (lambda a: a))
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"{argname} must be an array (NumPy, buffer protocol or DLPack), "
            f"not {type(obj).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError(f"{argname} is not C-contiguous")
    return _from_numpy(np.asarray(view), argname, lambda a: a)


def empty_like(desc: BufferDesc, shape: tuple[int, ...] | None = None) -> BufferDesc:
    """A new buffer of the same kind, device and dtype as ``desc`` (host: a NumPy array)."""
    shape = desc.shape if shape is None else shape
    if desc.memory == MemoryKind.CUDA:
        with device.on_device(desc.device):  # the input's GPU, whichever is current here
            nb = device.empty(shape, desc.dtype)
        count = int(np.prod(shape, dtype=np.int64))
        return BufferDesc(
            ptr=device.pointer_of(nb),
            nbytes=count * desc.itemsize,
            count=count,
            dtype=desc.dtype,
            code=desc.code,
            shape=tuple(shape),
            memory=MemoryKind.CUDA,
            device=desc.device,
            array=nb,
            wrap=desc.wrap,
        )
    arr = np.empty(shape, dtype=desc.dtype)
    return _from_numpy(arr, "out", desc.wrap)
