"""Prints the rendezvous variables a rank was started with."""

import os

keys = [
    "DDL_RANK",
    "DDL_SIZE",
    "DDL_LOCAL_RANK",
    "DDL_LOCAL_SIZE",
    "DDL_MASTER_ADDR",
    "DDL_MASTER_PORT",
    "DDL_TRANSPORT",
    "DDL_TIMEOUT",
    "PMI_RANK",
]
line = " ".join(f"{k}={os.environ.get(k, '-')}" for k in keys) + "\n"
# one write of the whole line: mpiexec forwards what it reads, so a line written in pieces can
# be interleaved with another rank's line
os.write(1, line.encode())
