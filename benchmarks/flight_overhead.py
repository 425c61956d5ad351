"""What the flight recorder costs a small collective: back-to-back allreduces in one job, in
blocks that alternate the recorder off and on (ABBA order, both ranks switching together), so
that both halves see the same machine load; rank 0 prints the median call of each half, the
median of the paired block differences, and the recorder's own cost per call measured without
communication.

    ddlrun -np 2 python benchmarks/flight_overhead.py 4096 200 500

(bytes, blocks, calls per block; a fourth argument ``aa`` runs both halves with the recorder off,
which shows the method's own noise). Switching inside one process is what makes the comparison
fair on a shared machine; separate runs with DDL_FLIGHT_RECORDER_ENTRIES=0 differ by more than
the recorder costs.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import ddlcore
from ddlcore import calls, flight


def recorder_alone(n: int = 200_000) -> float:
    """Seconds per call the recording wrapper adds around a call that does nothing."""
    x = np.ones(1024, np.float32)
    call = calls.prepare("allreduce", x, "sum", x, 0, 2)

    def nothing(c: calls.Call, seq: int) -> None:
        return None

    wrapped = flight.FlightRecorder(0, 2, "bench", 1024).recording(nothing)
    best = []
    for fn in (nothing, wrapped):
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(n):
                fn(call, i)
            runs.append((time.perf_counter() - t0) / n)
        best.append(min(runs))
    return best[1] - best[0]


def main() -> None:
    nbytes, blocks, per_block = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    with ddlcore.init() as comm:
        recorded, bare = comm._execute_recorded, comm._execute
        if len(sys.argv) > 4 and sys.argv[4] == "aa":
            recorded = bare
        elif recorded == bare:
            raise SystemExit("DDL_FLIGHT_RECORDER_ENTRIES=0: nothing to compare")
        x = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
        y = np.empty_like(x)
        for _ in range(200):
            comm.allreduce(x, out=y)
        clock = time.perf_counter
        took = {False: [], True: []}
        block_medians = {False: [], True: []}
        for b in range(blocks):
            on = b % 4 in (1, 2)  # ABBA: drift in load cancels out
            comm._execute_recorded = recorded if on else bare
            comm.barrier()
            times = np.empty(per_block)
            for i in range(per_block):
                start = clock()
                comm.allreduce(x, out=y)
                times[i] = clock() - start
            took[on].append(times)
            block_medians[on].append(float(np.median(times)))
        comm._execute_recorded = recorded
        comm.barrier()
        if comm.rank == 0:
            off, on_ = np.concatenate(took[False]), np.concatenate(took[True])
            diff = np.array(block_medians[True]) - np.array(block_medians[False])
            q1, q3 = np.percentile(diff, [25, 75]) * 1e6
            print(
                f"{nbytes} B allreduce, {comm.size} ranks, {blocks} blocks of {per_block} "
                f"calls, path {comm.flight_record()['entries'][-1]['path']}"
            )
            for name, t in (("off", off), ("on: ", on_)):
                p10, p50, p90 = np.percentile(t, [10, 50, 90]) * 1e6
                print(f"  recorder {name} median {p50:.2f} us (p10 {p10:.2f}, p90 {p90:.2f})")
            rel = np.median(diff) / np.median(off)
            print(
                f"  on - off, paired block medians: median {np.median(diff) * 1e6:+.2f} us "
                f"({rel:+.1%}; quartiles {q1:+.2f} .. {q3:+.2f} us)"
            )
            print(f"  the recorder alone: {recorder_alone() * 1e9:.0f} ns per call")


if __name__ == "__main__":
    main()
