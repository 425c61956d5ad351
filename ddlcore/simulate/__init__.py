"""The simulator: runs the SAME schedules the engine runs against a link model, to predict a
collective's time at scales this machine cannot run (e.g. 64 hosts x 4 GPUs in 4 racks).

What it models (the link model of `ddlcore.planning.tuning`, so the two can be compared):

* A message from rank a to rank b crosses box dimension j = ``topo.dim_between(a, b)``. It holds
  its ports for ``nbytes / bw[j]`` and then is in flight for ``lat[j]`` (latency occupies
  nothing): it arrives at ``start + nbytes / bw[j] + lat[j]``.
* Inside a host (j < ``topo.host_dims``) the ports are per rank and dimension: a's egress and b's
  ingress (point-to-point links, like NVLink). Across the network a message holds the egress
  port of a's network adapter and the ingress port of b's (``topo.adapter_of``): the ranks of a
  host share their adapters, which is the contention of concurrent rings.
* Ports are FIFO servers: messages reserve all their ports in the order they are issued (ties
  by rank) and start when every port is free; no backfilling, no fair sharing (a message that
  waits for its ingress port keeps its egress port idle and later messages behind it).
* Each rank executes its schedule in program order, as `ddlcore.execution.engine` does: ``SEND`` issues at
  the rank's current time and the rank goes on; ``RECV`` waits for the message's arrival;
  ``RECV_REDUCE`` waits, then keeps the rank busy ``nbytes / reduce_bw``; ``COPY`` keeps it busy
  ``nbytes / copy_bw``. A rank's reductions and copies are serial; its messages overlap them.
  A schedule with parts on several streams (mdring pipelined across dimensions) runs each
  stream as an actor of its own, as the engine runs each on a thread: a part starts once the
  parts it comes after have finished (their steps done, their sends out of the ports); each
  stream's reductions are serial, different streams' overlap.

What it does not model: packets, congestion control, switch or rack-uplink oversubscription
(a level is only a bandwidth and a latency per message), the engine's pipeline depth and staging
slots (every message is buffered at its receiver on arrival), write-after-send hazards, and
per-message software overhead beyond ``lat``.

It is a discrete-event simulation: a heap of actors (ranks, or streams of ranks) by their clock;
the earliest runs on while its clock stays the earliest, so messages claim ports in global
issue order. Schedules are
compiled to flat arrays first (`Program`), so the event loop creates no per-step objects.
Generating the schedules costs the algorithm modules ~10 us per step (the event loop ~3 us).
The flat ring and rhd at 4096 ranks have ~67M steps (12 and 19 min of CPU, 1.7 and 4 GB);
runs estimated above ``max_steps`` are refused with `TooLargeToSimulate` (the CLI prints NOT
SIMULATED and why, exit status 3; ``--max-steps 1e8`` runs them), never replaced by a formula.

The package: `ddlcore.simulate.program` compiles schedules into flat programs (and refuses those
over the step budget), `ddlcore.simulate.model` runs them against the link model, and
`ddlcore.simulate.cli` is the command line::

    python -m ddlcore.simulate --topology 4x16x4 --link-bw 20e9,10e9,9.5e9 \\
        --link-lat 5e-6,10e-6,20e-6 --bytes 100e6 --algo mdring [--adapters 4] [--json]
"""

from ddlcore.simulate.cli import PAPER_BW, PAPER_LAT, _floats, _report, main
from ddlcore.simulate.model import DimStats, Result, _check_complete, cyclic, execute, simulate
from ddlcore.simulate.program import (
    DEFAULT_CHUNK_BYTES,
    MAX_STEPS,
    Program,
    SimulationError,
    TooLargeToSimulate,
    compile_program,
    element_count,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_STEPS",
    "PAPER_BW",
    "PAPER_LAT",
    "DimStats",
    "Program",
    "Result",
    "SimulationError",
    "TooLargeToSimulate",
    "_check_complete",
    "_floats",
    "_report",
    "compile_program",
    "cyclic",
    "element_count",
    "execute",
    "main",
    "simulate",
]
