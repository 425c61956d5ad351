"""The README's form, ``with ddlcore.init() as comm:``; rank 1 fails after the first collective
(argv[1]: "raise" a ValueError, or "exit" with sys.exit(7)) while the others enter a second one
and fail with a PeerFailureError naming rank 1, often before rank 1 has finished exiting."""

import sys

import numpy as np

import ddlcore

with ddlcore.init() as comm:
    comm.allreduce(np.arange(10, dtype=np.float64))
    if comm.rank == 1:
        if sys.argv[1] == "raise":
            raise ValueError("rank 1 fails on its own")
        sys.exit(7)
    comm.allreduce(np.arange(10, dtype=np.float64))
