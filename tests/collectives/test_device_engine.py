"""The device engine's stream ordering, checked without a GPU.

`DeferredStreams` plays the GPU's part: every copy and kernel the engine queues waits in its
stream's queue and runs only when the engine asks an event (``done``/``sync``), in a random
order that respects stream order and event waits: the slowest, most reordered GPU the engine's
events allow; now and then, everything runnable runs at once (a fast GPU, which is what
overtakes a direct transport still reading a span). The data really moves at that time, so a missing event (a download before the
reduction that feeds it, a pinned slot reused before its upload ran, a write before a download
of the old value) shows up as wrong bits. Each case runs the same schedule through the host
engine and the device engine over real transports, and the outputs must be identical bit for
bit, for every algorithm, collective, dtype and op, in and out of place.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import deque

import ml_dtypes
import numpy as np
import pytest

from tests.collectives.matrix import random_input
from tests.harness import run_ranks


class _Event:
    __slots__ = ("fired", "stream")

    def __init__(self, stream: _Stream) -> None:
        self.fired = False
        self.stream = stream


class _Stream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: deque = deque()  # (fn, event it waits for or None)


def _locked(method):
    """One engine thread at a time in the deferred GPU (a schedule's streams run on several)."""

    @functools.wraps(method)
    def locked(self, *args):
        with self.lock:
            return method(self, *args)

    return locked


class DeferredStreams:
    """`DeviceOps` whose work runs late and in random valid orders (host NumPy memory plays
    device memory)."""

    concurrent = True

    def __init__(self, seed, legacy: bool = False) -> None:
        self.rng = np.random.default_rng(seed)
        # legacy: the caller's stream is CUDA's legacy default stream, which the engine's
        # (blocking) streams wait for implicitly; the engine is then given no ready event
        self.legacy = legacy
        self.compute, self.d2h, self.h2d = _Stream("compute"), _Stream("d2h"), _Stream("h2d")
        self.user = _Stream("user")  # the caller's stream, producing the input
        self.streams = [self.compute, self.d2h, self.h2d, self.user]
        self.ran = 0
        self.views = 0  # device views handed to direct transports
        self.siblings = 0
        self.lock = threading.RLock()

    def sibling(self):
        """Three more streams on the same deferred GPU (work on any stream may run whenever
        any engine thread asks an event)."""
        self.siblings += 1
        return _Sibling(self)

    def bound(self):
        return contextlib.nullcontext()

    def _enqueue(self, stream: _Stream, fn, blocker: _Event | None = None) -> None:
        stream.queue.append((fn, blocker))
        if self.rng.random() < 0.2:  # now and then a fast GPU: everything runnable runs now
            while self._step():
                pass

    def _step(self) -> bool:
        ready = [
            s
            for s in self.streams
            if s.queue
            and (s.queue[0][1] is None or s.queue[0][1].fired)
            and not (self.legacy and s is not self.user and self.user.queue)
        ]
        if not ready:
            return False
        stream = ready[int(self.rng.integers(len(ready)))]
        fn, _ = stream.queue.popleft()
        fn()
        self.ran += 1
        return True

    @_locked
    def record(self, stream: _Stream) -> _Event:
        ev = _Event(stream)
        self._enqueue(stream, functools.partial(setattr, ev, "fired", True))
        return ev

    @_locked
    def wait(self, stream: _Stream, event: _Event) -> None:
        self._enqueue(stream, _noop, event)

    @_locked
    def work_left(self) -> bool:
        """Whether a copy or kernel is still queued (waits for the caller's stream may stay on
        streams nothing synchronised since: they hold no work)."""
        return any(fn is not _noop for s in self.streams for fn, _ in s.queue)

    @_locked
    def done(self, event: _Event) -> bool:
        if self.rng.random() < 0.3:
            self._step()
        return event.fired

    @_locked
    def sync(self, event: _Event, timeout: float) -> None:
        """Run only what ``event`` needs (its stream up to it, and the events that waits on),
        or, half the time, random work until it fires."""
        lazy = self.rng.random() < 0.5
        while self.legacy and event.stream is not self.user and self.user.queue:
            fn, _ = self.user.queue.popleft()  # (holds no waits in these tests)
            fn()
            self.ran += 1
        while not event.fired:
            if not lazy:
                if not self._step():
                    raise AssertionError("an event the engine waits for can never fire")
                continue
            queue = event.stream.queue
            assert queue, "an event the engine waits for can never fire"
            fn, blocker = queue[0]
            if blocker is not None and not blocker.fired:
                self.sync(blocker, timeout)
                continue
            queue.popleft()
            fn()
            self.ran += 1

    @_locked
    def download(self, src, off, host, stream) -> None:
        self._enqueue(stream, functools.partial(_copy, host, src.array, off, host.size))

    @_locked
    def upload(self, host, dst, off, stream) -> None:
        self._enqueue(stream, functools.partial(_put, dst.array, off, host))

    @_locked
    def copy(self, dst, dst_off, src, src_off, nbytes, stream) -> None:
        self._enqueue(
            stream, functools.partial(_move, dst.array, dst_off, src.array, src_off, nbytes)
        )

    @_locked
    def reduce(self, dst, dst_off, a, a_off, b, b_off, count, code, op, stream) -> None:
        from ddlcore import kernels

        self._enqueue(
            stream,
            functools.partial(
                kernels.reduce_copy,
                dst.ptr + dst_off,
                a.ptr + a_off,
                b.ptr + b_off,
                count,
                int(code),
                int(op),
            ),
        )

    @_locked
    def scale(self, dst, off, count, code, divisor, stream) -> None:
        from ddlcore import kernels

        self._enqueue(
            stream,
            functools.partial(kernels.avg_finalize, dst.ptr + off, count, int(code), divisor),
        )

    @_locked
    def pinned(self, nbytes: int) -> np.ndarray:
        return np.full(nbytes, 0xAB, np.uint8)  # garbage, so a read before the write shows

    @_locked
    def device(self, nbytes: int):
        return _region(np.full(nbytes, 0xCD, np.uint8))

    @_locked
    def view(self, region, off, nbytes):
        """What a direct transport gets: the "device" bytes themselves. The transport reads and
        writes them on its own threads whenever it likes, as a NIC or UCX's CUDA copies would;
        only the engine's waits keep that away from queued work on the same bytes."""
        from ddlcore.transports.base import DeviceView

        self.views += 1
        return DeviceView(region.ptr + off if nbytes else 0, nbytes, 0, _upload)


class _Sibling:
    """`DeferredStreams.sibling`: its own streams, everything else the first one's."""

    def __init__(self, root: DeferredStreams) -> None:
        n = len(root.streams)
        self.compute, self.d2h, self.h2d = (_Stream(f"{k}{n}") for k in ("compute", "d2h", "h2d"))
        root.streams += [self.compute, self.d2h, self.h2d]
        self._root = root

    def __getattr__(self, name):
        return getattr(self._root, name)


def _noop():
    pass


def _upload(view, data):
    import ctypes

    ctypes.memmove(view.ptr, bytes(data), len(data))


def _copy(host, array, off, n):
    host[:] = array[off : off + n]


def _put(array, off, host):
    array[off : off + host.size] = host


def _move(dst, dst_off, src, src_off, n):
    dst[dst_off : dst_off + n] = src[src_off : src_off + n].copy()


def _region(array: np.ndarray):
    from ddlcore.kernels import array_address

    from ddlcore.device_ops import DeviceRegion

    flat = array.reshape(-1).view(np.uint8)
    return DeviceRegion(array_address(flat) if flat.size else 0, flat)


DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.float64]
COUNTS = [1, 7, 131, 1000]
OPS = ["sum", "avg", "min"]
THIN_COUNT = 131  # 64-byte chunks: 2 to 17 of them, the last one partial, for each dtype


def _cases(collective: str, thin: bool):
    """(dtype, count, op): every dtype x count x op, or (``thin``) float32 at every count and op
    and the other dtypes (sum) at a count of several chunks that ends in a partial one (each
    message costs a round trip: the largest count is most of a world's time)."""
    for dtype in DTYPES:
        for count in COUNTS:
            if thin and dtype is not np.float32 and count != THIN_COUNT:
                continue
            ops = OPS if collective in ("allreduce", "reduce_scatter") else [None]
            if thin and dtype is not np.float32:
                ops = ops[:1]
            for op in ops:
                yield dtype, count, op


def _orderings(rank, size, algos, depth, seed, thin=False):
    from ddlcore.kernels.dtypes import dtype_code

    import ddlcore
    from ddlcore import device_ops
    from ddlcore.algorithms import Buf
    from ddlcore.execution import device_engine, engine
    from ddlcore.execution.paths.schedule import make_schedule
    from ddlcore.ops import as_op
    from ddlcore.planning import tuning

    checked = 0
    seq = 1 << 20
    with ddlcore.init() as comm:
        ops = DeferredStreams([seed, rank])
        slots = device_ops.DeviceSlots(ops)
        for name in algos:
            # "mdring:4": mdring's allreduce pipelined in 4 segments (parts on several streams)
            algo, _, segments = name.partition(":")
            collectives = (
                ["allreduce"]
                if algo == "rd"
                else ["allreduce", "reduce_scatter", "allgather", "broadcast"]
            )
            for collective in collectives:
                if collective == "broadcast" and algo != "ring":
                    continue
                for dtype, count, op in _cases(collective, thin):
                    dt = np.dtype(dtype)
                    n_in = count * size if collective == "reduce_scatter" else count
                    n_out = {"reduce_scatter": count, "allgather": count * size}.get(
                        collective, count
                    )
                    x = random_input(dt, n_in, rank, seed, op or "sum")
                    # the cost model reads nccl-tests' size: an allgather's output
                    choice = tuning.choose(
                        collective,
                        comm.topology,
                        max(n_in, n_out) * dt.itemsize,
                        algo,
                        64,
                        False,
                        int(segments or 0),
                    )
                    sched = make_schedule(
                        collective,
                        choice,
                        rank,
                        size,
                        n_in,
                        dt.itemsize,
                        size - 1,
                        comm.topology,
                    )
                    rop = as_op(op) if op else None
                    places = {"allreduce": [False, True], "broadcast": [True]}.get(
                        collective, [False]
                    )
                    for in_place in places:
                        outs = []
                        for on_device in (False, True):
                            seq += 1
                            inp = x.copy()
                            out = inp if in_place else np.full(n_out, 7, dt)
                            coll = engine.Collective(
                                seq,
                                12345,
                                dt.itemsize,
                                int(dtype_code(dt)),
                                rop,
                                f"{collective} {algo}",
                            )
                            if on_device:
                                # the caller's stream writes the input late: the
                                # collective must wait for it (``ready``)
                                inp.view(np.uint8)[:] = 0xEE
                                ops._enqueue(
                                    ops.user,
                                    functools.partial(
                                        _put, inp.view(np.uint8), 0, x.view(np.uint8)
                                    ),
                                )
                                bufs = {Buf.INPUT: _region(inp), Buf.OUTPUT: _region(out)}
                                if sched.scratch_count:
                                    bufs[Buf.SCRATCH] = slots.scratch(
                                        sched.scratch_count * dt.itemsize
                                    )
                                device_engine.run(
                                    sched,
                                    coll,
                                    bufs,
                                    comm._links,
                                    slots,
                                    depth,
                                    30.0,
                                    ops.record(ops.user),
                                )
                                assert not ops.work_left(), (
                                    "work left queued after the collective returned"
                                )
                            else:
                                bufs = {
                                    Buf.INPUT: engine.Region.of(inp),
                                    Buf.OUTPUT: engine.Region.of(out),
                                }
                                if sched.scratch_count:
                                    bufs[Buf.SCRATCH] = comm._ctx.scratch_region(
                                        sched.scratch_count * dt.itemsize
                                    )
                                engine.run(
                                    sched,
                                    coll,
                                    bufs,
                                    comm._links,
                                    comm._ctx.staging,
                                    depth,
                                    30.0,
                                )
                            outs.append(out.view(np.uint8).copy())
                            if not in_place and not on_device:
                                assert np.array_equal(inp.view(np.uint8), x.view(np.uint8)), (
                                    "input written"
                                )
                        assert np.array_equal(outs[0], outs[1]), (
                            algo,
                            collective,
                            dt.name,
                            count,
                            op,
                            in_place,
                        )
                        checked += 1
        comm.barrier()
        direct = sum(bool(comm._links.pair(p).device_memory) for p in range(size) if p != rank)
    return checked, ops.ran, ops.views, direct, ops.siblings


# (ranks, box, transport, DDL_GPU_DIRECT, algorithms, pipeline depth, thin). Direct transports
# (ucx, mpi with DDL_GPU_DIRECT=on) read and write the "device" buffers on their own threads;
# "ucx+shm" is two hosts (DDL_HOST_ID): shm pairs stage within a host, ucx pairs go direct across.
# The full dtype x count x op matrix runs once, on three ranks (uneven parts, rhd folding);
# the other worlds, whose subject is their depth, box or transport, run the thin slice.
@pytest.mark.parametrize(
    "nprocs,box,transport,direct,algos,depth,thin",
    [
        pytest.param(3, "", "tcp", "off", ["ring", "rhd", "rd"], 3, False, marks=pytest.mark.slow),
        (2, "", "tcp", "off", ["ring", "rhd", "rd"], 1, True),
        (4, "2x2", "tcp", "off", ["mdring", "mdring:4", "rhd"], 2, True),
        (3, "", "ucx", "on", ["ring", "rhd", "rd"], 2, True),
        (4, "2x2", "ucx+shm", "on", ["mdring", "mdring:3", "rhd"], 3, True),
        (2, "", "mpi", "on", ["ring", "rhd"], 1, True),
    ],
)
def test_device_engine_matches_host_engine_under_reordering(
    nprocs, box, transport, direct, algos, depth, thin, pools
):
    env = {"DDL_TRANSPORT": transport, "DDL_TIMEOUT": "60", "DDL_GPU_DIRECT": direct}
    rank_envs = None
    if transport == "ucx+shm":
        env["DDL_TRANSPORT"] = "auto:ucx"
        rank_envs = {r: {"DDL_HOST_ID": f"host{r // 2}"} for r in range(nprocs)}
    if box:
        env["DDL_TOPOLOGY"] = box
    if transport == "mpi":
        results = run_ranks(
            _orderings, nprocs, algos, depth, 11, thin, env=env, timeout=280, launcher="mpiexec"
        )
    else:
        results = pools.run(
            _orderings, nprocs, algos, depth, 11, thin, env=env, timeout=280, rank_envs=rank_envs
        )
    for checked, ran, views, direct_pairs, siblings in results:
        assert checked > 100 and ran > 1000, (checked, ran)
        # the pipelined mdring's streams ran on streams of their own
        assert (siblings > 0) == any(":" in a for a in algos), siblings
        if direct == "off":
            assert views == 0 and direct_pairs == 0
        else:  # every pair direct, or (ucx+shm) those to the other host
            assert direct_pairs == (2 if transport == "ucx+shm" else nprocs - 1), direct_pairs
            assert views > 100, views


def _swaps(rank, size, seed, n):
    """Hand-made schedules with write-after-read hazards the library's algorithms do not have
    today: send a span, then receive into it (or copy over it) at once. (A direct transport
    reads a large span while the message is on the wire: UCX's rendezvous protocol.)"""
    from ddlcore.kernels.dtypes import DType

    import ddlcore
    from ddlcore import device_ops
    from ddlcore.algorithms import Buf
    from ddlcore.algorithms.schedule import Kind, Schedule, Step
    from ddlcore.execution import device_engine, engine

    peer = 1 - rank
    with ddlcore.init() as comm:
        ops = DeferredStreams([seed, rank])
        slots = device_ops.DeviceSlots(ops)
        for trial in range(40):
            mine = np.random.default_rng([seed, rank, trial]).standard_normal(n)
            theirs = np.random.default_rng([seed, peer, trial]).standard_normal(n)
            fresh = np.arange(n, dtype=np.float64) + 1000 * rank
            receive = trial % 2 == 0
            # send our output span, then overwrite it at once: with the peer's input (which
            # may have arrived already) or with a local copy of our input
            overwrite = (
                Step(Kind.RECV, peer, 1, n, dst=Buf.OUTPUT)
                if receive
                else Step(Kind.COPY, -1, 0, n, src=Buf.INPUT, dst=Buf.OUTPUT)
            )
            steps = (
                Step(Kind.SEND, peer, 1, n, src=Buf.INPUT),
                Step(Kind.SEND, peer, 0, n, src=Buf.OUTPUT),
                overwrite,
                Step(Kind.RECV, peer, 0, n, dst=Buf.SCRATCH),
            )
            sched = Schedule("swap", "hand-made", rank, 2, n, n, steps, scratch_count=n)
            out = mine.copy()
            bufs = {
                Buf.INPUT: _region(fresh),
                Buf.OUTPUT: _region(out),
                Buf.SCRATCH: slots.scratch(n * 8),
            }
            coll = engine.Collective(trial + 1, 7, 8, int(DType.FLOAT64), None, "swap")
            device_engine.run(sched, coll, bufs, comm._links, slots, 2, 30.0)
            got = slots.scratch(n * 8).array[: n * 8].view(np.float64)
            assert np.array_equal(got, theirs), f"trial {trial}: the peer's span was overwritten"
            want = np.arange(n, dtype=np.float64) + 1000 * peer if receive else fresh
            assert np.array_equal(out, want), trial
        comm.barrier()
    return True


@pytest.mark.parametrize("transport,direct,n", [("tcp", "off", 1000), ("ucx", "on", 1 << 16)])
def test_device_engine_orders_writes_after_pending_downloads(transport, direct, n, pools):
    """Staged: the overwrite waits for the download; direct: for the send reading the span."""
    pools.run(
        _swaps,
        2,
        5,
        n,
        env={"DDL_TRANSPORT": transport, "DDL_TIMEOUT": "60", "DDL_GPU_DIRECT": direct},
        timeout=120,
    )


def _legacy_stream(rank, size, seed):
    """The caller's input is written late on the legacy default stream (``ready`` is None):
    the engine's streams wait for it by CUDA's rules, a direct transport reading the input
    would not, unless the engine makes its sends wait."""
    from ddlcore.kernels.dtypes import DType

    import ddlcore
    from ddlcore import device_ops
    from ddlcore.algorithms import Buf
    from ddlcore.execution import device_engine, engine
    from ddlcore.execution.paths.schedule import make_schedule
    from ddlcore.planning import tuning

    n = 4096
    with ddlcore.init() as comm:
        ops = DeferredStreams([seed, rank], legacy=True)
        slots = device_ops.DeviceSlots(ops)
        for algo in ("ring", "rhd"):
            choice = tuning.choose("allreduce", comm.topology, n * 4, algo, 1024, False)
            sched = make_schedule("allreduce", choice, rank, size, n, 4, 0, comm.topology)
            for trial in range(10):
                x = random_input(np.float32, n, rank, trial, "sum")
                inp = np.full(n, -1e30, np.float32)  # stale until the caller's kernel runs
                out = np.zeros(n, np.float32)
                ops._enqueue(
                    ops.user, functools.partial(_put, inp.view(np.uint8), 0, x.view(np.uint8))
                )
                coll = engine.Collective(
                    2 * trial + 1 + 100 * (algo == "rhd"), 5, 4, int(DType.FLOAT32), None, algo
                )
                device_engine.run(
                    sched,
                    coll,
                    {Buf.INPUT: _region(inp), Buf.OUTPUT: _region(out)},
                    comm._links,
                    slots,
                    2,
                    30.0,
                    None,
                )
                want = np.zeros(n, np.float32)
                coll = engine.Collective(
                    2 * trial + 2 + 100 * (algo == "rhd"), 5, 4, int(DType.FLOAT32), None, algo
                )
                engine.run(
                    sched,
                    coll,
                    {Buf.INPUT: engine.Region.of(x), Buf.OUTPUT: engine.Region.of(want)},
                    comm._links,
                    comm._ctx.staging,
                    2,
                    30.0,
                )
                assert np.array_equal(out, want), (algo, trial)
        comm.barrier()
    return ops.views


@pytest.mark.parametrize("transport,direct", [("tcp", "off"), ("ucx", "on")])
def test_device_engine_waits_for_the_legacy_default_stream(transport, direct, pools):
    views = pools.run(
        _legacy_stream,
        2,
        7,
        env={"DDL_TRANSPORT": transport, "DDL_TIMEOUT": "60", "DDL_GPU_DIRECT": direct},
        timeout=120,
    )
    assert all((v > 0) == (direct == "on") for v in views), views


def _bursts(rank, size, algo):
    """More sends in a row than the engine has slots (rhd sends a whole half before it receives):
    the engine must take more slots, not wait for a send to free one."""
    from ddlcore.kernels.dtypes import DType

    import ddlcore
    from ddlcore import device_ops
    from ddlcore.algorithms import Buf
    from ddlcore.execution import device_engine, engine
    from ddlcore.execution.paths.schedule import make_schedule
    from ddlcore.planning import tuning

    count, chunk = 1 << 20, 512 << 10  # 4 MB of float32: halves of 4 chunks of 512 KiB
    with ddlcore.init() as comm:
        ops = DeferredStreams([3, rank])
        slots = device_ops.DeviceSlots(ops)
        x = random_input(np.float32, count, rank, 3, "sum")
        choice = tuning.choose("allreduce", comm.topology, count * 4, algo, chunk, False)
        sched = make_schedule("allreduce", choice, rank, size, count, 4, 0, comm.topology)
        outs = []
        for seq, on_device in ((1, False), (2, True)):
            out = np.empty_like(x)
            coll = engine.Collective(seq, 99, 4, int(DType.FLOAT32), None, "burst")
            if on_device:
                device_engine.run(
                    sched,
                    coll,
                    {Buf.INPUT: _region(x), Buf.OUTPUT: _region(out)},
                    comm._links,
                    slots,
                    2,
                    20.0,
                )
            else:
                engine.run(
                    sched,
                    coll,
                    {Buf.INPUT: engine.Region.of(x), Buf.OUTPUT: engine.Region.of(out)},
                    comm._links,
                    comm._ctx.staging,
                    2,
                    20.0,
                )
            outs.append(out)
        assert np.array_equal(outs[0].view(np.uint8), outs[1].view(np.uint8))
        comm.barrier()
    return len(slots.send)


@pytest.mark.parametrize("algo,transport", [("rhd", "shm"), ("ring", "shm"), ("rhd", "mpi")])
def test_device_engine_never_waits_for_a_send_to_free_a_slot(algo, transport, pools):
    """Over MPI a large send completes only once the peer posts the receive: waiting on one for
    its slot deadlocked rhd until DDL_TIMEOUT."""
    env = {"DDL_TRANSPORT": transport, "DDL_TIMEOUT": "30"}
    if transport == "mpi":
        nslots = run_ranks(_bursts, 2, algo, env=env, timeout=120, launcher="mpiexec")
    else:
        nslots = pools.run(_bursts, 2, algo, env=env, timeout=120)
    if algo == "rhd":
        assert min(nslots) > 2, nslots  # it took more send slots than the two it started with
