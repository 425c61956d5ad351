"""Device (CUDA) buffers: intake, allocation of results of the same kind, the caller's stream,
and whole-buffer host staging.

Imported only when a caller passes device memory, and it imports ``numba.cuda`` lazily, so a
CPU-only user never pays for CUDA. Anything with ``__cuda_array_interface__`` (CuPy, Numba device
arrays, PyTorch CUDA tensors) is accepted, and so are the device arrays of Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``), which is how the test suite runs this path without a GPU.

Data paths: a collective that runs as a schedule goes through `ddlcore.execution.device_engine` (chunks
pipelined over CUDA streams through pinned slots). The paths through the host boards
(`ddlcore.execution.hostcoll`), which read and write host memory, stage the whole buffer instead:
`DeviceStaging` downloads the input into reused pinned memory and uploads the result. Either way
the collective first waits for the work already queued on the caller's stream (`ready_event`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import numpy as np

from ddlcore.device_ops import DeviceRegion
from ddlcore.errors import DDLTimeoutError
from ddlcore.kernels.dtypes import DType, numpy_dtype
from ddlcore.ops import Op
from ddlcore.transports.base import DeviceView

_SIM_MODULE = "numba.cuda.simulator.cudadrv.devicearray"
_SPIN_S = 1e-3  # NumbaStreams.sync polls an event this long before it sleeps between polls


def is_device_array(obj: Any) -> bool:
    if type(obj).__module__ == _SIM_MODULE:
        return True
    if torch_bfloat16(obj):  # torch before 2.5 cannot name bfloat16 in the interface (KeyError)
        return bool(obj.is_cuda)
    try:
        return hasattr(obj, "__cuda_array_interface__")
    except TypeError:  # an object whose interface property fails: not one we can read
        return False


def torch_bfloat16(obj: Any) -> bool:
    if type(obj).__module__.split(".")[0] != "torch":
        return False
    import torch

    return isinstance(obj, torch.Tensor) and obj.dtype == torch.bfloat16


def cuda_module() -> Any:
    """``numba.cuda``, imported on first use."""
    from numba import cuda

    return cuda


_cuda = cuda_module  # the short name the functions below use


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
    if torch_bfloat16(obj):  # its bits as int16: Numba has no bfloat16 arrays
        import torch

        return _cuda().as_cuda_array(obj.detach().view(torch.int16), sync=False)
    # sync=False: the collective waits for the producer's stream on the GPU (`ready_event`)
    # instead of blocking the caller here
    return _cuda().as_cuda_array(obj, sync=False)


def device_of(obj: Any) -> int:
    dev = getattr(obj, "device", None)
    for attr in ("index", "id"):  # torch.device.index, cupy Device.id
        value = getattr(dev, attr, None)
        if isinstance(value, int):
            return value
    context = getattr(getattr(obj, "gpu_data", None), "context", None)  # a Numba device array
    value = getattr(getattr(context, "device", None), "id", None)
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


def _external(ptr: int) -> Any:
    return _cuda().external_stream(ptr)


def producer_stream(obj: Any) -> Any:
    """The stream on which the caller's work on ``obj`` is queued, as a Numba stream, or None
    when that is the legacy default stream (which our streams already wait for: they are
    created blocking) or unknown (Numba's simulator: everything has happened already)."""
    module = type(obj).__module__.split(".")[0]
    if module == "torch":
        import torch

        ptr = int(torch.cuda.current_stream(obj.device).cuda_stream)
    elif module == "cupy":
        import cupy

        ptr = int(cupy.cuda.get_current_stream().ptr)
    elif module == "numba" and type(obj).__module__ != _SIM_MODULE:
        # Numba has no "current stream": the stream the array is bound to is the best we know
        stream = getattr(obj, "stream", 0)
        return stream if stream else None
    else:
        cai = getattr(obj, "__cuda_array_interface__", None) or {}
        ptr = cai.get("stream") or 0
    # 0 and 1 name the legacy default stream, which our (blocking) streams wait for already;
    # 2 names the per-thread default stream, which they do not
    if ptr in (0, 1):
        return None
    return _cuda().per_thread_default_stream() if ptr == 2 else _external(ptr)


def _same_stream(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return a is b or int(a) == int(b)  # Numba streams: int() is the handle


def ready_event(obj: Any, out: Any = None) -> Any:
    """An event recorded now on ``obj``'s producer stream (see `producer_stream`), or None.

    Called on the caller's thread when the collective is issued, so an async collective waits
    for exactly the work queued before it, without blocking the caller. An ``out`` (another
    object) whose producer stream differs from ``obj``'s (a Numba array bound to another stream,
    an interface naming another) has that stream's queued work waited for here, on the host:
    the collective's one event cannot stand for two streams, and its writes into ``out`` must
    come after the work queued there (which may still read it)."""
    stream = producer_stream(obj)
    if out is not None and out is not obj:
        other = producer_stream(out)
        if other is not None and not _same_stream(other, stream):
            with on_device(device_of(out)):
                other.synchronize()
    if stream is None:
        return None
    with on_device(device_of(obj)):
        ev = _cuda().event(timing=False)
        ev.record(stream)
    return ev


def on_device(device_id: int) -> Any:
    """A context in which Numba works on GPU ``device_id`` (its primary context): streams,
    events, allocations and kernels of a collective on that device's buffers."""
    if is_simulator():
        return contextlib.nullcontext()
    return _cuda().gpus[device_id]


def bind_thread(device_id: int) -> None:
    """Make GPU ``device_id``'s primary context current on the calling thread, for good (a
    transport's progress thread that hands device memory to UCX)."""
    if not is_simulator():
        _cuda().select_device(device_id)


def region_of(array: Any) -> Any:
    """The engine's `DeviceRegion` of a contiguous Numba device array: its base address and a
    flat uint8 view."""
    count = int(array.size)
    if count == 0:
        return DeviceRegion(0, None)
    return DeviceRegion(pointer_of(array), array.reshape(count).view(np.uint8))


def result_wrapper(obj: Any):
    """Turns a Numba device array into the caller's kind of object (torch, CuPy or Numba)."""
    module = type(obj).__module__.split(".")[0]
    if module == "torch":
        import torch

        device, dtype = obj.device, obj.dtype
        if dtype == torch.bfloat16:
            return lambda nb: torch.as_tensor(nb, device=device).view(torch.bfloat16)
        return lambda nb: torch.as_tensor(nb, device=device)
    if module == "cupy":
        import cupy

        return lambda nb: cupy.asarray(nb)
    return lambda nb: nb


def empty(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """A device array; bfloat16 is held as int16 bits where Numba cannot type it (a GPU; the
    simulator's arrays are NumPy's and take it as it is)."""
    cuda = _cuda()
    if dtype.kind == "V" and dtype.itemsize == 2 and not is_simulator():
        dtype = np.dtype(np.int16)
    return cuda.device_array(shape, dtype=dtype)


def is_simulator() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)  # type: ignore[attr-defined]


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
        if count:  # as bytes: a bfloat16 buffer's device array holds int16
            nb.reshape(count).view(np.uint8).copy_to_host(host.view(np.uint8))
        return host

    @staticmethod
    def upload(host: np.ndarray, nb: Any) -> None:
        if host.size:
            nb.reshape(host.size).view(np.uint8).copy_to_device(host.view(np.uint8))


class NumbaStreams:
    """`DeviceOps` through ``numba.cuda``: a GPU, or Numba's simulator (where streams and events
    exist but every operation completes at once)."""

    def __init__(self) -> None:
        from ddlcore.kernels import cuda as kcuda

        self._cuda = cuda = cuda_module()
        self._kernels = kcuda
        self._device = 0 if is_simulator() else int(cuda.get_current_device().id)
        self.compute, self.d2h, self.h2d = cuda.stream(), cuda.stream(), cuda.stream()
        # The simulator runs kernels by swapping module state: one thread at a time.
        self.concurrent = not is_simulator()
        self._uploads = cuda.stream()  # transports' copies of early-arrived host payloads
        try:
            cuda.event(timing=False)
            self._event: Any = lambda: cuda.event(timing=False)
        except TypeError:  # the simulator's events take no arguments
            self._event = cuda.event

    def sibling(self) -> NumbaStreams:
        with self.bound():
            return NumbaStreams()

    def bound(self) -> Any:
        return on_device(self._device)

    def record(self, stream: Any) -> Any:
        ev = self._event()
        ev.record(stream)
        return ev

    def wait(self, stream: Any, event: Any) -> None:
        event.wait(stream)

    def done(self, event: Any) -> bool:
        query = getattr(event, "query", None)  # the simulator's events have finished already
        return True if query is None else bool(query())

    def sync(self, event: Any, timeout: float) -> None:
        """Wait for ``event``, at most ``timeout`` seconds (a stuck caller's stream, say,
        must not hang the job past DDL_TIMEOUT)."""
        query = getattr(event, "query", None)
        if query is None or query():
            return
        # Spin first: a chunk's copy or kernel ends within a few hundred microseconds, and a
        # sleep of any length lasts >= ~60 us (the kernel's timer slack); sleeping with backoff
        # from the start cost 12-25% of an H100's device-engine allreduce (BENCHMARKS).
        now = time.monotonic()
        deadline, spin_until = now + timeout, now + _SPIN_S
        while time.monotonic() < spin_until:
            if query():
                return
        pause = 5e-5
        while not query():
            if time.monotonic() > deadline:
                raise DDLTimeoutError(
                    f"GPU work queued by this collective did not finish "
                    f"within {timeout:g} s (is the caller's stream stuck?)"
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def download(self, src: DeviceRegion, off: int, host: np.ndarray, stream: Any) -> None:
        if host.size:
            src.array[off : off + host.size].copy_to_host(host, stream=stream)

    def upload(self, host: np.ndarray, dst: DeviceRegion, off: int, stream: Any) -> None:
        if host.size:
            dst.array[off : off + host.size].copy_to_device(host, stream=stream)

    def copy(
        self,
        dst: DeviceRegion,
        dst_off: int,
        src: DeviceRegion,
        src_off: int,
        nbytes: int,
        stream: Any,
    ) -> None:
        if nbytes:
            dst.array[dst_off : dst_off + nbytes].copy_to_device(
                src.array[src_off : src_off + nbytes], stream=stream
            )

    @staticmethod
    def _typed(region: DeviceRegion, off: int, count: int, code: DType) -> Any:
        # Numba has no bfloat16 arrays: the kernels take its bits as uint16 (dtype="bfloat16")
        dtype = np.dtype(np.uint16) if code == DType.BFLOAT16 else numpy_dtype(code)
        return region.array[off : off + count * dtype.itemsize].view(dtype)

    @staticmethod
    def _marker(code: DType) -> dict[str, str]:
        return {"dtype": "bfloat16"} if code == DType.BFLOAT16 else {}

    def reduce(
        self,
        dst: DeviceRegion,
        dst_off: int,
        a: DeviceRegion,
        a_off: int,
        b: DeviceRegion,
        b_off: int,
        count: int,
        code: DType,
        op: Op,
        stream: Any,
    ) -> None:
        if count:
            self._kernels.reduce_copy(
                self._typed(dst, dst_off, count, code),
                self._typed(a, a_off, count, code),
                self._typed(b, b_off, count, code),
                op,
                stream,
                **self._marker(code),
            )

    def scale(
        self, dst: DeviceRegion, off: int, count: int, code: DType, divisor: int, stream: Any
    ) -> None:
        if count:
            self._kernels.avg_scale(
                self._typed(dst, off, count, code), divisor, stream, **self._marker(code)
            )

    def pinned(self, nbytes: int) -> np.ndarray:
        return self._cuda.pinned_array(nbytes, dtype=np.uint8)

    def view(self, region: DeviceRegion, off: int, nbytes: int) -> DeviceView:
        if not nbytes:
            return DeviceView(0, 0, self._device, _no_upload)
        target, gpu, stream = region.array[off : off + nbytes], self._device, self._uploads

        def upload(_: DeviceView, data: memoryview) -> None:
            # Called by a transport's thread (no current CUDA context of its own). On a stream
            # of its own: the legacy default stream would wait for all our queued work.
            with on_device(gpu):
                target.copy_to_device(np.frombuffer(data, np.uint8), stream=stream)
                stream.synchronize()

        return DeviceView(
            region.ptr + off, nbytes, gpu, upload, functools.partial(bind_thread, gpu)
        )

    def device(self, nbytes: int) -> DeviceRegion:
        arr = self._cuda.device_array(nbytes, dtype=np.uint8)
        return DeviceRegion(pointer_of(arr), arr)


def _no_upload(view: DeviceView, data: memoryview) -> None:
    raise AssertionError("nothing to upload into an empty device view")
