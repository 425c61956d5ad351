"""Links: which transport carries each peer pair, and the transport contexts behind them.

Every rank publishes at init which transports it can run; the choice for a pair is then made
from both ends' lists by the same rule, so both ends always agree:

* ``DDL_TRANSPORT=<name>`` forces one transport for every pair (an error if it cannot run here);
* ``auto`` takes shm for two ranks on the same host when both have it, otherwise the first
  transport in the network order (``ucx, mpi, tcp``; ``auto:ucx,tcp`` sets it) that both ends
  have and that can connect them.

Contexts of the chosen transports are created eagerly at init (they publish their addresses in
the store); pairs connect lazily on first use.

A communicator is broken by any failure, so an abort a peer tells one context of is everyone's
business: the context aborts itself (its pairs fail, its peers hear of it) and calls
``on_abort``, with which `Links` aborts the communicator's other contexts with the same code
and reason (class, origin and cause kept). Every rank passes it on once, so every rank hears of
it within a few message latencies, also those blocked on peers that never heard of it
directly.

A rank that aborts also leaves a note of it in the store, for peers whose first message to it
comes after it closed (``abort_notes``); `Links.explain` reads a gone peer's note.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ddlcore.transports as transports
from ddlcore.errors import DDLError, TransportUnavailableError
from ddlcore.job import abort_notes
from ddlcore.topology import layout
from ddlcore.transports.base import (
    Context,
    HostCollectivesFactory,
    Pair,
    PeerInfo,
    Store,
    Transport,
    TransportOptions,
)


def transport_options(environ: Mapping[str, str] | None = None) -> TransportOptions:
    """What the transports are told of the configuration (``environ``, or ``os.environ``):
    built once per `init` and handed to every transport (`Links` adds the local rank)."""
    return TransportOptions.from_environ(environ)


def local_transports(spec: str, options: TransportOptions | None = None) -> tuple[str, ...]:
    """Names of the transports this process can run, each made ready (`Transport.prepare`,
    e.g. MPI_Init) as soon as it is found available, so later probes see what it loaded (the
    MPICH wheel's own UCX, which ucxx's cannot share a process with), and asked once more after
    that (MPI's thread level is known only once MPI runs). A forced transport that cannot run
    here is an error that says why. Call before the rendezvous store is used. ``options``:
    `transport_options`' (None: the process environment's)."""
    options = transport_options() if options is None else options
    if spec == "auto" or spec.startswith("auto:"):
        names = []
        for name in transports.names():
            try:
                cls = transports.load(name)
            except TransportUnavailableError:
                continue
            if transports.is_available(cls, options)[0]:
                cls.prepare()
                # asked again: some know only once started (MPI)
                if transports.is_available(cls, options)[0]:
                    names.append(name)
        return tuple(names)
    cls = transports.load(spec)
    ok, why = transports.is_available(cls, options)
    if ok:
        cls.prepare()
        ok, why = transports.is_available(cls, options)
    if not ok:
        raise TransportUnavailableError(f"DDL_TRANSPORT={spec} cannot run here: {why}")
    return (spec,)


def network_order(spec: str) -> tuple[str, ...]:
    if spec.startswith("auto:"):
        return tuple(n for n in spec[5:].split(",") if n)
    return transports.NETWORK_ORDER


def choose(spec: str, me: PeerInfo, peer: PeerInfo, instances: dict[str, Transport]) -> str:
    """The transport for the pair (me, peer); symmetric in its two arguments."""
    both = [n for n in me.transports if n in peer.transports]
    if spec not in ("auto",) and not spec.startswith("auto:"):
        if spec not in both:
            raise TransportUnavailableError(
                f"DDL_TRANSPORT={spec}: rank {peer.rank} cannot run it "
                f"(it has {', '.join(peer.transports) or 'none'})"
            )
        return spec
    if me.host_id == peer.host_id and "shm" in both:
        if instances["shm"].can_connect(me, peer):
            return "shm"
    for name in network_order(spec):
        if name in both and instances[name].can_connect(me, peer):
            return name
    raise TransportUnavailableError(
        f"no transport connects rank {me.rank} ({', '.join(me.transports)}) with rank "
        f"{peer.rank} ({', '.join(peer.transports)}) under DDL_TRANSPORT={spec}"
    )


def nominal(spec: str, a: PeerInfo, b: PeerInfo) -> str:
    """`choose`'s rule on the published transport lists only (no ``can_connect`` probe, which
    needs the transport loaded here): the same answer on every rank."""
    both = [n for n in a.transports if n in b.transports]
    if spec != "auto" and not spec.startswith("auto:"):
        return spec
    if a.host_id == b.host_id and "shm" in both:
        return "shm"
    return next((n for n in network_order(spec) if n in both), "tcp")


def plan(spec: str, options: TransportOptions | None = None) -> dict[str, str]:
    """What ``spec`` would choose here for a peer on this host and for one on another host,
    assuming the peer can run what this process can (``python -m ddlcore info`` prints it)."""
    names = local_transports(spec, options)
    instances = {name: transports.load(name)() for name in names}
    me = PeerInfo(0, "this-host", names)
    out = {}
    for level, host in (("same host", "this-host"), ("other hosts", "another-host")):
        try:
            out[level] = choose(spec, me, PeerInfo(1, host, names), instances)
        except TransportUnavailableError as exc:
            out[level] = f"none ({exc})"
    return out


def level_transports(spec: str, peers: list[PeerInfo]) -> dict[str, str]:
    """The transport between two ranks of one host ("host") and of two hosts ("network"),
    named from the first such pair's published lists alone (`nominal`), so that every rank
    names the same: the topology's link defaults come from it, and every rank must predict
    the same costs to choose the same algorithm."""
    by_host: dict[str, list[PeerInfo]] = {}
    for p in peers:
        by_host.setdefault(p.host_id, []).append(p)
    groups = list(by_host.values())
    pairs = {
        "host": next((g[:2] for g in groups if len(g) > 1), None),
        "network": [groups[0][0], groups[1][0]] if len(groups) > 1 else None,
    }
    return {level: nominal(spec, *pair) for level, pair in pairs.items() if pair}


class Links:
    """Per-peer transport pairs of one communicator."""

    def __init__(
        self,
        rank: int,
        size: int,
        spec: str,
        peers: list[PeerInfo],
        store: Store,
        timeout: float,
        options: TransportOptions | None = None,
    ) -> None:
        self.rank, self.size = rank, size
        me = peers[rank]
        instances = {name: transports.load(name)() for name in me.transports}
        self.choice: dict[int, str] = {
            p.rank: choose(spec, me, p, instances) for p in peers if p.rank != rank
        }
        self.contexts: dict[str, Context] = {}
        self._relayed = False  # an abort a peer told one context of went to all of them
        self._relay_lock = threading.Lock()
        self._store = store
        self._note = abort_notes.Note(store, rank)
        local_rank = layout([p.host_id for p in peers], rank).local_rank  # picks its rail
        options = dataclasses.replace(
            transport_options() if options is None else options, local_rank=local_rank
        )
        try:
            for name in sorted(set(self.choice.values())):
                ctx = self.contexts[name] = transports.create_context(
                    instances[name], rank, size, store, timeout, options
                )
                try:
                    ctx.on_abort = self._heard_abort
                except AttributeError:  # a context that cannot take it: fails less promptly
                    pass
        except BaseException:
            for made in self.contexts.values():  # nobody else holds them yet
                with contextlib.suppress(Exception):
                    made.close()
            raise
        self._pairs: dict[int, Pair] = {}
        # Where one transport links this rank with every peer and runs steps natively
        # (`Context.run_steps`), the engine hands it a call's steps first.
        self.run_steps: Callable[..., tuple[int, Any]] | None = None
        if len(self.contexts) == 1:
            only = next(iter(self.contexts.values()))
            if type(only).run_steps is not Context.run_steps:
                self.run_steps = only.run_steps

    def host_collectives(self, group: Sequence[int]) -> tuple[HostCollectivesFactory | None, str]:
        """What runs collectives among ``group`` (ranks of this host, this one among them) as
        a whole: the offer of the one transport that links this rank with all the others
        (`Context.host_collectives`), or None and why there is none."""
        names = sorted({self.choice[q] for q in group if q != self.rank})
        if len(names) != 1:
            return None, f"the ranks talk {', '.join(names)}, not one transport"
        offer = getattr(self.contexts[names[0]], "host_collectives", None)  # API version 1: none
        factory = offer() if offer is not None else None
        if factory is None:
            return None, f"the ranks talk {names[0]}, which has no host collectives"
        return factory, ""

    def pair(self, peer: int) -> Pair:
        p = self._pairs.get(peer)
        if p is None:
            p = self._pairs[peer] = self.contexts[self.choice[peer]].pair(peer)
        return p

    def _heard_abort(self, code: int, reason: str) -> None:
        """A context heard a peer's abort and aborted itself (`Context.on_abort`, called on a
        transport's thread): abort the others with it, once."""
        with self._relay_lock:
            if self._relayed:
                return
            self._relayed = True
        self.abort(code, reason)

    def abort(self, code: int, reason: str) -> None:
        for ctx in list(self.contexts.values()):
            try:
                ctx.abort(code, reason)
            except Exception:  # best effort: we are already failing
                pass
        self._note.post(code, reason)

    def explain(self, exc: DDLError) -> DDLError:
        """``exc``, or where it only says that a peer is gone, the abort that peer left a
        note of (`abort_notes.explain`)."""
        return abort_notes.explain(exc, self.rank, self._store)

    def close(self) -> None:
        self._note.wait()  # before the connections go: peers that come later read why we left
        for ctx in self.contexts.values():
            ctx.close()
        self.contexts.clear()
        self._pairs.clear()
