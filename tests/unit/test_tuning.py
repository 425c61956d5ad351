"""The cost model and the algorithm choice: the shape of the predictions, not their numbers."""

from __future__ import annotations

import pytest

from ddlcore import topology
from ddlcore.planning import tuning


def _two_level(hosts=2, per_host=4, net_bw=125e6):
    return topology.box((per_host, hosts), [5e9, net_bw], [15e-6, 50e-6])


def test_mdring_wins_large_messages_on_a_slow_network():
    topo = _two_level()
    best = tuning.choose("allreduce", topo, 64 << 20, "auto", 1 << 20)
    assert best.algorithm == "mdring" and best.dim_order == (0, 1)
    ring = tuning.predict("allreduce", "ring", topo, 64 << 20)
    assert ring / best.predicted_s > 1.5  # 2 (8-1)/8 n vs 2 (2-1)/2 n through each adapter
    # Halving-doubling, nearest partners first, puts the same bytes on the network, but one
    # phase after another: mdring, pipelined across the dimensions, hides its host phases.
    rhd = tuning.predict("allreduce", "rhd", topo, 64 << 20)
    unpipelined = tuning.predict("allreduce", "mdring", topo, 64 << 20, (0, 1))
    assert best.segments > 1
    assert abs(rhd / unpipelined - 1) < tuning.TIE
    assert rhd > best.predicted_s * (1 + tuning.TIE)


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 4 << 20, 16 << 20])
@pytest.mark.parametrize(
    "topo, led",
    [
        (_two_level(), True),  # 1 Gbit/s network, 5 GB/s in the host
        (topology.box((4, 2), [20e9, 10e9], [5e-6, 10e-6]), False),  # the paper's links
    ],
)
def test_pipelined_segments_hold_several_chunks(chunk_bytes, topo, led):
    """A segment holds SEGMENT_CHUNKS chunks (the device path's larger chunks take fewer,
    larger segments), and MIN_SEGMENT_BYTES too unless one link leads the pipeline by LEAD,
    whatever the model would otherwise pick."""
    chunks = tuning.SEGMENT_CHUNKS * chunk_bytes
    smallest = chunks if led else max(tuning.MIN_SEGMENT_BYTES, chunks)
    for nbytes in (16 << 20, 64 << 20, 256 << 20, 1 << 30):
        assert (tuning.pipeline_lead(topo, nbytes / 64, (0, 1)) >= tuning.LEAD) == led
        counts = tuning.segment_counts(
            nbytes, chunk_bytes, lambda m: tuning.pipeline_lead(topo, m, (0, 1))
        )
        assert counts == [s for s in tuning.SEGMENT_COUNTS if s == 1 or nbytes / s >= smallest]
        best = tuning.choose("allreduce", topo, nbytes, "auto", chunk_bytes)
        assert best.segments in counts
        assert best.segments == 1 or nbytes / best.segments >= smallest


def test_a_led_pipeline_takes_smaller_segments():
    """On a slow network the segments queue behind it as the model says, and more of them
    hide more of the host phases: 16 MiB in 4 segments, not the 2 of 8 MiB a balanced
    pipeline would be held to."""
    topo = _two_level(hosts=2, per_host=2)
    assert tuning.segment_counts(16 << 20, 1 << 20) == [1, 2]
    best = tuning.choose("allreduce", topo, 16 << 20, "auto", 1 << 20)
    assert best.algorithm == "mdring" and best.segments == 4


def test_small_messages_take_the_fewest_steps():
    topo = topology.box((8,), [5e9], [15e-6], ["host"])
    assert tuning.choose("allreduce", topo, 64, "auto", 1 << 20).algorithm == "rd"
    assert tuning.choose("allgather", topo, 64, "auto", 1 << 20).algorithm == "rhd"
    # Not a power of two: halving-doubling pays 2n for its fold; the ring moves the least.
    topo = topology.box((6,), [5e9], [15e-6], ["host"])
    assert tuning.choose("allreduce", topo, 256 << 20, "auto", 1 << 20).algorithm == "ring"


def test_a_flat_box_ties_mdring_with_ring_and_takes_ring():
    topo = topology.box((6,), [5e9], [15e-6], ["host"])
    assert tuning.choose("reduce_scatter", topo, 1 << 26, "auto", 1 << 20).algorithm == "ring"


@pytest.mark.parametrize("collective", tuning.SELECTABLE)
def test_named_algorithm_is_used_and_rd_falls_back(collective):
    topo = _two_level()
    assert tuning.choose(collective, topo, 1000, "rhd", 4096).algorithm == "rhd"
    got = tuning.choose(collective, topo, 1000, "rd", 4096).algorithm
    assert got == (
        "rd"
        if collective == "allreduce"
        else tuning.choose(collective, topo, 1000, "auto", 4096).algorithm
    )


def test_unknown_algorithm_names_the_variable():
    with pytest.raises(ValueError, match="DDL_ALGO='tree'"):
        tuning.validate_algo("tree")


def test_time_grows_with_bytes_and_latency_with_steps():
    topo = _two_level(hosts=4)
    for algo in ("ring", "mdring", "rhd", "rd"):
        small = tuning.predict("allreduce", algo, topo, 1e3)
        assert tuning.predict("allreduce", algo, topo, 1e7) > small > 0
    assert tuning.predict("allreduce", "rd", topo, 8) < tuning.predict("allreduce", "ring", topo, 8)


def test_adapters_per_rank_remove_the_sharing():
    shared = topology.box((4, 4), [20e9, 10e9], [5e-6, 10e-6])
    own = topology.box((4, 4), [20e9, 10e9], [5e-6, 10e-6], adapters=4)
    a = tuning.predict("allreduce", "mdring", shared, 1e8)
    b = tuning.predict("allreduce", "mdring", own, 1e8)
    assert a > 1.4 * b  # the network phase: 4 flows share one adapter, or each has its own


def test_choice_describes_itself():
    c = tuning.choose("allreduce", _two_level(), 1 << 24, "mdring", 1 << 20)
    assert "mdring" in c.describe() and "0,1" in c.describe() and "predicted" in c.describe()
