"""`TcpContext`, this rank's listener (handshakes served concurrently) and pairs, and
`TcpTransport`, the backend.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from ddlcore.transports.base import (
    Context,
    PeerInfo,
    Store,
    Transport,
    TransportOptions,
    options_or_default,
)
from ddlcore.transports.common import job_key_of
from ddlcore.transports.pairs import PairTableContext
from ddlcore.transports.sockets import (
    HandshakeListener,
    format_address,
    rail_address,
    rail_interfaces,
    route_address,
)
from ddlcore.transports.tcp import steps
from ddlcore.transports.tcp.pair import TcpPair
from ddlcore.transports.tcp.protocol import (
    _ACK,
    _ACK_CLOSED,
    _ACK_NCHANNELS,
    _ACK_OK,
    _ACK_WRONG_PEER,
    _CLAIM_EXTRA,
    _CLOSE_TIMEOUT_S,
    _HANDSHAKE_TIMEOUT_S,
    _MAGIC,
    _MAX_PENDING,
    _MAX_PENDING_PER_SOURCE,
    PROTOCOL_VERSION,
)

from ddlcore.errors import RendezvousError
from ddlcore.security.claims import TCP, Claim


class TcpContext(PairTableContext):
    """This rank's listener, accept thread and pairs."""

    _label = "TCP"

    def __init__(
        self,
        rank: int,
        size: int,
        store: Store,
        timeout: float,
        local_rank: int = 0,
        *,
        options: TransportOptions | None = None,
    ) -> None:
        """``local_rank`` counts only without ``options`` (which then are the process
        environment's)."""
        if options is None:
            options = TransportOptions.from_environ(local_rank=local_rank)
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank} must be in [0, size={size})")
        self.rank, self.size, self.timeout, self.store = rank, size, float(timeout), store
        self.nchannels = options.nchannels
        if not 0 < self.nchannels <= 0xFFFF:
            raise ValueError(f"DDL_NCHANNELS={self.nchannels} is not in [1, 65535]")
        # Several interfaces: local rank i's rail is the (i mod A)-th; it listens on and
        # publishes that address, so peers reach it through that adapter.
        address = rail_address(options.socket_ifname, rank, options.local_rank)
        if address is not None:
            self.address = address
        else:
            master = getattr(store, "host", None)
            self.address = (
                route_address(master) if master else socket.gethostbyname(socket.gethostname())
            )
        self.key = job_key_of(store, "TCP")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._init_pairs()
        self._closed = False
        self.step_lanes: dict[int, Any] = {}  # `steps.run_steps`: the sockets of a step table
        self._handshakes: HandshakeListener | None = None
        try:
            listener.bind((self.address, 0))
            listener.listen(max(128, size * self.nchannels))
            self.port: int = listener.getsockname()[1]
            self._handshakes = HandshakeListener(
                listener,
                self._handshake,
                f"ddl-tcp-{rank}",
                min(self.timeout, _HANDSHAKE_TIMEOUT_S),
                _MAX_PENDING,
                _MAX_PENDING_PER_SOURCE,
            )
            store.set(f"tcp/addr/{rank}", format_address(self.address, self.port).encode())
        except BaseException:
            if self._handshakes is not None:
                self._handshakes.close(_CLOSE_TIMEOUT_S)
            else:
                listener.close()
            raise

    def refusals(self) -> str:
        """How many connections this rank's listener refused and why the last (or "")."""
        return self._handshakes.refusals() if self._handshakes is not None else ""

    def _handshake(self, conn: socket.socket, address: tuple, deadline: float) -> bool:
        """A connection's handshake (on its own thread): its proof of the job's key and claim,
        then our answer. True: the socket now belongs to a pair."""
        claim = self.key.accept(conn, deadline, TCP, check=self._check_claim)
        version, nch, index = _CLAIM_EXTRA.unpack(claim.extra)
        src = claim.src
        assert self._handshakes is not None
        if not self._handshakes.adopt(conn):  # dropped meanwhile (a cap, or close)
            return False
        status = _ACK_OK
        if self._closed:
            status = _ACK_CLOSED
        elif version != PROTOCOL_VERSION or not 0 <= src < self.rank:
            status = _ACK_WRONG_PEER
        elif nch != self.nchannels or index >= nch:
            status = _ACK_NCHANNELS
        if status != _ACK_OK:
            conn.sendall(_ACK.pack(_MAGIC, PROTOCOL_VERSION, status, self.nchannels, 0))
            if status == _ACK_NCHANNELS and not self._closed:
                self._pair_for(src)._fail_pair(
                    RendezvousError(
                        f"rank {src} has DDL_NCHANNELS={nch} but rank {self.rank} has "
                        f"DDL_NCHANNELS={self.nchannels}; set the same value on every rank"
                    )
                )
            return False
        return self._pair_for(src)._accept(index, conn) == _ACK_OK

    def _check_claim(self, claim: Claim) -> str | None:
        """Before any proof: a claim for this rank of this world, with TCP's fields."""
        if len(claim.extra) != _CLAIM_EXTRA.size:
            return f"a TCP claim with {len(claim.extra)} bytes of fields, not {_CLAIM_EXTRA.size}"
        job_id = self.key.job_id
        if job_id is not None and claim.job_id != job_id:
            return (
                "the connector is not of this start of the job (its claim carries job id "
                f"{claim.job_id.hex()[:12]}, this job's is {job_id.hex()[:12]})"
            )
        if claim.dst != self.rank or claim.size != self.size:
            return (
                f"this is rank {self.rank} of {self.size}; the claim is for rank {claim.dst} "
                f"of {claim.size}"
            )
        return None

    # `Context.run_steps`: small messages natively over the leased sockets.
    run_steps = steps.run_steps

    def _new_pair(self, peer: int) -> TcpPair:
        return TcpPair(self, peer)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._handshakes is not None:
            self._handshakes.close(_CLOSE_TIMEOUT_S)
        with self._lock:
            pairs = list(self._pairs.values())
        for p in pairs:  # all CLOSE frames first, then wait for all peers together
            p._begin_close()
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        for p in pairs:
            p._finish_close(deadline)


class TcpTransport(Transport):
    """Sockets over any IPv4 network; always available (on Linux, as the rest of ddlcore)."""

    name = "tcp"

    @classmethod
    def rails(cls, options: TransportOptions) -> int:
        """One per interface ``DDL_SOCKET_IFNAME`` lists (``options.socket_ifname``)."""
        return max(1, len(rail_interfaces(options.socket_ifname)))

    @classmethod
    def is_available(cls, options: TransportOptions | None = None) -> tuple[bool, str]:
        return True, ""

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
        return TcpContext(rank, size, store, timeout, options=options_or_default(options))
