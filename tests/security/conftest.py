"""A second local user for the security tests to play the attacker: ``ddlcore-stranger``, made
once with ``useradd`` where it is missing. The tests that need it skip, with the reason, where
the suite does not run as root or the user cannot be made."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

STRANGER = "ddlcore-stranger"

# How long one of the stranger's acts may take (a few file operations) on a busy machine.
_ACT_DEADLINE_S = 120.0


@dataclass(frozen=True)
class Stranger:
    """Another user of this machine. `run` does something as that user."""

    name: str
    uid: int
    gid: int

    def run(self, act: Callable[..., str | None], *args: Any) -> str:
        """``act(*args)`` in a child process that has dropped to this user's uid and gid (no
        supplementary groups); returns what it returned ("" for None). AssertionError with the
        child's traceback where it raised."""
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the test
            os.close(read)
            code = 1
            try:
                os.setgroups([])
                os.setgid(self.gid)
                os.setuid(self.uid)
                os.write(write, (act(*args) or "").encode())
                code = 0
            except BaseException:
                os.write(write, traceback.format_exc().encode())
            finally:
                os._exit(code)
        os.close(write)
        deadline = time.monotonic() + _ACT_DEADLINE_S
        try:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    raise AssertionError(
                        f"{self.name}'s act still running after {_ACT_DEADLINE_S} s"
                    )
                time.sleep(0.01)
            with os.fdopen(read, "rb") as f:
                out = f.read().decode(errors="replace")
            read = -1
        finally:
            if read != -1:
                os.close(read)
        if os.waitstatus_to_exitcode(status) != 0:
            raise AssertionError(f"{self.name}'s act failed:\n{out}")
        return out


def stranger_user() -> Stranger:
    """The stranger (made here where missing); pytest.skip where it cannot be."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test plays a second local user (useradd, setuid)")
    try:
        entry = pwd.getpwnam(STRANGER)
    except KeyError:
        useradd = shutil.which("useradd")
        if useradd is None:
            pytest.skip(f"needs useradd to make the local user {STRANGER}")
        made = subprocess.run(
            [useradd, "-M", "-s", "/usr/sbin/nologin", STRANGER],
            capture_output=True,
            text=True,
            timeout=_ACT_DEADLINE_S,
        )
        try:
            entry = pwd.getpwnam(STRANGER)  # made now, or by a run at the same time
        except KeyError:
            pytest.skip(f"useradd {STRANGER} failed: {made.stderr.strip()}")
    return Stranger(STRANGER, entry.pw_uid, entry.pw_gid)


@pytest.fixture(scope="session")
def stranger() -> Stranger:
    """Another local user (see `Stranger`)."""
    return stranger_user()


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A fresh folder both users can reach (pytest's own tmp_path is the owner's only), as
    /tmp and /dev/shm are: anyone may create in it, nobody may remove what is another's."""
    folder = Path(tempfile.mkdtemp(prefix="ddlcore-security-"))
    try:
        folder.chmod(0o1777)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
