"""A rank program: before rank 0 serves the store, rank 1 tries to take the store's port on
the store's address (what another process could do between a launcher's choice of a free port
and rank 0's bind); then every rank joins and runs an allreduce."""

import errno
import os
import socket
import sys
import time

import numpy as np

import ddlcore

rank = int(os.environ["DDL_RANK"])
addr, port = os.environ["DDL_MASTER_ADDR"], int(os.environ["DDL_MASTER_PORT"])
if rank == 1:
    try:
        socket.create_server((addr, port)).close()
        print("port-taken-by-another-process")
        sys.exit(3)
    except OSError as exc:
        print("port-held" if exc.errno == errno.EADDRINUSE else f"bind-error {exc}")
else:
    print(f"store-sockets={os.environ.get('DDL_STORE_SOCKETS', '')}")
    time.sleep(0.5)  # let rank 1 try first
with ddlcore.init(timeout=60) as comm:
    y = comm.allreduce(np.ones(5, np.float32))
    print(f"sum={y[0]:g}")
