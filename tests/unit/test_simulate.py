"""The simulator (`ddlcore.simulate`): exact times on hand-made schedules, port contention, errors
instead of hangs, the CLI, and agreement with the cost model (`ddlcore.planning.tuning`) it shares its
link model with.

The cost model and the simulator agree on every box here; the gaps they showed were fixed in the
model (slowest-hop latency, overlapped reductions) and in the ring's emission order (2-rank rings
alternated transfer and reduction until a chunk's first send went out before the previous chunk's
reduction).
"""

from __future__ import annotations

import json
import math

import pytest

from ddlcore import simulate, topology
from ddlcore.algorithms import ALGORITHMS, Buf, Kind, Schedule, Step
from ddlcore.planning import tuning

BW, LAT = 10e9, 10e-6
NB = 1_000_000  # bytes of one hand-made message


def _sched(rank: int, size: int, *steps: Step) -> Schedule:
    return Schedule("allreduce", "hand", rank, size, 0, 1, tuple(steps))


def send(peer: int, count: int, slot: int = 0) -> Step:
    return Step(Kind.SEND, peer, slot, count)


def recv(peer: int, count: int, slot: int = 0, reduce: bool = False) -> Step:
    return Step(
        Kind.RECV_REDUCE if reduce else Kind.RECV, peer, slot, count, Buf.INPUT, 0, Buf.OUTPUT, 0
    )


def run(schedules: list[list[Step]], topo: topology.Topology, reduce_bw: float = 8e9):
    size = len(schedules)
    prog = simulate.Program.from_schedules(
        [_sched(r, size, *steps) for r, steps in enumerate(schedules)], size, 1
    )
    return simulate.execute(prog, topo, reduce_bw=reduce_bw)


@pytest.mark.parametrize("level", ["host", "network"])
@pytest.mark.parametrize("reduce", [False, True])
def test_one_message_takes_latency_plus_bytes_over_bandwidth(level, reduce):
    topo = topology.box((2,), (BW,), (LAT,), levels=(level,))
    time_s, finish, dims = run([[send(1, NB)], [recv(0, NB, reduce=reduce)]], topo, reduce_bw=4e9)
    expect = LAT + NB / BW + (NB / 4e9 if reduce else 0.0)
    assert time_s == pytest.approx(expect, rel=1e-12)
    assert finish[0] == 0.0  # a send does not block its rank
    assert (dims[0].bytes_per_rank, dims[0].messages) == (NB, 1)
    assert dims[0].busy_s == pytest.approx(NB / BW, rel=1e-12)


def test_copy_costs_copy_bandwidth():
    topo = topology.box((1,), (BW,), (LAT,))
    copy = Step(Kind.COPY, -1, 0, NB, Buf.INPUT, 0, Buf.OUTPUT, 0)
    prog = simulate.Program.from_schedules([_sched(0, 1, copy)], 1, 1)
    assert simulate.execute(prog, topo, copy_bw=2e9)[0] == pytest.approx(NB / 2e9)


@pytest.mark.parametrize("adapters, factor", [(1, 2), (2, 1)])
def test_ranks_of_a_host_share_its_network_adapter(adapters, factor):
    """2 hosts x 2 ranks: ranks 0 and 1 (host 0) send to ranks 2 and 3 (host 1) at once."""
    topo = topology.box((2, 2), (100e9, BW), (1e-6, LAT), adapters=adapters)
    time_s, finish, _ = run([[send(2, NB)], [send(3, NB)], [recv(0, NB)], [recv(1, NB)]], topo)
    assert time_s == pytest.approx(LAT + factor * NB / BW, rel=1e-12)
    alone, _, _ = run([[send(2, NB)], [], [recv(0, NB)], []], topo)
    assert alone == pytest.approx(LAT + NB / BW, rel=1e-12)


def test_links_inside_a_host_are_per_rank():
    topo = topology.box((4,), (BW,), (LAT,), levels=("host",))
    time_s, _, _ = run([[send(1, NB)], [recv(0, NB)], [send(3, NB)], [recv(2, NB)]], topo)
    assert time_s == pytest.approx(LAT + NB / BW, rel=1e-12)
    # Two senders into one rank share its ingress port.
    time_s, _, _ = run([[send(1, NB)], [recv(0, NB), recv(2, NB)], [send(1, NB)], []], topo)
    assert time_s == pytest.approx(LAT + 2 * NB / BW, rel=1e-12)


def test_deadlock_is_an_error_not_a_hang():
    topo = topology.box((2,), (BW,), (LAT,))
    with pytest.raises(
        simulate.SimulationError, match="deadlock.*rank 0 at step 0 waits for rank 1"
    ):
        run([[recv(1, NB), send(1, NB)], [recv(0, NB), send(0, NB)]], topo)


def test_unmatched_message_and_size_mismatch_are_errors():
    topo = topology.box((2,), (BW,), (LAT,))
    with pytest.raises(simulate.SimulationError, match="never received: rank 0 -> rank 1 slot 5"):
        run([[send(1, NB, slot=5)], []], topo)
    with pytest.raises(simulate.SimulationError, match="expects 10 bytes"):
        run([[send(1, NB)], [recv(0, 10)]], topo)
    with pytest.raises(simulate.SimulationError, match="twice"):
        run([[send(1, NB), send(1, NB)], [recv(0, NB), recv(0, NB)]], topo)
    with pytest.raises(simulate.SimulationError, match="bad peer"):
        run([[send(7, NB)], []], topo)


# --- the library's schedules --------------------------------------------------------------------

BOXES = {
    "2x2": ((2, 2), (20e9, 10e9), (5e-6, 10e-6)),
    "4x2": ((4, 2), (20e9, 10e9), (5e-6, 10e-6)),
    "2x2x2": ((2, 2, 2), (20e9, 10e9, 9.5e9), (5e-6, 10e-6, 20e-6)),
}
LARGE, SMALL = 64e6, 4096


def _box(name: str, adapters: int = 1) -> topology.Topology:
    dims, bw, lat = BOXES[name]
    return topology.box(dims, bw, lat, adapters=adapters)


@pytest.mark.parametrize("collective", tuning.SELECTABLE)
@pytest.mark.parametrize("algo", ["ring", "mdring", "rhd", "auto"])
@pytest.mark.parametrize("box", ["2x2", "2x2x2"])
def test_every_collective_runs_to_completion(collective, algo, box):
    res = simulate.simulate(collective, algo, _box(box), 1e6)
    assert res.time_s > 0 and res.steps > 0
    if algo == "auto":
        choice = tuning.choose(collective, _box(box), int(1e6), "auto", 1 << 20)
        assert res.algorithm == choice.algorithm


CASES = [
    pytest.param(
        algo,
        box,
        contended,
        nbytes,
        id=f"{algo}-{box}-{'cont' if contended else 'unc'}-"
        f"{'large' if nbytes == LARGE else 'small'}",
    )
    for algo in ("ring", "mdring", "rhd")
    for box in BOXES
    for contended in (True, False)
    for nbytes in (LARGE, SMALL)
]


@pytest.mark.parametrize("algo, box, contended, nbytes", CASES)
def test_agrees_with_cost_model(algo, box, contended, nbytes):
    """Within 15% with the default reduction speed (11% at worst: the flat ring on 2x2 and 4x2
    with large messages); contended: one adapter per host, uncontended: one per rank."""
    topo = _box(box, adapters=1 if contended else BOXES[box][0][0])
    res = simulate.simulate("allreduce", algo, topo, nbytes)
    assert res.time_s == pytest.approx(res.predicted_s, rel=0.15)


@pytest.mark.parametrize("algo", ["ring", "mdring", "rhd"])
@pytest.mark.parametrize("box", list(BOXES))
@pytest.mark.parametrize("contended", [True, False])
def test_agrees_with_cost_model_on_links_alone(algo, box, contended):
    """Without reduction cost, large messages: the bandwidth terms (incl. contention) agree."""
    topo = _box(box, adapters=1 if contended else BOXES[box][0][0])
    res = simulate.simulate("allreduce", algo, topo, LARGE, reduce_bw=1e30)
    assert res.time_s == pytest.approx(res.predicted_s, rel=0.12)


@pytest.mark.parametrize("box", list(BOXES))
def test_tiny_ring_takes_its_critical_path_of_hop_latencies(box):
    """The simulator's side of the first known gap: a tiny ring allreduce is its critical path,
    2(P-1) consecutive hops (the slowest such run of the ring), not 2(P-1) slowest hops."""
    topo = _box(box)
    p = topo.size
    hops = [topo.lat[topo.dim_between(topo.order[i], topo.order[(i + 1) % p])] for i in range(p)]
    path = max(sum(hops[(s + i) % p] for i in range(2 * (p - 1))) for s in range(p))
    res = simulate.simulate("allreduce", "ring", topo, 4 * p, reduce_bw=1e30)
    assert res.time_s == pytest.approx(path, rel=1e-3)
    assert path < 0.8 * 2 * (p - 1) * max(hops)


def test_pipelined_ring_overlaps_reduction_with_transfer():
    """The simulator's side of the second: the ring's time is set by its busiest resource."""
    topo = _box("2x2")
    res = simulate.simulate("allreduce", "ring", topo, LARGE, reduce_bw=8e9)
    link = 2 * 3 * (LARGE / 4) / 10e9
    assert link <= res.time_s <= 1.05 * link  # reductions: 3 * 16 MB / 8 GB/s = 0.6 * link


def test_mdring_sends_fewer_bytes_across_hosts_than_ring():
    topo = topology.box((4, 4), (20e9, 10e9), (5e-6, 10e-6))
    ring = simulate.simulate("allreduce", "ring", topo, LARGE)
    md = simulate.simulate("allreduce", "mdring", topo, LARGE)
    # Per host: mdring's 4 ranks each send 2 (3/4) n/4 across hosts, the ring's one boundary
    # rank 2 (15/16) n: per adapter nearly the same (1.5 n vs 1.875 n), per rank 4x less.
    assert md.dims[1].bytes_per_rank * 4 <= ring.dims[1].bytes_per_rank * 0.81
    assert md.dims[1].messages < ring.dims[1].messages
    # With one adapter per rank, the network phase runs 4 rings at once at full speed.
    uncontended = topology.box((4, 4), (20e9, 10e9), (5e-6, 10e-6), adapters=4)
    assert (
        simulate.simulate("allreduce", "mdring", uncontended, LARGE, reduce_bw=1e30).time_s
        < simulate.simulate("allreduce", "ring", uncontended, LARGE, reduce_bw=1e30).time_s
    )


def test_too_large_is_refused_not_approximated():
    topo = _box("2x2x2")
    with pytest.raises(simulate.TooLargeToSimulate, match="steps"):
        simulate.simulate("allreduce", "ring", topo, 1e6, max_steps=10)


# --- the command line ---------------------------------------------------------------------------


def test_cli_json(capsys):
    argv = [
        "--topology",
        "4x2x2",
        "--link-bw",
        "20e9,10e9,9.5e9",
        "--link-lat",
        "5e-6,10e-6,20e-6",
        "--bytes",
        "1e6",
        "--algo",
        "mdring",
        "--adapters",
        "2",
        "--json",
    ]
    assert simulate.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["simulated"] is True and out["time_s"] > 0 and math.isfinite(out["predicted_s"])
    assert out["algorithm"] == "mdring" and out["ranks"] == 16 and out["adapters"] == 2
    assert [d["size"] for d in out["dims"]] == [4, 2, 2]
    assert out["busbw"] == pytest.approx(out["algbw"] * 2 * 15 / 16)


def test_cli_text_and_refusal(capsys):
    assert simulate.main(["--topology", "2x2", "--bytes", "1e5", "--algo", "rhd"]) == 0
    text = capsys.readouterr().out
    assert "via rhd" in text and "cost model" in text and "busiest port" in text
    assert simulate.main(["--topology", "4x4", "--algo", "ring", "--max-steps", "100"]) == 3
    assert "NOT SIMULATED" in capsys.readouterr().out
    argv = ["--topology", "4x4", "--algo", "ring", "--max-steps", "100", "--json"]
    assert simulate.main(argv) == 3
    out = json.loads(capsys.readouterr().out)
    assert out["simulated"] is False and out["time_s"] is None and "steps" in out["reason"]


def test_cli_bad_arguments_name_them(capsys):
    with pytest.raises(SystemExit):
        simulate.main(["--topology", "4xq"])
    assert "--topology" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate.main(["--algo", "tree"])
    assert "--algo" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate.main(["--topology", "4x4", "--link-bw", "1,2,3"])
    assert "--link-bw" in capsys.readouterr().err


def test_schedules_are_the_librarys():
    topo = _box("4x2")
    prog = simulate.compile_program("allreduce", "mdring", topo, 1e5)
    steps = sum(
        len(ALGORITHMS["allreduce"]["mdring"](r, 8, 25_000, 4, 1 << 20, topo).steps)
        for r in range(8)
    )
    assert prog.steps == steps and prog.algorithm == "mdring"


def test_cyclic_placement_slows_the_rank_ordered_ring_not_mdring(capsys):
    """--placement cyclic: the flat ring (rank order) crosses the network on every hop and
    shares each host's adapter among its ranks; mdring follows the box and does not care."""
    times = {}
    for placement in ("block", "cyclic"):
        for algo in ("ring", "mdring"):
            assert (
                simulate.main(
                    [
                        "--topology",
                        "4x2",
                        "--link-bw",
                        "20e9,1.25e8",
                        "--bytes",
                        "16e6",
                        "--algo",
                        algo,
                        "--placement",
                        placement,
                        "--json",
                    ]
                )
                == 0
            )
            times[placement, algo] = json.loads(capsys.readouterr().out)["time_s"]
    assert times["cyclic", "mdring"] == pytest.approx(times["block", "mdring"], rel=1e-9)
    assert times["cyclic", "ring"] > 3 * times["block", "ring"], times
    assert times["cyclic", "ring"] > 4 * times["cyclic", "mdring"], times
    topo = simulate.cyclic(topology.box([4, 2], [20e9, 1e9], [1e-6, 1e-5]))
    assert [topo.node_of(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
