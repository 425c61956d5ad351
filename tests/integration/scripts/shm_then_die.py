"""Every rank joins over shared memory and allreduces once, records its shm segment, then rank 1
dies by SIGKILL (every rank, with argv[2] "all") while the others block in a second allreduce:
nobody closes cleanly, and the test checks that no segment outlives the job."""

import os
import signal
import sys

import numpy as np

import ddlcore

outdir = sys.argv[1]
comm = ddlcore.init()
comm.allreduce(np.ones(1000, np.float32))
names = [n for n in os.listdir("/dev/shm") if n.startswith(f"ddl-{os.getpid()}-")]
with open(os.path.join(outdir, f"{comm.rank}.shm"), "w") as f:
    f.write("\n".join(names))
comm.barrier()
if comm.rank == 1 or sys.argv[2:] == ["all"]:
    os.kill(os.getpid(), signal.SIGKILL)
comm.allreduce(np.ones(1000, np.float32))  # fails: rank 1 is gone
