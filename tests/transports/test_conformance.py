"""The transport conformance suite, parametrised over every transport (see ``conformance.py``).

Each test runs in real rank processes: kept in a pool per world size (`pooled`) where the check
makes and closes its own contexts and store, fresh ones (`run_ranks`) where the processes are
the subject (a rank killed, what a process holds after close, per-process GPU state, per-rank
environments). A transport that cannot run here is skipped with its reason (a failure under
``DDL_REQUIRE_ALL=1``).
"""

from __future__ import annotations

import pytest

from tests.harness import RankPools, require, run_ranks
from tests.transports import conformance as conf

TRANSPORTS = ["tcp", "shm", "ucx"]
JOB_TIMEOUT_S = 60.0  # harness deadline per test; each check itself waits at most a few seconds

# A spawned world costs more than most checks (interpreters, numpy, ucxx): the checks share
# processes, each making and closing its own contexts on a fresh store port.
_POOLS = RankPools()


@pytest.fixture(scope="module", autouse=True)
def _close_pools():
    yield
    _POOLS.close()


def pooled(fn, nprocs: int, *args, env=None):
    return _POOLS.run(fn, nprocs, *args, timeout=JOB_TIMEOUT_S, env=env)


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    name = request.param
    require(*conf.transport_class(name).is_available())
    return name


def test_ordering_with_one_tag(transport):
    pooled(conf.ordering_same_tag, 2, transport)


def test_ordering_with_interleaved_tags(transport):
    pooled(conf.interleaved_tags, 2, transport)


def test_a_thousand_outstanding_requests(transport):
    pooled(conf.many_outstanding, 2, transport)


def test_zero_byte_messages(transport):
    pooled(conf.zero_bytes, 2, transport)


def test_256_mb_message(transport):
    nbytes = 256 << 20
    (_, crc0), (elapsed, crc1) = pooled(conf.large_message, 2, transport, nbytes)
    assert crc0 == crc1
    # No speed check: that is the benchmarks' business, and a loaded machine is slow. The
    # receiver's wait has a deadline (conformance.LARGE_TIMEOUT_S), so a stall still fails.
    print(f"{transport}: 256 MB in {elapsed * 1e3:.0f} ms = {nbytes / elapsed / 1e9:.2f} GB/s")


def test_large_message_paths(transport):
    _, messages = pooled(conf.large_message_paths, 2, transport)
    early, late = messages
    assert "rank 0 sent 1048576 bytes" in early and "rank 1 posted 1048575 bytes" in early
    assert "rank 0 sent 1048576 bytes" in late and "rank 1 posted 1048577 bytes" in late


def test_traffic_in_both_directions(transport):
    pooled(conf.both_directions, 2, transport)


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_all_pairs_exchange(transport, nprocs):
    pooled(conf.all_pairs, nprocs, transport)


def test_two_channels(transport):
    env = {"DDL_NCHANNELS": "2"}
    pooled(conf.interleaved_tags, 2, transport, env=env)
    pooled(conf.all_pairs, 3, transport, env=env)


@pytest.mark.parametrize("nchannels", ["1", "2"])
def test_concurrent_waiters_on_one_pair(transport, nchannels):
    pooled(conf.concurrent_waiters, 2, transport, env={"DDL_NCHANNELS": nchannels})


def test_a_failure_wakes_a_waiting_thread(transport):
    _, took = pooled(conf.failure_wakes_a_waiter, 2, transport)
    assert len(took) == 2
    assert all(t < 2.0 for t in took), took  # the deadline was 15 s


def test_sends_do_not_wait_for_the_receiver(transport):
    pooled(conf.sends_do_not_wait_for_the_receiver, 3, transport)


def test_size_and_check_mismatch(transport):
    _, messages = pooled(conf.mismatches, 2, transport)
    assert len(messages) == 4
    size_early, check_early, size_late, check_late = messages
    assert "rank 0 sent 100 bytes" in size_early and "rank 1 posted 200 bytes" in size_early
    assert "tag 0x5" in size_early, size_early
    assert "check 0x0000aaaa" in check_early and "check 0x0000bbbb" in check_early, check_early
    assert "rank 0 sent 64 bytes" in size_late and "rank 1 posted 63 bytes" in size_late
    assert "check 0x0000bbbb" in check_late and "check 0x0000aaaa" in check_late, check_late


def test_timeout_names_ranks_tag_and_wait(transport):
    wait_s = 1.0
    _, connected, unconnected = pooled(conf.timeouts, 3, transport, wait_s)
    assert len(connected) == 2 and len(unconnected) == 1
    for message, elapsed in connected + unconnected:
        assert wait_s * 0.9 <= elapsed < wait_s + 1.0, (elapsed, message)
        assert "1.0 s" in message, message
    for message, _ in connected:
        assert "rank 1" in message and "rank 0" in message and "0xabc" in message, message
    message = unconnected[0][0]
    assert "rank 2" in message and "rank 0" in message and "0xdef" in message, message


@pytest.mark.parametrize("nprocs,victim", [(2, 1), (3, 1), (3, 0)])
def test_killed_peer_fails_survivors_fast(transport, nprocs, victim):
    results = run_ranks(
        conf.killed_peer, nprocs, transport, victim, may_die={victim}, timeout=JOB_TIMEOUT_S
    )
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        message, elapsed, later = result
        assert elapsed < 3.0, f"rank {rank} noticed rank {victim}'s death after {elapsed:.1f} s"
        assert f"rank {victim}" in message, message
        assert f"rank {victim}" in later, later


def test_abort_reaches_the_peer_with_class_and_reason(transport):
    _, seen = pooled(conf.abort_propagation, 2, transport)
    assert [name for name, _, _ in seen] == [cls.__name__ for cls in conf.ABORT_CODES.values()]
    for (_, message, elapsed), code in zip(seen, conf.ABORT_CODES, strict=True):
        assert message.startswith(f"rank 0 aborted: collective #{code} went wrong: ünïcödé")
        assert elapsed < 2.0, elapsed
    assert len(seen[-1][1].encode()) < conf.MAX_ABORT_REASON_BYTES + 100  # the long one was cut


def test_bad_arguments(transport):
    pooled(conf.bad_arguments, 2, transport)


@pytest.mark.parametrize("nchannels", ["1", "2"])
def test_close_releases_threads_and_sockets(transport, nchannels):
    results = run_ranks(
        conf.resources_released,
        3,
        transport,
        timeout=JOB_TIMEOUT_S,
        env={"DDL_NCHANNELS": nchannels},
    )
    for threads_open, sockets_open, segments_open in results:
        # The check looked at something: each transport's resources were there while open.
        assert threads_open > 0 or transport not in ("tcp", "shm")
        assert sockets_open > 0 or transport != "tcp"
        assert segments_open > 0 or transport != "shm"


def test_tcp_waiting_thread_reads_its_own_messages():
    completed_by, _ = pooled(conf.tcp_waiter_reads_its_socket, 2)
    assert len(completed_by) == 50
    # The receiver thread stays parked while receives are waited on back to back, so the
    # waiting thread reads them; but a waiter the scheduler holds off between its send and its
    # receive (a loaded machine) can leave one to the receiver thread. A hand-off on every
    # message (the regression this guards against) would make all 50 the receiver thread's.
    by_waiter = completed_by.count("MainThread")
    assert by_waiter >= 25, completed_by


def test_tcp_wait_keeps_its_deadline_inside_a_stalled_frame():
    _, seen = pooled(conf.tcp_peer_stalls_mid_frame, 2)
    (timed_out, t_timeout), (completed, _), (failed, t_failed) = seen
    assert timed_out.startswith("timeout:") and "0x5" in timed_out, timed_out
    assert 0.9 <= t_timeout < 2.0, t_timeout  # its deadline, not the end of the stall (2.5 s)
    assert completed == "completed"
    assert "stopped by another thread" in failed and t_failed < 2.0, (failed, t_failed)


def test_tcp_abort_or_close_fails_a_half_received_message():
    _, seen = pooled(conf.tcp_abort_while_a_message_is_half_in, 2)
    assert [outcome.split(":")[0] for outcome, _ in seen] == ["abort", "close"], seen
    assert all(took < 2.0 for _, took in seen), seen  # the deadline was 15 s


# --- TCP specifics (one process: no peer involved) ------------------------------------------------
def _tcp_context(environ: dict[str, str]):
    from unittest.mock import patch

    from ddlcore.transports.tcp import TcpTransport

    from ddlcore.job.store import PrefixStore, StoreClient, StoreServer

    server = StoreServer("127.0.0.1", 0)
    client = StoreClient("127.0.0.1", server.port, 2.0, rank=0, size=2)
    try:
        with patch.dict("os.environ", environ):
            ctx = TcpTransport().create_context(0, 2, PrefixStore(client, "t/"), 2.0)
        address = client.get("t/tcp/addr/0").decode()
        ctx.close()
        return ctx, address
    finally:
        client.close()
        server.close()


def test_tcp_listens_on_the_interface_towards_the_master():
    ctx, address = _tcp_context({"DDL_SOCKET_IFNAME": ""})
    assert ctx.address == "127.0.0.1" and address == f"127.0.0.1:{ctx.port}"


def test_tcp_socket_ifname_picks_that_interface():
    ctx, _ = _tcp_context({"DDL_SOCKET_IFNAME": "lo"})
    assert ctx.address == "127.0.0.1"


def test_tcp_bad_socket_ifname_names_the_variable():
    with pytest.raises(ValueError, match="DDL_SOCKET_IFNAME='nosuchif0'.*interfaces here: .*lo"):
        _tcp_context({"DDL_SOCKET_IFNAME": "nosuchif0"})


def test_tcp_nchannels_must_agree():
    messages = run_ranks(
        conf.tcp_nchannels_mismatch,
        2,
        timeout=JOB_TIMEOUT_S,
        rank_envs={0: {"DDL_NCHANNELS": "1"}, 1: {"DDL_NCHANNELS": "2"}},
    )
    for message in messages:
        assert "DDL_NCHANNELS=1" in message and "DDL_NCHANNELS=2" in message, message


@pytest.mark.parametrize(
    "name,direct", [("tcp", "on"), ("shm", "on"), ("ucx", "on"), ("ucx", "off")]
)
def test_device_views(name, direct):
    """DDL_GPU_DIRECT=on: ucx pairs carry DeviceViews (host memory behind them here); tcp and
    shm never do, whatever it says. off: ucx pairs refuse them too."""
    require(*conf.transport_class(name).is_available())
    results = run_ranks(
        conf.device_views, 2, name, timeout=JOB_TIMEOUT_S, env={"DDL_GPU_DIRECT": direct}
    )
    takes = {flag for flag, _, _ in results}
    assert takes == {direct == "on" and name == "ucx"}, takes
    if name == "ucx" and direct == "on":
        # host messages into device receives: the small ones (in their header) always uploaded,
        # larger ones when they arrived first; nothing else, and never on the sending side
        uploads = results[1][1]
        eager = [n for n in conf.DEVICE_SIZES if 0 < n <= 4096]
        assert set(eager) <= set(uploads) <= {n for n in conf.DEVICE_SIZES if n}, uploads
        assert results[0][1] == []
        # each rank's progress thread made "the GPU" current once, before its first use
        for _, _, binds in results:
            assert len(binds) == 1 and binds[0].startswith("ddl-ucx-progress"), binds


@pytest.mark.parametrize("name", ["tcp", "ucx"])
def test_a_store_without_the_job_key_is_refused(name):
    """Transports that open their own connections prove the job's key on them: a store that
    carries none (made outside ddlcore.job.store) is refused at once, saying so."""
    require(*conf.transport_class(name).is_available())
    from ddlcore.errors import DDLError, RendezvousError
    from ddlcore.job.store import PrefixStore, StoreClient, StoreServer

    server = StoreServer("127.0.0.1", 0)
    client = StoreClient("127.0.0.1", server.port, 2.0, rank=0, size=2)
    try:
        store = PrefixStore(client, "t/")
        store.job_key = None
        with pytest.raises(DDLError, match=f"the {name.upper()} transport .* no job_key"):
            conf.transport_class(name)().create_context(0, 2, store, 2.0)
        with pytest.raises(RendezvousError):  # nothing was published
            client.get(f"t/{name}/addr/0", 0.1)
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("when", ["before", "after"])
def test_shm_peer_reaching_a_closing_inbox_hears_of_it(when):
    """A rank whose first message reaches a peer as it closes after an abort (the window
    between the peer's last look for new pairs and its inbox's removal) fails at once: told of
    the abort, or of the close; never by waiting out its deadline."""
    require(*conf.transport_class("shm").is_available())
    _, (name, message, elapsed) = pooled(conf.shm_attach_as_the_peer_closes, 2, when)
    if when == "before":
        assert name == "CollectiveMismatchError", message
        assert "the calls differ" in message, message
    else:
        assert name == "PeerFailureError", message
        assert "as that rank closed" in message, message
    assert elapsed < conf.TIMEOUT_S / 2, (elapsed, message)
