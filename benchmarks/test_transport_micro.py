"""pytest-benchmark micro-benchmarks of the transports' point-to-point path.

    python -m pytest benchmarks/test_transport_micro.py --benchmark-columns=median,ops

Both ends of one pair live in this process (two contexts of a two-rank world, each with its
own store client), so a round is: post the receive on one end, send on the other, wait both.
That isolates the transport's own cost (queues, progress threads, copies) from process
scheduling; `benchmarks/p2p.py` measures the same between two processes. Each case prints the
bandwidth it reached and its ratio to this host's single-thread memory copy.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from membw import best_seconds  # benchmarks/ is the script's directory

from ddlcore import transports
from ddlcore.job.store import PrefixStore, StoreClient, StoreServer

SIZES = [4 << 10, 1 << 20, 64 << 20]


def _copy_gbps(nbytes: int) -> float:
    a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    return nbytes / best_seconds(lambda: np.copyto(b, a), 5) / 1e9


@pytest.fixture(scope="module", params=["shm", "tcp", "ucx"])
def pair_of_contexts(request):
    name = request.param
    ok, why = transports.load(name).is_available()
    if not ok:
        pytest.skip(why)
    server = StoreServer("127.0.0.1", 0)
    clients = [StoreClient("127.0.0.1", server.port, 10.0, rank=r, size=2) for r in range(2)]
    cls = transports.load(name)
    contexts = []

    def make(rank: int) -> None:
        contexts.append(
            (rank, cls().create_context(rank, 2, PrefixStore(clients[rank], "m/"), 10.0))
        )

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    ctx = dict(contexts)
    pairs = (ctx[0].pair(1), ctx[1].pair(0))
    yield name, pairs
    for c in ctx.values():
        c.close()
    for c in clients:
        c.close()
    server.close()


@pytest.mark.parametrize("nbytes", SIZES, ids=lambda n: f"{n >> 10}KiB")
def test_send_recv(benchmark, pair_of_contexts, nbytes):
    name, (p0, p1) = pair_of_contexts
    src = np.ones(nbytes, np.uint8)
    dst = np.empty(nbytes, np.uint8)
    dst.fill(0)

    def one_message() -> None:
        r = p1.irecv(memoryview(dst), 5)
        p0.isend(memoryview(src), 5).wait(30)
        r.wait(30)

    benchmark(one_message)
    gbps = nbytes / benchmark.stats.stats.median / 1e9
    print(f"\n{name} {nbytes} B: {gbps:.2f} GB/s, {gbps / _copy_gbps(nbytes):.0%} of one memcpy")
    assert np.array_equal(dst[:16], src[:16])
