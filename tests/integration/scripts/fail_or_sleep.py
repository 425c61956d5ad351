"""Rank 1 exits with code 3 (or dies by SIGKILL with "kill"); the others record their pid and
sleep, so the test can check that ddlrun stopped them."""
import os
import signal
import sys
import time

rank = int(os.environ["DDL_RANK"])
mode, piddir = sys.argv[1], sys.argv[2]
if rank == 1:
    time.sleep(0.5)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
with open(os.path.join(piddir, f"{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
print("sleeping", flush=True)
time.sleep(60)
