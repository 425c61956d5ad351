"""ddlrun's watchdog: one small process per local job that ends every rank's session when ddlrun
dies without ending them itself, even by SIGKILL.

    ddlrun --stdin pipe--> watchdog (own session)       rank r: session leader, pid = sid
           "sid\\n" per rank started, "end\\n" once done

The kernel kills each rank ddlrun forked when ddlrun exits (``PR_SET_PDEATHSIG``), but only that
process: a wrapper's program (``ddlrun -np 2 sh -c 'python train.py'``) or a rank's own children
would be left running, holding their shared memory. Nothing ddlrun does at its end runs after a
SIGKILL, and a subreaper's duty dies with it; so the watchdog is a separate process, started
before the ranks, in a session of its own (a signal to ddlrun's process group or terminal does
not reach it). It learns each rank's session id from ddlrun on its stdin, and the end of that
pipe is how it learns that ddlrun is gone, however it went: the kernel closes a dead process's
descriptors. It then SIGKILLs every process of those sessions (`sessions.kill_sessions`),
removes their shm segments, and exits. ddlrun's own end does the same, then says ``end``: the
watchdog exits without acting.
"""

from __future__ import annotations

import signal
import subprocess
import sys

from ddlcore.launcher.sessions import kill_sessions, remove_shared_memory

# Killed processes exit at once unless stuck in the kernel (D state); bounded all the same.
_KILL_TIMEOUT_S = 30.0
_EXIT_TIMEOUT_S = 10.0


class Watchdog:
    """ddlrun's handle on its watchdog process."""

    def __init__(self) -> None:
        """Start the watchdog; raises OSError if it cannot be started."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddlcore.launcher.watchdog"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,  # never ddlrun's pipes: a reader would wait for it
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _say(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:  # it died (killed by hand): the ranks still die with ddlrun's signals
            pass

    def watch(self, sid: int) -> None:
        """Add a rank's session to those ended if ddlrun dies."""
        self._say(str(sid))

    def release(self) -> None:
        """ddlrun has ended the sessions itself: let the watchdog exit, and reap it."""
        self._say("end")
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> int:
    """The watchdog process: read session ids until ``end`` (nothing to do) or the end of the
    pipe (ddlrun is gone: end the sessions)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe's end tells it to act
    sids: set[int] = set()
    for line in sys.stdin.buffer:
        word = line.strip()
        if word == b"end":
            return 0
        if word.isdigit():
            sids.add(int(word))
    if not sids:  # ddlrun died before it started a rank
        return 0
    killed = kill_sessions(sids, _KILL_TIMEOUT_S)
    remove_shared_memory(killed | sids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
