"""Directories only this user can write: where ddlcore keeps what another local user must not
forge, block or redirect (flight records, the CPU claims of ``DDL_BIND``).

`open_private_dir` makes a missing directory 0700 and opens it without following a symlink in
its place; it accepts a real directory owned by this user that nobody else can write, and gives
back its descriptor, so that what is written next is written relative to the directory checked
(``dir_fd``), never to whatever the name points at later.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from ddlcore.errors import DDLError


class UnsafeDirectoryError(DDLError, PermissionError):
    """The directory is not this user's alone (another user's, writable by others, or not a
    directory at all): whoever else can write there could forge, block or redirect a file."""


def open_private_dir(path: str, create: bool = True) -> int:
    """A descriptor of the directory ``path``, checked: a real directory (a symlink in its place
    is not followed), owned by this user and writable by nobody else. ``create``: made 0700 (its
    missing parents as ``mkdir -p`` would) where it does not exist.

    Raises
    ------
    UnsafeDirectoryError
        ``path`` is not such a directory; the message says why.
    OSError
        It cannot be made or opened (FileNotFoundError where it is missing and not ``create``).
    """
    if create:
        with contextlib.suppress(FileExistsError):
            os.makedirs(path, mode=0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeDirectoryError(
                f"{path} is not a directory (a symlink or a file is in its place)"
            ) from None
        raise
    st = os.fstat(fd)
    uid = os.geteuid()
    if st.st_uid != uid:
        why = f"belongs to uid {st.st_uid}, not to this user (uid {uid})"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        why = f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    else:
        return fd
    os.close(fd)
    raise UnsafeDirectoryError(f"{path} {why}")
