"""A stranger that reaches a rank's UCX worker cannot be heard as a rank: forged control messages
(old format, wrong tokens, oversized, ABORT, CLOSE) and payloads on guessed tags are dropped, the
job's results stay bit-exact and no rank fails.

The stranger is stronger than a real one: it is handed the victim's worker address (a real one
would have to find the UCX port and forge an address; the job's address is only in the
authenticated store). It runs its own UCX worker in a spawned process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import threading
import time

from tests.harness import require, run_ranks
from tests.security.test_tcp import SIZES, _allreduce, _publish, _wait_for
from tests.transports.conformance import rank_env

JOB_TIMEOUT_S = 120.0
STEPS = 2000


def job(rank: int, size: int, workdir: str, steps: int, timeout: float) -> dict:
    with rank_env(rank, size, "ucx", timeout) as env:
        ctx = env.context("sec")
        _publish(workdir, f"addr{rank}", ctx._worker.address.tobytes().hex())
        _wait_for(workdir, "go")
        pair = ctx.pair(1 - rank)
        for step in range(steps):
            _allreduce(pair, rank, step, timeout)
        _wait_for(workdir, "done")
        _allreduce(pair, rank, steps, timeout)  # still fine after the last forged message
        env.barrier("end")
        return {"forged": ctx.forged}


def stranger(workdir: str, victim: int, claimed: int) -> None:
    """Spray forged messages at ``victim``'s worker, claiming to be rank ``claimed``."""
    from ddlcore.transports import ucx

    lib, Array = ucx._import_ucxx()
    context = lib.UCXContext(ucx.ucx_options(), ucx._features(lib))
    worker = lib.UCXWorker(context)
    address = lib.UCXAddress.create_from_buffer(bytes.fromhex(_wait_for(workdir, f"addr{victim}")))
    ep = worker.create_endpoint_from_worker_address(address, True)
    ctrl = lib.UCXXTag(ucx._ucx_tag(ucx._CTRL_KIND, claimed, 0))
    header = ucx._HEADER
    inflight: list = []
    parked: list = []  # payloads nobody will receive: a rendezvous send of one never completes

    def send(frame: bytes, tag, wait: bool = True) -> None:
        buf = bytearray(frame)
        (inflight if wait else parked).append((ep.tag_send(Array(buf), tag), buf))
        worker.progress()

    def flush() -> None:
        deadline = time.monotonic() + 30.0
        while not all(r.completed for r, _ in inflight) and time.monotonic() < deadline:
            worker.progress()
        inflight.clear()

    def spray(rounds: int) -> None:
        for k in range(rounds):
            n = SIZES[k % len(SIZES)] * 8
            eager = n <= ucx._EAGER_BYTES
            garbage = os.urandom(min(n, ucx._EAGER_BYTES)) if eager else b""
            kind = ucx._DATA
            # protocol 2's header (no token) with the job's tag and size
            send(header.pack(kind, 2, 0, 7, n, k) + garbage, ctrl)
            # protocol 3's, with a random token
            send(
                os.urandom(ucx._TOKEN_BYTES)
                + header.pack(kind, ucx.PROTOCOL_VERSION, 0, 7, n, k)
                + garbage,
                ctrl,
            )
            if not eager:  # the payload on the tag protocol 2 would have used, and a random one
                send(
                    os.urandom(n),
                    lib.UCXXTag(ucx._ucx_tag(ucx._PAYLOAD_KIND, claimed, k)),
                    wait=False,
                )
                send(
                    os.urandom(n),
                    lib.UCXXTag(
                        int.from_bytes(os.urandom(8), "little")
                        | (ucx._PAYLOAD_KIND << ucx._KIND_SHIFT)
                    ),
                    wait=False,
                )
            if k % 50 == 0:
                reason = b"a stranger says stop"
                for body in (
                    header.pack(ucx._ABORT, ucx.PROTOCOL_VERSION, 0, 0, len(reason), 0) + reason,
                    header.pack(ucx._CLOSE, ucx.PROTOCOL_VERSION, 0, 0, 0, 0),
                ):
                    send(body, ctrl)
                    send(os.urandom(ucx._TOKEN_BYTES) + body, ctrl)
                send(os.urandom(20_000), ctrl)  # over the control cap
                send(os.urandom(5), ctrl)  # under a header
                flush()
        flush()

    spray(200)  # before the job's first message
    _publish(workdir, "go", "")
    spray(600)  # while it runs
    _publish(workdir, "done", "")
    inflight += parked
    ep.close_blocking()


def test_stranger_at_the_ucx_worker_is_not_heard(tmp_path):
    from ddlcore.transports.ucx import UcxTransport

    require(*UcxTransport.is_available())
    workdir = str(tmp_path)
    env = {"DDL_SECRET": secrets.token_hex(16)}
    proc = None
    results: list = []

    def attack() -> None:
        nonlocal proc
        _wait_for(workdir, "addr1")
        proc = mp.get_context("spawn").Process(target=stranger, args=(workdir, 1, 0), daemon=True)
        proc.start()

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    try:
        results = run_ranks(job, 2, workdir, STEPS, 30.0, timeout=JOB_TIMEOUT_S, env=env)
    finally:
        attacker.join(10)
        if proc is not None:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert proc is not None and proc.exitcode == 0, "the stranger did not finish its spray"
    print(f"forged control messages dropped by the victim: {results[1]['forged']}")
    assert results[1]["forged"] >= 2 * 800, results  # each DATA pair at least
    assert results[0]["forged"] == 0, results
