"""Nothing left behind: ranks die with their launcher, and a dead rank's shared memory goes
(removed by a survivor that saw it die, by ddlrun, or by the next job on the host), under any
launcher. Real processes, real signals; what is checked is what a user would see: processes
still running, files left in /dev/shm."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.harness import free_port

SCRIPTS = pathlib.Path(__file__).parent.parent / "integration" / "scripts"
DDLRUN = [sys.executable, "-m", "ddlcore.launcher"]

shm = pytest.importorskip("ddlcore.transports.shm", reason="the shm transport is not built")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _segments_of(pids: set[int]) -> list[str]:
    return [
        n
        for n in os.listdir(shm.SHM_DIR)
        if n.startswith(shm.PREFIX) and n.split("-")[1] in {str(p) for p in pids}
    ]


def _made(outdir: pathlib.Path) -> list[str]:
    """The segments the ranks of shm_then_die.py recorded making (one file per rank)."""
    return [n for f in outdir.glob("*.shm") for n in f.read_text().split()]


def test_ranks_die_when_ddlrun_is_killed(tmp_path):
    proc = subprocess.Popen(
        DDLRUN + ["-np", "3", str(SCRIPTS / "sleeper.py"), str(tmp_path)],
        env=_clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*.pid"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 3
    proc.kill()  # SIGKILL: ddlrun can neither forward nor clean up
    proc.wait()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)], "ranks outlived ddlrun's SIGKILL by 5 s"


def _plain_env_job(
    script: pathlib.Path, nprocs: int, outdir: pathlib.Path, env: dict[str, str], *args: str
) -> list[subprocess.Popen]:
    """The ranks started by hand (as any launcher would), not by ddlrun."""
    port = str(free_port())
    procs = []
    for rank in range(nprocs):
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(outdir), *args],
                env={
                    **_clean_env(),
                    **env,
                    "DDL_RANK": str(rank),
                    "DDL_SIZE": str(nprocs),
                    "DDL_LOCAL_RANK": str(rank),
                    "DDL_LOCAL_SIZE": str(nprocs),
                    "DDL_MASTER_ADDR": "127.0.0.1",
                    "DDL_MASTER_PORT": port,
                    "DDL_TIMEOUT": "30",
                },
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        )
    return procs


@pytest.mark.parametrize("algo", ["auto", "ring"])  # host collectives' boards; shm schedules
def test_killed_rank_leaves_no_segment_under_a_plain_env_launch(tmp_path, algo):
    procs = _plain_env_job(
        SCRIPTS / "shm_then_die.py", 3, tmp_path, {"DDL_TRANSPORT": "shm", "DDL_ALGO": algo}
    )
    try:
        outs = [p.communicate(timeout=120)[1].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == -signal.SIGKILL, outs[1]
    for rank in (0, 2):  # the survivors raised, naming the dead rank
        assert procs[rank].returncode == 1 and "PeerFailureError" in outs[rank], outs[rank]
        assert "rank 1" in outs[rank].splitlines()[-1], outs[rank]
    made = _made(tmp_path)
    assert len(made) >= 3, made
    left = _segments_of({p.pid for p in procs})
    assert not left, f"segments left once the survivors raised: {left}"


def test_segments_of_a_job_killed_whole_go_at_the_next_init(tmp_path):
    # An MPI launcher or srun kills every rank at once: nobody survives to clean up.
    procs = _plain_env_job(
        SCRIPTS / "shm_then_die.py", 2, tmp_path, {"DDL_TRANSPORT": "shm"}, "all"
    )
    for p in procs:
        p.communicate(timeout=120)
    pids = {p.pid for p in procs}
    assert all(p.returncode == -signal.SIGKILL for p in procs)
    # What the ranks made (a job starting meanwhile, e.g. another test file's under
    # pytest-xdist, may already have swept them: that is the behaviour under test too).
    made = _made(tmp_path)
    assert len(made) >= 2, made
    time.sleep(shm._ORPHAN_MIN_AGE_S + 0.1)
    # The next job on this host: any context creation first removes orphans.
    live = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import os, sys, time\n"
                "from ddlcore.transports.shm import create_segment\n"
                "create_segment(f'ddl-{os.getpid()}-live-r0', 8192, 4096, 'a live segment')\n"
                "print(flush=True); time.sleep(30)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        env=_clean_env(),
    )
    try:
        live.stdout.readline()
        assert not _segments_of(pids), _segments_of(pids)
        time.sleep(shm._ORPHAN_MIN_AGE_S + 0.1)
        # A live owner's segment is kept (it holds its lock), however old.
        shm.remove_orphans()
        assert _segments_of({live.pid}) == [f"ddl-{live.pid}-live-r0"]
        # Nor does removing by pid take it (a pid reused since the rank it named died).
        assert shm.remove_segments_of({live.pid}) == []
    finally:
        live.kill()
        live.wait()
    assert shm.remove_segments_of({live.pid}) == [f"ddl-{live.pid}-live-r0"]


def test_a_reused_pid_does_not_keep_a_segment():
    # Our own process started before now and after an hour ago: a segment that existed an hour
    # ago cannot be ours, one made now can.
    boot = shm._boot_time()
    assert shm._owner_gone(os.getpid(), time.time() - 3600, boot)
    assert not shm._owner_gone(os.getpid(), time.time(), boot)
    assert shm._owner_gone(2**22 + 1, time.time(), boot)  # above pid_max: no such process


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_a_wrapped_programs_ranks_die_with_ddlrun_and_leave_no_segments(tmp_path):
    # ddlrun's children are shells; the Python ranks are theirs ("exit $?" keeps sh from
    # exec'ing Python in its place, as some shells do for a last command).
    proc = subprocess.Popen(
        DDLRUN
        + ["-np", "2", "--transport", "shm", "--timeout", "60", "sh", "-c", '"$0" "$@"; exit $?']
        + [sys.executable, str(SCRIPTS / "shm_then_sleep.py"), str(tmp_path)],
        env=_clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert _wait_for(lambda: len(list(tmp_path.glob("*.pid"))) == 2, 120)
        pids = {int(p.read_text()) for p in tmp_path.glob("*.pid")}
        made = _made(tmp_path)
        assert len(made) >= 2 and all(os.path.exists(f"/dev/shm/{n}") for n in made), made
    finally:
        proc.kill()  # SIGKILL: ddlrun can neither forward nor clean up
        proc.wait()
    assert _wait_for(lambda: not any(_alive(p) for p in pids), 30), "ranks outlived ddlrun"
    assert _wait_for(lambda: not _segments_of(pids), 30), _segments_of(pids)


def _no_ddlrun_dir_after(tmp_path: pathlib.Path, args: list[str], end) -> None:
    """Run ddlrun with TMPDIR a directory of its own, end it with ``end(proc, piddir)``, and
    check that nothing named ddlrun-* is left there once its ranks are gone."""
    tmpdir, piddir = tmp_path / "tmp", tmp_path / "pids"
    tmpdir.mkdir()
    piddir.mkdir()
    proc = subprocess.Popen(
        DDLRUN + [a.replace("PIDDIR", str(piddir)) for a in args],
        env={**_clean_env(), "TMPDIR": str(tmpdir)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        end(proc, piddir)
        proc.wait(120)
    finally:
        proc.kill()
        proc.wait()
    pids = [int(p.read_text()) for p in piddir.glob("*.pid")]
    assert _wait_for(lambda: not any(_alive(p) for p in pids), 30), "ranks outlived ddlrun"
    assert not list(tmpdir.glob("ddlrun-*")), list(tmpdir.iterdir())


def _signal_once_up(signum: int):
    def end(proc: subprocess.Popen, piddir: pathlib.Path) -> None:
        assert _wait_for(lambda: len(list(piddir.glob("*.pid"))) == 2, 60)
        time.sleep(0.2)  # the ranks' signal dispositions are set once their pid is written
        proc.send_signal(signum)

    return end


@pytest.mark.parametrize(
    "how,args,end",
    [
        ("normal end", ["-np", "2", sys.executable, "-c", "pass"], lambda proc, piddir: None),
        (
            "rank failure",
            ["-np", "3", str(SCRIPTS / "fail_or_sleep.py"), "exit", "PIDDIR"],
            lambda proc, piddir: None,
        ),
        (
            "SIGINT",
            ["-np", "2", str(SCRIPTS / "sleeper.py"), "PIDDIR"],
            _signal_once_up(signal.SIGINT),
        ),
        (
            "SIGTERM",
            ["-np", "2", str(SCRIPTS / "sleeper.py"), "PIDDIR"],
            _signal_once_up(signal.SIGTERM),
        ),
        (
            "SIGKILL",
            ["-np", "2", str(SCRIPTS / "sleeper.py"), "PIDDIR"],
            _signal_once_up(signal.SIGKILL),
        ),
    ],
)
def test_no_ddlrun_directory_is_left_after_any_end(tmp_path, how, args, end):
    _no_ddlrun_dir_after(tmp_path, args, end)


def test_mpich_files_nobody_uses_go_and_the_others_stay(tmp_path):
    from ddlcore.launcher import mpich

    paths = {
        kind: pathlib.Path(mpich.SHM_DIR) / f"{mpich.PREFIX}ddltest_{os.getpid()}_{kind}"
        for kind in ("dead", "held", "mapped", "young")
    }
    for kind, path in paths.items():
        path.write_bytes(b"\0" * 4096)
        path.chmod(0o600)
        if kind != "young":  # a killed job's, long ago
            os.utime(path, (time.time() - 3600, time.time() - 3600))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import mmap, sys, time\n"
            "held = open(sys.argv[1], 'rb')\n"
            "with open(sys.argv[2], 'r+b') as f:\n"
            "    mapped = mmap.mmap(f.fileno(), 4096)\n"
            "print(flush=True); time.sleep(60)\n",
            str(paths["held"]),
            str(paths["mapped"]),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        holder.stdout.readline()  # holding one open, mapping the other (its descriptor closed)
        removed = mpich.remove_dead_segments()
        assert paths["dead"].name in removed and not paths["dead"].exists()
        assert all(paths[k].exists() for k in ("held", "mapped", "young")), removed
    finally:
        holder.kill()
        holder.wait()
        for path in paths.values():
            path.unlink(missing_ok=True)
