"""Device (CUDA) buffers: intake, allocation of results of the same kind, and host staging.

Imported only when a caller passes device memory, and it imports ``numba.cuda`` lazily, so a
CPU-only user never pays for CUDA. Anything with ``__cuda_array_interface__`` (CuPy, Numba device
arrays, PyTorch CUDA tensors) is accepted, and so are the device arrays of Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``), which is how the test suite runs this path without a GPU.

Data path today: the input is copied to a pinned host buffer, the host schedule runs, and the
result is copied back to the device; copies are ordered after the work already queued on the
producer's stream (the interface's ``stream`` entry, which Numba honours). The chunk-pipelined
path on CUDA streams (device-to-host, network, host-to-device and reduce kernels overlapping) is
the next step and replaces `DeviceStaging` without changing the layers above.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_SIM_MODULE = "numba.cuda.simulator.cudadrv.devicearray"


def is_device_array(obj: Any) -> bool:
    return hasattr(obj, "__cuda_array_interface__") or type(obj).__module__ == _SIM_MODULE


def _cuda():
    from numba import cuda

    return cuda


def cuda_usable() -> bool:
    """Whether Numba can reach a GPU (or its simulator) from this process."""
    try:
        return bool(_cuda().is_available())
    except Exception:
        return False


def numba_view(obj: Any) -> Any:
    """A Numba device array viewing ``obj``'s memory (the object itself for simulator arrays)."""
    if type(obj).__module__ == _SIM_MODULE or type(obj).__module__.startswith("numba"):
        return obj
    return _cuda().as_cuda_array(obj)


def device_of(obj: Any) -> int:
    dev = getattr(obj, "device", None)
    for attr in ("index", "id"):  # torch.device.index, cupy Device.id
        value = getattr(dev, attr, None)
        if isinstance(value, int):
            return value
    try:
        return int(_cuda().get_current_device().id)
    except Exception:  # simulator or no context yet
        return 0


def pointer_of(obj: Any) -> int:
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0])
    return int(obj._ary.ctypes.data) if hasattr(obj, "_ary") else 0


def result_wrapper(obj: Any):
    """Turns a Numba device array into the caller's kind of object (torch, CuPy or Numba)."""
    module = type(obj).__module__.split(".")[0]
    if module == "torch":
        import torch

        device = obj.device
        return lambda nb: torch.as_tensor(nb, device=device)
    if module == "cupy":
        import cupy

        return lambda nb: cupy.asarray(nb)
    return lambda nb: nb


def empty(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    return _cuda().device_array(shape, dtype=dtype)


class DeviceStaging:
    """Pinned host buffers, reused across collectives, that device data passes through."""

    def __init__(self) -> None:
        self._pinned: dict[str, np.ndarray] = {}

    def host(self, role: str, nbytes: int) -> np.ndarray:
        buf = self._pinned.get(role)
        if buf is None or buf.nbytes < nbytes:
            buf = _cuda().pinned_array(max(nbytes, 64), dtype=np.uint8)
            self._pinned[role] = buf
        return buf[:nbytes]

    def download(self, nb: Any, role: str, dtype: np.dtype, count: int) -> np.ndarray:
        """Copy device array ``nb`` into the pinned buffer ``role``; returns the host array."""
        host = self.host(role, count * dtype.itemsize).view(dtype)
        if count:
            nb.reshape(count).copy_to_host(host)
        return host

    @staticmethod
    def upload(host: np.ndarray, nb: Any) -> None:
        if host.size:
            nb.reshape(host.size).copy_to_device(host)
