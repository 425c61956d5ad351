"""ddlrun: variables, prefixed output, failure handling without orphans, signals, -m, --hosts."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from ddlcore import launcher
from tests.harness import require

SCRIPTS = pathlib.Path(__file__).parent / "scripts"
DDLRUN = [sys.executable, "-m", "ddlcore.launcher"]


def _run(args, timeout=60):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    return subprocess.run(DDLRUN + args, capture_output=True, text=True, timeout=timeout, env=env)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _pids(piddir: pathlib.Path) -> list[int]:
    return [int(p.read_text()) for p in piddir.glob("*.pid")]


def test_ranks_get_their_variables_and_prefixed_output():
    res = _run(["-np", "3", "--transport", "tcp", "--timeout", "30", str(SCRIPTS / "show_env.py")])
    assert res.returncode == 0, res.stderr
    lines = sorted(res.stdout.splitlines())
    assert len(lines) == 3
    for rank, line in enumerate(lines):
        assert line.startswith(f"[{rank}] DDL_RANK={rank} DDL_SIZE=3 DDL_LOCAL_RANK={rank} "
                               "DDL_LOCAL_SIZE=3 DDL_MASTER_ADDR=127.0.0.1 DDL_MASTER_PORT="), line
        assert "DDL_TRANSPORT=tcp DDL_TIMEOUT=30" in line
    ports = {line.split("DDL_MASTER_PORT=")[1].split()[0] for line in lines}
    assert len(ports) == 1 and ports != {"-"}


def test_no_prefix():
    res = _run(["-np", "1", "--no-prefix", str(SCRIPTS / "show_env.py")])
    assert res.returncode == 0 and res.stdout.startswith("DDL_RANK=0")


@pytest.mark.parametrize("mode,code,word", [("exit", 3, "code 3"), ("kill", 128 + 9, "SIGKILL")])
def test_failing_rank_stops_the_others(tmp_path, mode, code, word):
    t0 = time.monotonic()
    res = _run(["-np", "3", str(SCRIPTS / "fail_or_sleep.py"), mode, str(tmp_path)])
    elapsed = time.monotonic() - t0
    assert res.returncode == code, res.stderr
    assert f"ddlrun: rank 1 exited with {word}; terminating the other 2 ranks" in res.stderr
    assert elapsed < 20, elapsed
    pids = _pids(tmp_path)
    assert len(pids) == 2
    assert not any(_alive(p) for p in pids), "a sleeping rank survived ddlrun"


def test_sigterm_to_ddlrun_stops_every_rank(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    proc = subprocess.Popen(DDLRUN + ["-np", "2", str(SCRIPTS / "sleeper.py"), str(tmp_path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while len(_pids(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_pids(tmp_path)) == 2
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode != 0
    time.sleep(0.2)
    assert not any(_alive(p) for p in _pids(tmp_path))


def test_job_timeout(tmp_path):
    res = _run(["-np", "2", "--job-timeout", "1", str(SCRIPTS / "sleeper.py"), str(tmp_path)])
    assert res.returncode == 124 and "--job-timeout" in res.stderr


def test_bad_options_are_rejected_before_spawning():
    res = _run(["-np", "2", "--topology", "4by2", str(SCRIPTS / "show_env.py")])
    assert res.returncode == 2 and "--topology" in res.stderr and "DDL_RANK" not in res.stdout
    res = _run(["-np", "2", "--transport", "pigeon", str(SCRIPTS / "show_env.py")])
    assert res.returncode == 2 and "--transport" in res.stderr


def test_module_mode_and_program_flags_pass_through():
    res = _run(["-np", "2", "-m", "ddlcore", "info", "--np", "2"])
    assert res.returncode == 0, res.stderr
    assert "[0] ddlcore" in res.stdout and "[1] ddlcore" in res.stdout
    res = _run(["-np", "1", sys.executable, "-c", "import sys; print(sys.argv[1:])", "-x", "--y"])
    assert "['-x', '--y']" in res.stdout


def test_mpiexec_command():
    argv = launcher.mpiexec_command("mpiexec", 8, "h1:4,h2:4", {"DDL_TRANSPORT": "tcp"},
                                    ["python", "prog.py", "--lr", "0.1"])
    assert argv == ["mpiexec", "-n", "8", "-hosts", "h1:4,h2:4", "-genv", "DDL_TRANSPORT", "tcp",
                    "python", "prog.py", "--lr", "0.1"]
    with pytest.raises(ValueError, match="fewer than"):
        launcher.mpiexec_command("mpiexec", 9, "h1:4,h2:4", {}, ["prog"])
    with pytest.raises(ValueError, match="host"):
        launcher.parse_hosts("h1:x")


def test_hosts_mode_hands_off_to_mpiexec():
    require(launcher.find_mpiexec() is not None, "mpiexec not installed (pip install 'ddlcore[mpi]')")
    res = _run(["-np", "2", "--hosts", "localhost:2", "--timeout", "30", str(SCRIPTS / "show_env.py")])
    assert res.returncode == 0, res.stderr
    ranks = sorted(re.findall(r"PMI_RANK=(\d+)", res.stdout))
    assert ranks == ["0", "1"], (res.stdout, res.stderr)
    assert "DDL_TIMEOUT=30" in res.stdout


def _allreduce_script(tmp_path: pathlib.Path) -> pathlib.Path:
    script = tmp_path / "job.py"
    script.write_text(
        "import sys\n"
        "import numpy as np, ddlcore\n"
        "with ddlcore.init() as comm:\n"
        "    y = comm.allreduce(np.full(10, comm.rank + 1.0))\n"
        "    line = f'sum {y[0]} {comm.rank} {comm.size} {comm.local_rank}\\n'\n"
        "    sys.stdout.write(line)  # one write: mpiexec may interleave a line's pieces\n"
        "    sys.stdout.flush()\n")
    return script


def test_allreduce_job_under_ddlrun_and_mpiexec(tmp_path):
    script = _allreduce_script(tmp_path)
    res = _run(["-np", "3", str(script)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(line.split("sum ")[1] for line in res.stdout.splitlines()) == \
        ["6.0 0 3 0", "6.0 1 3 1", "6.0 2 3 2"]
    require(launcher.find_mpiexec() is not None, "mpiexec not installed (pip install 'ddlcore[mpi]')")
    res = _run(["-np", "2", "--hosts", "localhost:2", str(script)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(line.split("sum ")[1] for line in res.stdout.splitlines()) == \
        ["3.0 0 2 0", "3.0 1 2 1"]


def test_no_shared_memory_left_when_ranks_die(tmp_path):
    res = _run(["-np", "3", "--transport", "shm", "--timeout", "20",
                str(SCRIPTS / "shm_then_die.py"), str(tmp_path)])
    assert res.returncode != 0
    made = [n for f in tmp_path.glob("*.shm") for n in f.read_text().split()]
    # Each rank's shm inbox and its host-collective board, named after its pid.
    assert len({n.split("-")[1] for n in made}) == 3 and len(made) == 6, (made, res.stderr)
    left = [n for n in made if os.path.exists(f"/dev/shm/{n}")]
    assert not left, f"segments left after ddlrun: {left}\n{res.stderr}"
