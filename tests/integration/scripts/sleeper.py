"""Every rank records its pid, then sleeps (to be stopped by a signal to ddlrun). Further
arguments name signals the rank ignores (e.g. SIGINT SIGTERM: only SIGKILL stops it)."""

import os
import signal
import sys
import time

for name in sys.argv[2:]:
    signal.signal(getattr(signal, name), signal.SIG_IGN)
# Written whole, then renamed: the test polls for *.pid and must never read a file half made.
path = os.path.join(sys.argv[1], f"{os.environ['DDL_RANK']}.pid")
with open(path + ".part", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".part", path)
time.sleep(60)
