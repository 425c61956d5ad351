"""What the device engine asks of a GPU (`DeviceOps`: streams, events, copies, kernels; a
`DeviceRegion` is a device buffer as it sees one) and the pinned and device slots it reuses
from call to call (`DeviceSlots`). `ddlcore.device.NumbaStreams` implements the ops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ddlcore.kernels.dtypes import DType
from ddlcore.ops import Op
from ddlcore.transports.base import DeviceView


@dataclass
class DeviceRegion:
    """A device buffer as the engine sees it: base address and a flat uint8 device array."""

    ptr: int
    array: Any


class DeviceOps(Protocol):
    """Streams, events, copies and kernels: everything the engine asks of the device."""

    compute: Any
    d2h: Any
    h2d: Any
    concurrent: bool  # whether a schedule's streams may run on threads of their own

    def sibling(self) -> DeviceOps:
        """Ops on the same device with three streams of their own."""
        ...

    def bound(self) -> Any:
        """A context manager that makes this device current on the calling thread."""
        ...

    def record(self, stream: Any) -> Any: ...
    def wait(self, stream: Any, event: Any) -> None: ...
    def done(self, event: Any) -> bool: ...
    def sync(self, event: Any, timeout: float) -> None: ...
    def download(self, src: DeviceRegion, off: int, host: np.ndarray, stream: Any) -> None: ...
    def upload(self, host: np.ndarray, dst: DeviceRegion, off: int, stream: Any) -> None: ...
    def copy(
        self,
        dst: DeviceRegion,
        dst_off: int,
        src: DeviceRegion,
        src_off: int,
        nbytes: int,
        stream: Any,
    ) -> None: ...
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
    ) -> None: ...
    def scale(
        self, dst: DeviceRegion, off: int, count: int, code: DType, divisor: int, stream: Any
    ) -> None: ...
    def pinned(self, nbytes: int) -> np.ndarray: ...
    def device(self, nbytes: int) -> DeviceRegion: ...
    def view(self, region: DeviceRegion, off: int, nbytes: int) -> DeviceView: ...


class DeviceSlots:
    """Pinned send slots, pinned receive slots and device staging slots, allocated once per
    communicator and reused by every collective (grown when a larger message comes along)."""

    def __init__(self, ops: DeviceOps) -> None:
        self.ops = ops
        self.nbytes = 0
        self.send: list[np.ndarray] = []
        self.recv: list[np.ndarray] = []
        self.staged: list[DeviceRegion] = []
        self._scratch: DeviceRegion | None = None
        self._scratch_bytes = 0
        self._streams: dict[int, DeviceSlots] = {}

    def for_stream(self, stream: int) -> DeviceSlots:
        """The slots, and streams, of a further stream of a schedule with parts."""
        found = self._streams.get(stream)
        if found is None:
            found = self._streams[stream] = DeviceSlots(self.ops.sibling())
        return found

    def ensure(self, nslots: int, nbytes: int) -> None:
        if len(self.recv) >= nslots and self.nbytes >= nbytes:
            return
        nslots = max(nslots, len(self.recv))
        self.nbytes = size = max(nbytes, self.nbytes, 64)
        self.send = [self.ops.pinned(size) for _ in range(max(nslots, len(self.send)))]
        self.recv = [self.ops.pinned(size) for _ in range(nslots)]
        self.staged = [self.ops.device(size) for _ in range(nslots)]

    def another_send_slot(self) -> int:
        """A new pinned send slot (kept for later collectives); its index."""
        self.send.append(self.ops.pinned(self.nbytes))
        return len(self.send) - 1

    def scratch(self, nbytes: int) -> DeviceRegion:
        if self._scratch is None or self._scratch_bytes < nbytes:
            self._scratch, self._scratch_bytes = self.ops.device(max(nbytes, 64)), nbytes
        return self._scratch
