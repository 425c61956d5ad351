"""The rank's half of ddlrun's failure pipe: which rank failed first, as far as this rank knows.

ddlrun (`ddlcore.launcher.job`) names the write end of a pipe it holds in ``DDL_FAILURE_DIR``;
a rank whose collective fails writes one line there, and ddlrun names the rank that failed
first. Here, in the job layer, so that the communicator reports to its launcher without
importing the launcher.
"""

from __future__ import annotations

import os
import stat

from ddlcore import config
from ddlcore.errors import failure_origin


def record_failure(rank: int, exc: BaseException) -> None:
    """Called by a rank whose collective failed: tell ddlrun, through the pipe that
    ``DDL_FAILURE_DIR`` names (set by ddlrun; nothing to do without it), the rank that failed
    first as far as this rank knows: the peer a `PeerFailureError` names, the origin a relayed
    timeout or mismatch carries, else this rank. ddlrun keeps the first record of each rank."""
    where = config.get("DDL_FAILURE_DIR")
    if not where:
        return
    found = failure_origin(exc)
    origin = rank if found is None else found
    try:  # non-blocking: a full pipe or a gone ddlrun costs the record, never a hang
        fd = os.open(where, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ddlrun is gone (or this is not a ddlrun job's pipe)
        return
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.write(fd, f"{rank} {origin}\n".encode())  # one write under PIPE_BUF: atomic
    except OSError:
        pass
    finally:
        os.close(fd)
