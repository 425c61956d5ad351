"""Where a job's secret comes from (`job_secret`), first match wins: ``DDL_SECRET``; the file
named by ``DDL_SECRET_FILE`` (a regular file owned by this user or root that no one else can
read); otherwise a per-user secret kept in ``~/.config/ddlcore/secret`` (created 0600 on first
use), which every job of one user on one host (or on hosts sharing a home directory) shares.
ddlrun exports a fresh ``DDL_SECRET`` for each job (`new_secret`); under an MPI launcher, rank 0
draws one and broadcasts it over MPI with the store's address (``rendezvous``). What proves it
on a connection is ``auth``'s.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from ddlcore import config
from ddlcore.errors import DDLError

_SECRET_BYTES = 32


def _user_secret_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "ddlcore" / "secret"


def _user_secret() -> tuple[bytes, str]:
    """The per-user secret file's contents, creating it (0600, atomically) on first use."""
    path = _user_secret_path()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not path.exists():
            tmp = path.with_name(f".secret.{os.getpid()}.{secrets.token_hex(4)}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, secrets.token_hex(_SECRET_BYTES).encode() + b"\n")
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # fails if another rank created it first: theirs wins
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        return _read_secret_file(path, "the per-user secret"), str(path)
    except OSError as exc:
        raise DDLError(
            f"no job secret is set and the per-user secret {path} cannot be used ({exc}); set "
            "DDL_SECRET, or DDL_SECRET_FILE to a file only you can read (ddlrun and mpiexec "
            "provide one themselves)"
        ) from None


def _read_secret_file(path: Path, what: str) -> bytes:
    """The secret in ``path``, which must be a regular file owned by this user (or root) that no
    one else can read: a file another user made (in /tmp, say) is theirs to read or change."""
    fd = os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)  # of the file opened, not of whatever the name points at later
        if not stat.S_ISREG(st.st_mode):
            raise DDLError(f"{what} {path} is not a regular file")
        if st.st_uid not in (os.getuid(), 0):
            raise DDLError(
                f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): "
                "its owner can read or replace the secret; use a file of your own, made with "
                "umask 077"
            )
        if st.st_mode & 0o077:
            raise DDLError(
                f"{what} {path} can be read by other users (mode {st.st_mode & 0o777:o}); "
                f"run: chmod 600 {path}"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(1 << 16).strip()
    finally:
        os.close(fd)
    if not raw:
        raise DDLError(f"{what} {path} is empty")
    return raw


def job_secret(environ: Mapping[str, str] | None = None) -> tuple[bytes, str]:
    """The job's secret and where it came from (for messages: never the secret itself).

    Raises
    ------
    DDLError
        ``DDL_SECRET_FILE`` is unreadable, empty or readable by others; or no secret is set and
        the per-user secret cannot be created.
    """
    secret = config.get("DDL_SECRET", environ)
    if secret:
        return secret.encode(), "DDL_SECRET"
    path = config.get("DDL_SECRET_FILE", environ)
    if path:
        try:
            return _read_secret_file(Path(path), "DDL_SECRET_FILE"), f"DDL_SECRET_FILE={path}"
        except OSError as exc:
            raise DDLError(
                f"DDL_SECRET_FILE={path} cannot be read ({exc.strerror or exc})"
            ) from None
    return _user_secret()


def new_secret() -> str:
    """A fresh random secret, as launchers export it in ``DDL_SECRET``."""
    return secrets.token_hex(_SECRET_BYTES)
