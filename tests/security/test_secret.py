"""Where the secret comes from, against another local user: a ``DDL_SECRET_FILE`` that another
user made (in /tmp, 0600, so only its owner and root can read it) is refused, even by root,
since its owner can read or replace the secret."""

from __future__ import annotations

import os

import pytest

from ddlcore.errors import DDLError
from ddlcore.security.auth import job_secret


def _plant_secret(folder: str) -> str:
    """Another user writes a secret file of its own, 0600 (runs as that user)."""
    path = os.path.join(folder, "secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"the stranger knows this\n")
    os.close(fd)
    return path


def test_a_secret_file_another_user_owns_is_refused(stranger, shared_tmp):
    path = stranger.run(_plant_secret, str(shared_tmp))
    assert os.stat(path).st_uid == stranger.uid
    with pytest.raises(DDLError, match=rf"belongs to uid {stranger.uid}, not to you"):
        job_secret({"DDL_SECRET_FILE": path})


def test_a_secret_file_of_our_own_is_taken(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"ours\n")
    path.chmod(0o600)
    assert job_secret({"DDL_SECRET_FILE": str(path)}) == (b"ours", f"DDL_SECRET_FILE={path}")
