"""Every rank records its pid, then sleeps (to be stopped by a signal to ddlrun)."""
import os
import sys
import time

with open(os.path.join(sys.argv[1], f"{os.environ['DDL_RANK']}.pid"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(60)
