"""Every rank joins over shared memory, allreduces once, records its pid and its shm segments
(``<rank>.pid``, ``<rank>.shm`` in argv[1], each written whole), then sleeps: a job to kill from
outside, checking what it leaves behind."""

import os
import sys
import time

import numpy as np

import ddlcore

outdir = sys.argv[1]
comm = ddlcore.init()
comm.allreduce(np.ones(1000, np.float32))
names = [n for n in os.listdir("/dev/shm") if n.startswith(f"ddl-{os.getpid()}-")]
for suffix, text in (("shm", "\n".join(names)), ("pid", str(os.getpid()))):
    path = os.path.join(outdir, f"{comm.rank}.{suffix}")
    with open(path + ".part", "w") as f:
        f.write(text)
    os.replace(path + ".part", path)  # the test polls for these: never half made
time.sleep(120)
