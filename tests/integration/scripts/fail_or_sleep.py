"""Rank 1 exits with code 3 (or dies by SIGKILL with "kill"); the others record their pid and
sleep, so the test can check that ddlrun stopped them."""

import os
import signal
import sys
import time

rank = int(os.environ["DDL_RANK"])
mode, piddir = sys.argv[1], sys.argv[2]
if rank == 1:
    # Fail once every other rank is up (has written its pid), not after a guess at how long
    # that takes: on a loaded machine, starting Python takes seconds.
    others = [
        os.path.join(piddir, f"{r}.pid") for r in range(int(os.environ["DDL_SIZE"])) if r != rank
    ]
    deadline = time.monotonic() + 60
    while not all(os.path.exists(p) for p in others) and time.monotonic() < deadline:
        time.sleep(0.01)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
with open(os.path.join(piddir, f"{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(piddir, f"{rank}.tmp"), os.path.join(piddir, f"{rank}.pid"))
print("sleeping", flush=True)
time.sleep(60)
