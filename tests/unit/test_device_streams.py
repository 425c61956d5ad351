"""Which of the caller's streams a device collective waits for (`ddlcore.device.ready_event`):
the input's producer stream through an event, without blocking; an output bound to another
stream on the host, before the call returns. The streams are stand-ins with Numba's shape
(``int()`` is the handle, ``synchronize()``); real streams need a GPU."""

from __future__ import annotations

import contextlib
import types

import pytest

from ddlcore import device

_CURRENT: list[int] = []  # the GPUs whose context the code under test entered, innermost last


class _Stream:
    def __init__(self, handle: int) -> None:
        self.handle, self.synchronized, self.on = handle, 0, None

    def __int__(self) -> int:
        return self.handle

    def synchronize(self) -> None:
        self.synchronized += 1
        self.on = _CURRENT[-1] if _CURRENT else None


class _Event:
    def __init__(self) -> None:
        self.recorded_on = None

    def record(self, stream) -> None:
        self.recorded_on = stream


@contextlib.contextmanager
def _entered(gpu: int):
    _CURRENT.append(gpu)
    try:
        yield
    finally:
        _CURRENT.pop()


@pytest.fixture
def streams(monkeypatch):
    """obj -> its producer stream (None: the legacy default stream, or unknown). An object's
    GPU is its position in the table (the input GPU 0, the output GPU 1)."""
    table: dict[int, _Stream | None] = {}
    monkeypatch.setattr(device, "producer_stream", lambda obj: table.get(id(obj)))
    monkeypatch.setattr(device, "device_of", lambda obj: list(table).index(id(obj)))
    monkeypatch.setattr(device, "on_device", _entered)
    monkeypatch.setattr(
        device, "_cuda", lambda: types.SimpleNamespace(event=lambda timing=False: _Event())
    )
    return table


def test_the_input_stream_is_waited_for_through_an_event(streams):
    x = object()
    streams[id(x)] = s = _Stream(7)
    ev = device.ready_event(x)
    assert ev.recorded_on is s and s.synchronized == 0  # the caller is not blocked


def test_the_legacy_default_stream_needs_no_event(streams):
    assert device.ready_event(object()) is None


@pytest.mark.parametrize("out_handle", [7, None])
def test_an_output_on_the_same_stream_or_the_default_one_is_not_waited_for(streams, out_handle):
    x, out = object(), object()
    streams[id(x)] = _Stream(7)
    streams[id(out)] = other = _Stream(7) if out_handle is not None else None  # another wrapper
    device.ready_event(x, out)
    assert other is None or other.synchronized == 0


@pytest.mark.parametrize("x_handle", [3, None])
def test_an_output_bound_to_another_stream_is_waited_for_on_the_host(streams, x_handle):
    x, out = object(), object()
    streams[id(x)] = _Stream(x_handle) if x_handle is not None else None
    streams[id(out)] = other = _Stream(9)
    ev = device.ready_event(x, out)
    assert other.synchronized == 1 and other.on == 1  # in the output's GPU context
    assert (ev is None) == (x_handle is None)


def test_in_place_is_one_stream(streams):
    x = object()
    streams[id(x)] = s = _Stream(9)
    device.ready_event(x, x)
    assert s.synchronized == 0
