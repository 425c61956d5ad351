"""MPI transport (mpi4py): tag-matched non-blocking messages through MPI_Isend / MPI_Irecv.

Available when the job was started by an MPI launcher (``mpiexec`` from the mpich wheel, Open
MPI's, srun with PMI) and mpi4py imports. Errors are returned, never fatal: the transport's
communicators use ``MPI.ERRORS_RETURN``, and every MPI error becomes a `DDLError` naming the peer.

* Two duplicates of ``MPI_COMM_WORLD``: one for data, one for control (abort notices), so no tag
  of ours can collide with another library's, or data with control.
* ddlcore ranks are mapped to MPI ranks through the store (normally the identity).
* Our 64-bit tags (sequence number << 32 | slot) are folded into MPI's tag space (2^29 values
  with MPICH, ``MPI_TAG_UB`` in general): the low bits of the sequence number above the low 20
  bits of the slot. MPI keeps messages with equal (source, tag, communicator) in order, ranks are
  never hundreds of collectives apart, and a collective has far fewer than 2^20 chunks per pair,
  so two messages in flight never share a folded tag.
* Tags whose upper half starts with three one bits (`ddlcore.p2p`'s send/recv) go over a third
  duplicate, folded as ``(upper half's low 28 bits << 1 | slot)``: point-to-point messages
  never share a folded tag with a collective's.
* Sends above MPI's eager limit complete only once the receiver has posted its receive (MPI's
  rendezvous protocol); the engine never waits on such a send before posting its own receives.
* MPI messages carry no check word: size mismatches are caught (a short message by its count,
  a long one by MPI's truncation error); DDL_DEBUG's agreement check catches the rest.
* Waits poll ``MPI_Test`` with a deadline (MPI_Wait has none), so no wait can hang.
* A closed context's communicators are freed only once every rank has closed that context,
  one newer context later, and after receives are posted for whatever a peer sent on them that
  nobody received: MPI reuses a freed communicator's context id, and such a message would
  otherwise be received by the next communicator's matching receive.
* MPI must run at ``MPI_THREAD_MULTIPLE`` (mpi4py's default request): collectives run on the
  communicator's worker and pipeline threads, and an abort can be sent from one thread while
  another waits. A lower level makes the transport unavailable, with the reason.
* Device memory: when the MPI library says it is CUDA-aware (``MPIX_Query_cuda_support``,
  which MPICH and Open MPI both export) or ``DDL_GPU_DIRECT=on``, pairs take `DeviceView`s and
  hand the device pointer to MPI (mpi4py reads ``__cuda_array_interface__``); otherwise the
  device engine stages GPU buffers through pinned host memory above this layer.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass
from typing import Any

from ddlcore.transports.base import (
    ABORT_MISMATCH,
    ABORT_TIMEOUT,
    MAX_ABORT_REASON_BYTES,
    Context,
    DeviceView,
    Pair,
    PeerInfo,
    Request,
    Store,
    Transport,
    TransportOptions,
    options_or_default,
)
from ddlcore.transports.common import abort_error, loaded_libraries

from ddlcore.errors import (
    CollectiveMismatchError,
    CommunicatorClosedError,
    DDLError,
    DDLTimeoutError,
    PeerFailureError,
)

_SLOT_BITS = 20
_P2P_SHIFT, _P2P_SPACE = 29, 0b111  # `ddlcore.p2p`'s tags: the upper half's top three bits
_ERROR_CLASS = {ABORT_MISMATCH: CollectiveMismatchError, ABORT_TIMEOUT: DDLTimeoutError}
_ABORT_TAG = 1


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


_THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")


def thread_level_problem() -> str | None:
    """Why MPI's thread level is too low for this transport, or None when it is
    ``MPI_THREAD_MULTIPLE`` (or will be: mpi4py has not initialised MPI yet and will ask for it).
    Never initialises MPI itself."""
    import sys

    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        provided = int(mpi.Query_thread())
        if provided >= mpi.THREAD_MULTIPLE:
            return None
        levels = [mpi.THREAD_SINGLE, mpi.THREAD_FUNNELED, mpi.THREAD_SERIALIZED]
        level = _THREAD_LEVELS[levels.index(provided)] if provided in levels else str(provided)
        how = f"MPI was initialised at MPI_THREAD_{level.upper()}"
    else:  # a first opinion: the MPI_Init to come may still grant less (asked again after it)
        import mpi4py

        rc = mpi4py.rc
        threads = getattr(rc, "threads", True)
        level = str(getattr(rc, "thread_level", "multiple"))
        if str(threads).lower() not in ("false", "no", "n", "off", "0") and level == "multiple":
            return None
        how = f"mpi4py.rc asks MPI for threads={threads!r}, thread_level={level!r}"
    return (
        f"{how}; ddlcore calls MPI from its own threads and needs MPI_THREAD_MULTIPLE "
        "(leave mpi4py.rc.threads and thread_level, and MPI4PY_RC_THREADS and "
        "MPI4PY_RC_THREAD_LEVEL, at their defaults; with an MPI library that grants less, "
        "pick another transport: DDL_TRANSPORT=tcp)"
    )


def cuda_aware() -> bool:
    """Whether the MPI library in this process reports CUDA support at run time.

    mpi4py (4.1) has no wrapper for it, so ``MPIX_Query_cuda_support`` (MPICH and Open MPI) is
    looked up in the MPI library mpi4py loaded (privately: it is not in the process's global
    symbols). A library without the function is taken as not CUDA-aware.
    """
    _mpi()
    for path in loaded_libraries("/libmpi"):
        if ".so" not in path:
            continue
        try:
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        except OSError:
            continue
        if query is not None:
            return bool(query())
    return False


def _as_buffer(view: Any, receive: bool) -> Any:
    """What mpi4py is given for ``view``: a flat byte memoryview, or a `DeviceView` as is."""
    if isinstance(view, DeviceView):
        return view
    if type(view) is not memoryview:
        view = memoryview(view)
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if receive and view.readonly and view.nbytes:
        raise ValueError("view must be writable to receive into it")
    return view


class MpiRequest(Request):
    __slots__ = ("_req", "_pair", "tag", "nbytes", "is_send", "_done", "_status")

    def __init__(self, req: Any, pair: MpiPair, tag: int, nbytes: int, is_send: bool) -> None:
        self._req, self._pair, self.tag, self.nbytes, self.is_send = req, pair, tag, nbytes, is_send
        self._done = False
        self._status = _mpi().Status()

    def _poll(self) -> bool:
        if self._done:
            return True
        if self._req is None:  # made after the context failed
            raise self._pair.context.failure or PeerFailureError("MPI context failed")
        MPI = _mpi()
        try:
            finished = self._req.Test(self._status)
        except MPI.Exception as exc:
            self._pair.context.receiving.pop(id(self), None)
            raise self._pair._error(exc, self) from None
        if finished:
            self._done = True
            if not self.is_send:
                self._pair.context.receiving.pop(id(self), None)
                got = self._status.Get_count(MPI.BYTE)
                if got != self.nbytes:
                    p = self._pair
                    raise CollectiveMismatchError(
                        f"rank {p.peer} sent {got} bytes for tag {self.tag:#x}, rank {p.rank} "
                        f"expected {self.nbytes}: the ranks are calling different collectives, "
                        "or the same one with a different size"
                    )
        return finished

    def test(self) -> bool:
        self._pair.context.check_aborts()
        return self._poll()

    def wait(self, timeout: float | None = None) -> None:
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        pause = 0.0
        while not self.test():
            if deadline is not None and time.monotonic() >= deadline:
                what = "send of" if self.is_send else "a message of"
                p = self._pair
                raise DDLTimeoutError(
                    f"rank {p.rank} waited {timeout:.1f} s for {what} {self.nbytes} bytes with tag "
                    f"{self.tag:#x} {'to' if self.is_send else 'from'} rank {p.peer} (MPI)"
                )
            # Spin for the first 100 µs (small messages arrive within it), then back off up to
            # 1 ms so the other ranks on this host get the CPU during long waits.
            if time.monotonic() - start > 1e-4:
                time.sleep(pause)
                pause = min(max(pause * 2, 1e-5), 1e-3)


class MpiPair(Pair):
    def __init__(self, context: MpiContext, peer: int, mpi_peer: int) -> None:
        self.context, self.rank, self.peer, self.mpi_peer = context, context.rank, peer, mpi_peer
        self.device_memory = context.device_memory

    def _mpi_tag(self, tag: int, check: int) -> tuple[Any, int]:
        """The MPI communicator and MPI tag of ``tag`` (see the module docstring)."""
        if not (0 <= tag < 1 << 64 and 0 <= check < 1 << 32):
            raise ValueError(f"tag={tag} must be in [0, 2**64) and check={check} in [0, 2**32)")
        slot, seq = tag & 0xFFFFFFFF, tag >> 32
        if seq >> _P2P_SHIFT == _P2P_SPACE:
            folded = ((seq & ((1 << _P2P_SHIFT) - 1)) << 1) | (slot & 1)
            return self.context.p2p, folded % (self.context.tag_ub + 1)
        folded = (seq << _SLOT_BITS) | (slot & ((1 << _SLOT_BITS) - 1))
        return self.context.data, folded % (self.context.tag_ub + 1)

    def _error(self, exc: Any, req: MpiRequest | None = None) -> DDLError:
        text = exc.Get_error_string() if hasattr(exc, "Get_error_string") else str(exc)
        if "truncat" in text.lower() and req is not None:
            return CollectiveMismatchError(
                f"rank {self.peer} sent more than the {req.nbytes} bytes rank {self.rank} expected "
                f"for tag {req.tag:#x} (MPI: {text})"
            )
        return PeerFailureError(f"MPI error talking to rank {self.peer}: {text}", self.peer)

    def _device_check(self, view: Any) -> None:
        if isinstance(view, DeviceView) and not self.device_memory:
            raise ValueError(
                f"rank {self.rank}: this MPI library is not CUDA-aware "
                "(MPIX_Query_cuda_support says no); device memory must be staged "
                "through host memory (DDL_GPU_DIRECT=off/auto does that)"
            )

    def isend(self, view: memoryview, tag: int, check: int = 0) -> Request:
        self._device_check(view)
        view = _as_buffer(view, False)
        comm, mpi_tag = self._mpi_tag(tag, check)
        if self.context.failure is not None:  # after an abort: fail at wait(), like any request
            return MpiRequest(None, self, tag, len(view), True)
        try:
            req = comm.Isend([view, _mpi().BYTE], self.mpi_peer, mpi_tag)
        except _mpi().Exception as exc:
            raise self._error(exc) from None
        return MpiRequest(req, self, tag, len(view), True)

    def irecv(self, view: memoryview, tag: int, check: int = 0) -> Request:
        self._device_check(view)
        view = _as_buffer(view, True)
        comm, mpi_tag = self._mpi_tag(tag, check)
        if self.context.failure is not None:
            return MpiRequest(None, self, tag, len(view), False)
        try:
            req = comm.Irecv([view, _mpi().BYTE], self.mpi_peer, mpi_tag)
        except _mpi().Exception as exc:
            raise self._error(exc) from None
        request = MpiRequest(req, self, tag, len(view), False)
        self.context.receiving[id(request)] = (req, view)
        return request

    def abort(self, code: int, reason: str) -> None:
        self.context.notify_abort(self.mpi_peer, code, reason)

    def close(self) -> None:
        pass  # MPI owns the connection; the context frees the communicators


# Closed contexts' communicators. MPI reuses a freed communicator's context id, and a message a
# peer sent on it that was never received (the receiver failed, or gave up) would match the next
# communicator's receive with that source and tag: a stranger's bytes in a result. So a closed
# context's communicators are freed only once every rank has closed it (a barrier each rank
# joins as it closes, polled, never waited on), one newer context later (so that what was sent
# on it has arrived), and after what is left in them is received: receives that complete when
# their senders make progress, kept with their buffers until then.
@dataclass
class _Retired:
    comms: tuple[Any, ...]
    everyone_closed: Any  # an Ibarrier request, or None: not provable, never freed


_retired: list[_Retired] = []
_leftovers: list[tuple[Any, bytearray]] = []  # receives of what the retired held
_retired_lock = threading.Lock()


def _retire(comms: tuple[Any, ...]) -> None:
    try:
        barrier = comms[0].Ibarrier() if comms else None
    except Exception:  # noqa: BLE001 - then it is never freed: a leak, not a wrong match
        barrier = None
    with _retired_lock:
        _retired.append(_Retired(comms, barrier))


def _free_retired(keep: int) -> None:
    """Free the retired communicators every rank has closed, but the ``keep`` newest, after
    posting receives for what is left in them. Never blocks."""
    MPI = _mpi()
    with _retired_lock:
        older = _retired[: max(0, len(_retired) - keep)]
        ready = [r for r in older if r.everyone_closed is not None and r.everyone_closed.Test()]
        for r in ready:
            _retired.remove(r)
        _leftovers[:] = [(req, buf) for req, buf in _leftovers if not req.Test()]
    status = MPI.Status()
    for r in ready:
        for comm in r.comms:
            try:
                while (message := comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)) is not None:
                    buf = bytearray(status.Get_count(MPI.BYTE))
                    request = message.Irecv([buf, MPI.BYTE])
                    with _retired_lock:
                        _leftovers.append((request, buf))
                comm.Free()  # freed for good once the receives above complete
            except Exception:  # noqa: BLE001 - best effort: a failed job is ending anyway
                pass


class MpiContext(Context):
    def __init__(
        self, rank: int, size: int, store: Store, timeout: float, options: TransportOptions
    ) -> None:
        MPI = _mpi()
        self.rank, self.size = rank, size
        problem = thread_level_problem()
        if problem is not None:
            raise DDLError(f"rank {rank}: the MPI transport cannot run: {problem}")
        world = MPI.COMM_WORLD
        if world.Get_size() != size:
            raise DDLError(
                f"rank {rank}: MPI_COMM_WORLD has {world.Get_size()} ranks but the job "
                f"has {size}; start every rank with one mpiexec"
            )
        comms: list[Any] = []
        try:
            for _ in range(3):
                comms.append(world.Dup())
                comms[-1].Set_errhandler(MPI.ERRORS_RETURN)
            self.data, self.ctrl, self.p2p = comms
            _free_retired(keep=1)
            self.tag_ub = int(world.Get_attr(MPI.TAG_UB))
            store.set(f"mpi/rank/{rank}", str(world.Get_rank()).encode())
            self._mpi_rank = [int(store.get(f"mpi/rank/{r}", timeout)) for r in range(size)]
        except BaseException:
            _retire(tuple(comms))
            raise
        self._pairs: dict[int, MpiPair] = {}
        self.failure: DDLError | None = None
        self._abort_buf = bytearray(8 + MAX_ABORT_REASON_BYTES)
        self._abort_status = MPI.Status()
        self._abort_req = self.ctrl.Irecv([self._abort_buf, MPI.BYTE], MPI.ANY_SOURCE, _ABORT_TAG)
        self._sent_aborts: list[Any] = []
        self._closed = False
        # Receives MPI may still write into, with their buffers kept alive: after a failure the
        # engine drops its requests, and a peer's late message must not land in freed memory
        # (it did: heap corruption after a mismatch). `close` cancels them.
        self.receiving: dict[int, tuple[Any, Any]] = {}
        self._ranks_of = {m: r for r, m in enumerate(self._mpi_rank)}
        direct = options.gpu_direct
        self.device_memory = direct == "on" or (direct == "auto" and cuda_aware())

    def pair(self, peer: int) -> Pair:
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"rank {self.rank} has no pair to rank {peer} (size {self.size})")
        if self._closed:
            raise CommunicatorClosedError(f"rank {self.rank}: the MPI context is closed")
        found = self._pairs.get(peer)
        if found is None:
            found = self._pairs[peer] = MpiPair(self, peer, self._mpi_rank[peer])
        return found

    def check_aborts(self) -> None:
        """Raise the abort a peer sent us, if one arrived."""
        if self.failure is not None:
            raise self.failure
        if self._abort_req is None or not self._abort_req.Test(self._abort_status):
            return
        self._abort_req = None
        code = int.from_bytes(self._abort_buf[:4], "little")
        length = int.from_bytes(self._abort_buf[4:8], "little")
        reason = bytes(self._abort_buf[8 : 8 + min(length, MAX_ABORT_REASON_BYTES)]).decode(
            "utf-8", "replace"
        )
        peer = self._ranks_of.get(self._abort_status.Get_source(), -1)
        self.failure = abort_error(code, peer, reason)
        raise self.failure

    def notify_abort(self, mpi_peer: int, code: int, reason: str) -> None:
        raw = reason.encode("utf-8", "replace")[:MAX_ABORT_REASON_BYTES]
        msg = code.to_bytes(4, "little") + len(raw).to_bytes(4, "little") + raw
        try:
            self._sent_aborts.append(
                (self.ctrl.Isend([msg, _mpi().BYTE], mpi_peer, _ABORT_TAG), msg)
            )
        except Exception:  # best effort: we are failing already
            pass

    def abort(self, code: int, reason: str) -> None:
        for peer in range(self.size):
            if peer != self.rank:
                self.notify_abort(self._mpi_rank[peer], code, reason)
        if self.failure is None:
            self.failure = abort_error(code, self.rank, reason)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.failure is None:  # a request made after this fails at its wait, saying so
            self.failure = CommunicatorClosedError(f"rank {self.rank}: the MPI context is closed")
        deadline = time.monotonic() + 2.0
        for req, _ in self._sent_aborts:  # let abort notices leave before freeing
            while not req.Test() and time.monotonic() < deadline:
                time.sleep(1e-3)
        if self._abort_req is not None:
            try:
                self._abort_req.Cancel()
                self._abort_req.Wait()
            except Exception:
                pass
        for req, _ in self.receiving.values():  # cancelled, or done: MPI holds no buffer after
            try:
                req.Cancel()
                req.Wait()
            except Exception:
                pass
        self.receiving.clear()
        _retire((self.data, self.ctrl, self.p2p))


class MpiTransport(Transport):
    name = "mpi"

    @classmethod
    def is_available(cls, options: TransportOptions | None = None) -> tuple[bool, str]:
        if not options_or_default(options).mpi_launched:
            return False, (
                "not launched by an MPI launcher (no PMI_RANK / OMPI_COMM_WORLD_RANK / "
                "SLURM_PROCID); start the job with mpiexec"
            )
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            return False, "mpi4py is not installed (pip install 'ddlcore[mpi]')"
        problem = thread_level_problem()
        return (False, problem) if problem is not None else (True, "")

    @classmethod
    def prepare(cls) -> None:
        _mpi()  # MPI_Init (mpi4py initialises at import), on every rank before the store

    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        return True

    def create_context(
        self,
        rank: int,
        size: int,
        store: Store,
        timeout: float,
        options: TransportOptions | None = None,
    ) -> Context:
        return MpiContext(rank, size, store, timeout, options_or_default(options))
