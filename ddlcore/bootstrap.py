"""`init()`: join a job and assemble its `Communicator`. It finds the job
(``ddlcore.job.rendezvous``), meets the other ranks at rank 0's store, learns which ranks share
a host (``ddlcore.topology``), picks a transport per peer pair (``ddlcore.job.links``), sets up
host collectives where ranks share a host and a transport offers them
(`Context.host_collectives`: shm's boards) and builds the `Communicator` from those parts. In
the API layer, beside the communicator it builds: the job layer below knows nothing of it.
"""

from __future__ import annotations

import atexit
import copy
import logging
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ddlcore import config, topology
from ddlcore.algorithms import mdring
from ddlcore.communicator import Communicator
from ddlcore.errors import DDLError
from ddlcore.execution.hostcoll import HostCollectives
from ddlcore.job import placement, probe
from ddlcore.job.links import (
    Links,
    level_transports,
    local_transports,
    network_order,
    transport_options,
)
from ddlcore.job.rendezvous import (
    SECRET_ORIGIN_MPI,
    TORCH_PROCESS_GROUP,
    RendezvousInfo,
    detect,
    resolve_master,
    via_torch_store,
)
from ddlcore.membership import Shrinking
from ddlcore.planning import tuning
from ddlcore.resilience.channel import AgreeChannel
from ddlcore.resilience.control import ControlPlane
from ddlcore.security.auth import JobKey, job_secret
from ddlcore.transports.base import PeerInfo, TransportOptions
from ddlcore.transports.sockets import format_address, parse_address, route_address

log = logging.getLogger("ddlcore")

_MAX_PEER_RECORD = 4096
# After a failed init, how long the rank serving the store waits for the others to leave it.
_LINGER_S = 5.0
# How long a shrink's rank keeps dialling the store its lowest survivor opened before it said
# where (a refusal then means that survivor abandoned the attempt, or died).
_SHRINK_CONNECT_S = 1.0


def _encode_peer(
    host_id: str,
    control: tuple[str, int],
    names: tuple[str, ...],
    rack_id: str,
    cpus: str,
    settings: str,
) -> bytes:
    address = format_address(*control)
    return f"{host_id}\n{address}\n{','.join(names)}\n{rack_id}\n{cpus}\n{settings}".encode()


def _decode_peer(rank: int, raw: bytes) -> tuple[PeerInfo, tuple[str, int], str, str, str]:
    """A rank's init record: (what transports need to know of it, its control plane's address,
    its rack id, the CPUs its launcher gave it, the settings every rank must share)."""
    if len(raw) > _MAX_PEER_RECORD:
        raise DDLError(f"rank {rank}'s init record is {len(raw)} bytes, over {_MAX_PEER_RECORD}")
    host_id, _, rest = raw.decode("utf-8", "replace").partition("\n")
    control, _, rest = rest.partition("\n")
    try:
        address = parse_address(control)
    except ValueError as exc:
        raise DDLError(f"rank {rank}'s init record names no control address: {exc}") from None
    names, _, rest = rest.partition("\n")
    rack_id, _, rest = rest.partition("\n")
    cpus, _, settings = rest.rpartition("\n")
    peer = PeerInfo(rank, host_id, tuple(n for n in names.split(",") if n))
    return peer, address, rack_id, cpus, settings


def _shared_settings(algo: str, boards: str) -> str:
    """The settings that choose a path, which ranks must not differ in (a rank that set up the
    boards would wait for one that did not until DDL_TIMEOUT)."""
    return f"DDL_ALGO={algo} DDL_HOST_COLLECTIVES={boards}"


def _check_settings(rank: int, settings: list[str]) -> None:
    if len(set(settings)) > 1:
        ranks: dict[str, list[int]] = {}
        for r, s in enumerate(settings):
            ranks.setdefault(s, []).append(r)
        listed = "; ".join(f"{s} on ranks {rs}" for s, rs in ranks.items())
        raise DDLError(
            f"rank {rank}: the ranks were started with different settings ({listed}); set the "
            "same on every rank"
        )


def _pin_local_rank(mode: str, rank: int, peers: list[PeerInfo], cpu_records: list[str]) -> bool:
    """Pin this rank to its block of its machine's CPUs where `placement.plan` says so; True
    where it did. The ranks that share CPUs are those on this rank's running kernel (host ids
    tell emulated hosts apart, which share one machine's CPUs), or on its host where the
    kernel's id is unknown; rank 0's token names the job."""
    records = [placement.read_record(text) for text in cpu_records]
    machine = records[rank][1]
    if machine:
        local = [r for r, (_, other, _) in enumerate(records) if other == machine]
    else:
        local = [r for r, peer in enumerate(peers) if peer.host_id == peers[rank].host_id]
    cpus, why = placement.pin_local_rank(
        mode,
        records[0][0] or "unnamed",
        local.index(rank),
        [records[r][2] for r in local],
    )
    if cpus is None:
        log.debug("rank %d: not pinned to CPUs: %s", rank, why)
        return False
    log.debug(
        "rank %d: pinned to CPUs %s (%s; DDL_BIND=none leaves placement to the launcher)",
        rank,
        placement.encode(cpus),
        why,
    )
    return True


_servers: dict[tuple[str, int], Any] = {}
_servers_lock = threading.Lock()
_generation: dict[tuple[str, int], int] = {}


@atexit.register
def _stop_serving() -> None:
    """At exit, close the stores this process serves while Python still runs their threads: a
    later exit step (MPI_Finalize, which waits for every rank) would freeze them with their
    sockets open, and a rank still asking would wait out its socket timeout instead of hearing
    at once that the store is gone."""
    with _servers_lock:
        servers = list(_servers.values())
    for server in servers:
        server.close(timeout=1.0)


def _store_connections(size: int) -> int:
    """The store's cap on connections: a few per rank (one per communicator it has open), plus
    room for the handshakes in progress; never below the server's default."""
    from ddlcore.job.store_server import MAX_CONNECTIONS, MAX_PENDING

    return max(MAX_CONNECTIONS, 4 * size + MAX_PENDING)


def _store_for(info: RendezvousInfo, timeout: float, environ: Mapping[str, str] | None) -> Any:
    from ddlcore.job.store import PrefixStore, StoreClient, StoreServer

    assert info.master_addr is not None and info.master_port is not None
    key = (info.master_addr, info.master_port)
    if info.secret is not None:  # drawn by rank 0 and broadcast over MPI (``rendezvous``)
        secret, origin = info.secret, SECRET_ORIGIN_MPI
    else:
        secret, origin = job_secret(environ)
    job_key = JobKey(secret, str(info.master_port), origin)
    log.debug("rank %d: the job's secret comes from %s", info.rank, origin)
    with _servers_lock:
        if info.rank == 0 and key not in _servers:
            _servers[key] = StoreServer(
                info.master_addr,
                info.master_port,
                job_key=job_key,
                max_connections=_store_connections(info.size),
            )
        generation = _generation.get(key, 0)
        _generation[key] = generation + 1
    # The store holds one process per rank of the job; a torch process group's ranks are not the
    # job's (a subgroup's rank 1 may be the world's rank 2), so those claim none.
    member = -1 if info.source == TORCH_PROCESS_GROUP else info.rank
    client = StoreClient(
        info.master_addr,
        info.master_port,
        timeout,
        rank=info.rank,
        size=info.size,
        job_key=job_key,
        member=member,
    )
    return client, PrefixStore(client, f"g{generation}/")


def _control_plane(
    info: RendezvousInfo, store: Any, timeout: float, environ: Mapping[str, str] | None
) -> ControlPlane:
    """This process's control plane, listening where the job's other hosts reach it (the
    address its route to the store's host leaves from)."""
    master = info.master_addr
    host = route_address(master) if master else socket.gethostbyname(socket.gethostname())
    heartbeat_s = config.get("DDL_HEARTBEAT_TIMEOUT", environ)
    return ControlPlane(host, store.job_key, timeout, heartbeat_s)


def _let_peers_finish(info: RendezvousInfo, timeout: float) -> None:
    """On the rank serving the store, after a failed init: let the other ranks (failing too, as
    a rule) get their last answers and disconnect before this process may exit and take the
    store with it; else they would report a lost store instead of their own error."""
    server = _servers.get((info.master_addr, info.master_port))  # type: ignore[arg-type]
    if server is not None:
        server.wait_idle(min(timeout, _LINGER_S))


def _host_collectives(
    info: RendezvousInfo, peers: list[PeerInfo], links: Links, store: Any, timeout: float, algo: str
) -> HostCollectives | None:
    """The host collectives, when every rank is on this host and one transport that offers
    them links them all (shm's boards; DDL_ALGO leaves the choice to us); an error if
    DDL_ALGO=direct asks for them elsewhere."""
    if algo not in ("auto", tuning.DIRECT):
        return None
    factory, why = links.host_collectives(range(info.size))
    if len({p.host_id for p in peers}) > 1:
        why = "the ranks are on more than one host"
    elif factory is not None and info.size > factory.max_ranks:
        why = f"{info.size} ranks share this host (at most {factory.max_ranks})"
    if factory is None or why:
        if algo == tuning.DIRECT:
            # Every rank comes to this; none may leave (taking rank 0's store) before all have.
            store.barrier("direct", info.rank, info.size, timeout)
            raise ValueError(
                f"DDL_ALGO={tuning.DIRECT} needs every rank on one host over a transport with "
                f"host collectives (shm), but {why}"
            )
        return None
    return _connected(factory(info.rank, info.size, store, timeout), store)


def _node_collectives(
    info: RendezvousInfo,
    peers: list[PeerInfo],
    topo: topology.Topology,
    links: Links,
    store: Any,
    timeout: float,
    algo: str,
) -> HostCollectives | None:
    """Host collectives among the ranks of this host, when the box has host and network
    dimensions: mdring then runs its host dimensions through them (`Communicator`)."""
    if algo not in ("auto", mdring.NAME) or topo.host_dims == 0 or topo.host_dims == len(topo.dims):
        return None
    per_node = topo.ranks_per_node
    node = topo.node_of(info.rank)
    group = [topo.order[node * per_node + g] for g in range(per_node)]
    boards = None
    factory, _ = links.host_collectives(group)
    if (
        factory is not None
        and 1 < per_node <= factory.max_ranks
        and all(peers[q].host_id == peers[info.rank].host_id for q in group)
    ):
        index = topo.position(info.rank) % per_node  # (the same on every rank of this host)
        boards = _connected(factory(index, per_node, store, timeout, f"n{node}/", group), store)
    return _agreed_across_hosts(info, boards, store, timeout)


def _agreed_across_hosts(
    info: RendezvousInfo, boards: HostCollectives | None, store: Any, timeout: float
) -> HostCollectives | None:
    """Every host keeps its boards only if every host has some, and reads directly only if
    every host can (a kernel's Yama setting is per host): a collective takes the host-staged
    path on every rank or on none, since an allreduce's segments there are not the messages
    of the whole mdring schedule."""
    try:
        store.add("nodes/without", int(boards is None))
        store.add("nodes/no-direct", int(boards is not None and not boards.direct))
        store.barrier("nodes", info.rank, info.size, timeout)
        without, no_direct = store.add("nodes/without", 0), store.add("nodes/no-direct", 0)
    except BaseException:
        if boards is not None:
            boards.close()
        raise
    if boards is not None and without:
        log.debug(
            "rank %d: host collectives off: %d rank(s) on other hosts have none", info.rank, without
        )
        boards.close()
        return None
    if boards is not None and no_direct and boards.direct:
        log.debug(
            "rank %d: direct reads off: %d rank(s) on other hosts cannot read directly",
            info.rank,
            no_direct,
        )
        boards.direct = False
    return boards


def _connected(host: HostCollectives, store: Any) -> HostCollectives:
    try:
        host.connect(store)
    except BaseException:
        host.close()
        raise
    return host


def init(
    *,
    rank: int | None = None,
    size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    transport: str | None = None,
    timeout: float | None = None,
    algo: str | None = None,
    environ: Mapping[str, str] | None = None,
    store: Any = None,
) -> Communicator:
    """Join the job and return its `Communicator`.

    Parameters
    ----------
    rank, size, master_addr, master_port : optional
        Override what the launcher's variables say (ddlrun, torchrun, mpiexec, srun). With no
        launcher and no arguments, the process is a world of one.
    transport : str, optional
        Like ``DDL_TRANSPORT``: "auto", "tcp", ...
    timeout : float, optional
        Seconds any wait may last (``DDL_TIMEOUT``, default 600).
    algo : str, optional
        Like ``DDL_ALGO``: "auto", "ring", ...
    environ : mapping, optional
        Read configuration from this mapping instead of ``os.environ``.
    store : torch.distributed.Store, optional
        A store every rank shares (the one ``init_process_group`` hands a backend); needs
        ``rank`` and ``size``. Rank 0 publishes its own store's address there and the others
        read it: no launcher variable is consulted for the rendezvous.

    Raises
    ------
    RendezvousError
        The other ranks did not all arrive within the timeout; says how many did.
    TransportUnavailableError
        The requested transport cannot run here, and why.
    """
    if store is not None and (rank is None or size is None or master_addr or master_port):
        raise ValueError("store= needs rank= and size=, and takes no master_addr/master_port")
    config.warn_unknown(environ, stacklevel=2)  # a misspelled DDL_* variable: said, once
    info = detect(environ)
    if rank is not None or size is not None:
        info = RendezvousInfo(
            info.rank if rank is None else rank,
            info.size if size is None else size,
            info.master_addr,
            info.master_port,
            "arguments",
        )
    if master_addr is not None or master_port is not None:
        info = RendezvousInfo(
            info.rank,
            info.size,
            master_addr or info.master_addr,
            master_port or info.master_port,
            info.source,
        )
    if not 0 <= info.rank < info.size:
        raise ValueError(f"rank={info.rank} must be in [0, size={info.size})")
    bind = config.get("DDL_BIND", environ)
    timeout = config.get("DDL_TIMEOUT", environ) if timeout is None else float(timeout)
    if not timeout > 0:
        raise ValueError(f"timeout={timeout} must be positive")
    spec = (
        config.VARS["DDL_TRANSPORT"].parse(transport)
        if transport
        else config.get("DDL_TRANSPORT", environ)
    )
    if config.get("DDL_DEBUG", environ) and not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[ddlcore] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)
    host_id = topology.host_identity(environ)
    options = transport_options(environ)  # the transports' configuration, read once
    if info.size == 1:
        if info.source == "single process":  # DDL_DEBUG=1 says why a job is alone
            log.info(
                "rank 0 of 1: no launcher variables are set, so this process is a world of "
                "one; start N ranks with: ddlrun -np N python prog.py"
            )
        joiner = _Joiner(info, (), spec, host_id, None, timeout, environ, algo, options)
        return Communicator(
            info, [PeerInfo(0, host_id, ())], None, None, timeout, environ, algo, joiner=joiner
        )
    if store is not None:
        info = via_torch_store(store, info.rank, info.size, timeout, environ)
    else:
        info = resolve_master(info, environ, timeout)
    names = local_transports(spec, options)  # prepares them too: MPI_Init precedes the store
    client, store = _store_for(info, timeout, environ)
    return _join(
        info, names, spec, host_id, client, store, timeout, environ, algo, options, place=bind
    )


def _join(
    info: RendezvousInfo,
    names: tuple[str, ...],
    spec: str,
    host_id: str,
    client: Any,
    store: Any,
    timeout: float,
    environ: Mapping[str, str] | None,
    algo: str | None,
    options: TransportOptions,
    *,
    place: str | None,
    cpu_share: float | None = None,
    plane: ControlPlane | None = None,
) -> Communicator:
    """Meet the other ranks in ``store`` (a namespace of the store ``client`` talks to) and
    build the communicator: `init`'s second half, and how `Communicator.split` makes one
    (``place``: the world's DDL_BIND, pinning this rank to its CPUs; None for a child;
    ``cpu_share``: the world's `placement.cpu_share`, which a child's ranks share too, None
    to read it from the records; ``plane``: the world's control plane, which its children
    share, None to open one)."""
    links: Links | None = None
    host = node = None
    agreement: AgreeChannel | None = None
    shrinking: Shrinking | None = None
    pinned = False
    own_plane = plane is None
    try:
        if plane is None:
            plane = _control_plane(info, store, timeout, environ)
        algo_name = algo.lower() if algo else config.get("DDL_ALGO", environ)
        boards = config.get("DDL_HOST_COLLECTIVES", environ)
        # Read once by every rank, then freed by the store.
        store.set(
            f"peer/{info.rank}",
            _encode_peer(
                host_id,
                plane.address,
                names,
                topology.rack_identity(environ),
                placement.record(),
                _shared_settings(algo_name, boards),
            ),
            readers=info.size,
        )
        store.barrier("init", info.rank, info.size, timeout)
        records = [_decode_peer(r, store.get(f"peer/{r}", timeout)) for r in range(info.size)]
        peers = [peer for peer, _, _, _, _ in records]
        # Every rank has read every record before any can fail on the topology (a box that does
        # not fit: the same ValueError everywhere) and leave, taking rank 0's store with it.
        store.barrier("peers", info.rank, info.size, timeout)
        _check_settings(info.rank, [settings for _, _, _, _, settings in records])
        addresses = [a for _, a, _, _, _ in records]
        agreement = AgreeChannel(plane, store.prefix, info.rank, addresses)
        shrinking = Shrinking(plane, store.prefix, info.rank, addresses)
        if place is not None:
            pinned = _pin_local_rank(place, info.rank, peers, [c for _, _, _, c, _ in records])
        if boards == "off" and algo_name == tuning.DIRECT:
            raise ValueError(
                f"DDL_ALGO={tuning.DIRECT} runs on the host collectives, which "
                "DDL_HOST_COLLECTIVES=off turns off; unset one of them"
            )
        host_ids = [p.host_id for p in peers]
        if cpu_share is None:
            cpu_share = placement.cpu_share(
                [placement.read_record(c) for _, _, _, c, _ in records], host_ids
            )
        topo = topology.build(
            host_ids,
            [rack for _, _, rack, _, _ in records],
            level_transports(spec, peers),
            environ,
            cpu_share,
        )
        links = Links(info.rank, info.size, spec, peers, store, timeout, options)
        probing = config.get("DDL_LINK_PROBE", environ)
        if probe.wanted(probing, len(set(host_ids)), environ):
            topo = probe.measure(
                topo, info.rank, links, store, timeout, host_ids, environ, in_host=probing == "1"
            )
        if boards != "off":
            host = _host_collectives(info, peers, links, store, timeout, algo_name)
            if host is None:
                node = _node_collectives(info, peers, topo, links, store, timeout, algo_name)
        comm = Communicator(
            info,
            peers,
            client,
            links,
            timeout,
            environ,
            algo,
            topo,
            host,
            node,
            joiner=_Joiner(
                info, names, spec, host_id, store, timeout, environ, algo, options, cpu_share, plane
            ),
            prefixed=store,
            on_close=placement.release if pinned else None,
            agreement=agreement,
            shrinking=shrinking,
            plane=plane,
        )
    except BaseException:
        if pinned:
            placement.release()
        opened = [c for c in (agreement, shrinking) if c is not None]
        if plane is not None and (any([c.close() for c in opened]) or (own_plane and not opened)):
            plane.close()
        for part in (host, node, links):
            try:
                if part is not None:
                    part.close()
            except Exception:  # the error being raised is the one to report
                log.debug("rank %d: closing after a failed init", info.rank, exc_info=True)
        client.close()
        if info.source != "shrink":  # a shrink's store serves an attempt: none lingers there
            _let_peers_finish(info, timeout)
        raise
    log.debug(
        "rank %d of %d up (%s): host %s, local rank %d of %d, transports %s, box %s",
        comm.rank,
        comm.size,
        info.source,
        host_id,
        comm.local_rank,
        comm.local_size,
        sorted(set(links.choice.values())),
        topo.describe(),
    )
    return comm


class _Joiner:
    """How a communicator makes another of (some of) its ranks: ``join(rank, size, name)``
    meets the child's ranks in the namespace ``name`` under this communicator's, in the same
    store (served by rank 0 of the world, until its process exits): `Communicator.split`.
    With ``at=(host, port)`` they meet in the store another rank serves there instead
    (`serve`): `Communicator.shrink`, whose survivors cannot count on the world's rank 0.
    Children never take the MPI transport (its contexts duplicate MPI_COMM_WORLD, collectively
    over every rank) and ignore DDL_TOPOLOGY (a box for the world's ranks)."""

    def __init__(
        self,
        info: RendezvousInfo,
        names: tuple[str, ...],
        spec: str,
        host_id: str,
        store: Any,
        timeout: float,
        environ: Mapping[str, str] | None,
        algo: str | None,
        options: TransportOptions,
        cpu_share: float | None = None,
        plane: ControlPlane | None = None,
    ) -> None:
        self._forced_mpi = spec == "mpi"
        if self._forced_mpi or spec == "auto" or spec.startswith("auto:"):
            network = [n for n in network_order(spec) if n != "mpi"] if not self._forced_mpi else []
            spec = "auto:" + ",".join(network or ["ucx", "tcp"])
        self._info, self._names, self._spec, self._host_id = info, names, spec, host_id
        self._store, self._timeout, self._algo, self._options = store, timeout, algo, options
        self._environ = config.without(environ, "DDL_TOPOLOGY")
        self._cpu_share, self._plane = cpu_share, plane

    def __call__(
        self,
        rank: int,
        size: int,
        name: str,
        at: tuple[str, int] | None = None,
        on_client: Callable[[Any], None] | None = None,
    ) -> Communicator:
        """The child; ``on_client(client)`` hears of its store connection as soon as it is
        made (a shrink closes it to abandon an attempt)."""
        from ddlcore.job.store import PrefixStore, StoreClient

        info, store = self._info, self._store
        if size == 1:
            child = RendezvousInfo(rank, size, info.master_addr, info.master_port, "split")
            return Communicator(
                child,
                [PeerInfo(0, self._host_id, ())],
                None,
                None,
                self._timeout,
                self._environ,
                self._algo,
                joiner=self,
            )
        # Under DDL_TRANSPORT=mpi the children take what else runs here (shm, ucx, tcp).
        found = local_transports("auto", self._options) if self._forced_mpi else self._names
        child_names = tuple(n for n in found if n != "mpi")
        if at is None:
            assert info.master_addr is not None and info.master_port is not None
            child = RendezvousInfo(rank, size, info.master_addr, info.master_port, "split")
            client = StoreClient(
                info.master_addr,
                info.master_port,
                self._timeout,
                rank=rank,
                size=size,
                job_key=store.job_key,
                member=store.member,  # the world's rank: the store keeps one process per rank
            )
            prefix = f"{store.prefix}{name}/"
        else:
            child = RendezvousInfo(rank, size, at[0], at[1], "shrink")
            client = StoreClient(
                at[0],
                at[1],
                self._timeout,
                rank=rank,
                size=size,
                job_key=_fresh(store.job_key),
                connect_s=_SHRINK_CONNECT_S,  # it listens already: refused means abandoned
            )
            prefix = f"{name}/"
        if on_client is not None:
            on_client(client)
        return _join(
            child,
            child_names,
            self._spec,
            self._host_id,
            client,
            PrefixStore(client, prefix),
            self._timeout,
            self._environ,
            self._algo,
            self._options,
            place=None,
            cpu_share=self._cpu_share,
            plane=self._plane,
        )

    def serve(self, host: str, size: int) -> Any:
        """A store for ``size`` ranks on an ephemeral port of ``host``, with a job id of its
        own (served until this process exits, as rank 0's is)."""
        from ddlcore.job.store import StoreServer

        server = StoreServer(
            host, 0, job_key=_fresh(self._store.job_key), max_connections=_store_connections(size)
        )
        with _servers_lock:
            _servers[(host, server.port)] = server
        return server


def _fresh(key: JobKey) -> JobKey:
    """The job's key for a store of its own: the same secret, no job id yet (the store draws
    one, its clients learn it)."""
    fresh = copy.copy(key)
    fresh.job_id = None
    return fresh
