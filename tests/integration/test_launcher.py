"""ddlrun: variables, secret, prefixed output, failure handling without orphans, naming the rank
that failed first, signals and their escalation, -m, --hosts, checks made once before spawning."""

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
from tests.harness import free_port, require

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
        assert line.startswith(
            f"[{rank}] DDL_RANK={rank} DDL_SIZE=3 DDL_LOCAL_RANK={rank} "
            "DDL_LOCAL_SIZE=3 DDL_MASTER_ADDR=127.0.0.1 DDL_MASTER_PORT="
        ), line
        assert "DDL_TRANSPORT=tcp DDL_TIMEOUT=30" in line
    ports = {line.split("DDL_MASTER_PORT=")[1].split()[0] for line in lines}
    assert len(ports) == 1 and ports != {"-"}


def test_ranks_get_torchruns_variables_with_a_port_of_torchs_own():
    code = (
        "import os; print(' '.join(os.environ[n] for n in ['RANK', 'WORLD_SIZE', "
        "'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT', 'DDL_MASTER_PORT']))"
    )
    for extra in ([], ["--master-port", str(free_port())]):
        res = _run(["-np", "2", *extra, sys.executable, "-c", code])
        assert res.returncode == 0, res.stderr
        found = sorted(line.split() for line in res.stdout.splitlines())
        assert [f[:5] for f in found] == [["[0]", "0", "2", "0", "2"], ["[1]", "1", "2", "1", "2"]]
        assert {tuple(f[5:]) for f in found} == {tuple(found[0][5:])}, found  # one per job
        addr, torch_port, ddl_port = found[0][5:]
        # init_process_group serves torch's store on MASTER_PORT: never ddlcore's port.
        assert addr == "127.0.0.1" and torch_port != ddl_port, found
        if extra:
            assert ddl_port == extra[1], found


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
    assert elapsed < 50, elapsed  # the others sleep 60 s: ddlrun stopped them
    pids = _pids(tmp_path)
    assert len(pids) == 2
    assert not any(_alive(p) for p in pids), "a sleeping rank survived ddlrun"


def test_the_stop_message_counts_the_ranks_it_stops(tmp_path):
    res = _run(["-np", "2", str(SCRIPTS / "fail_or_sleep.py"), "exit", str(tmp_path)])
    assert res.returncode == 3, res.stderr
    assert "ddlrun: rank 1 exited with code 3; terminating the other rank\n" in res.stderr
    # Nobody left to stop: no such clause.
    res = _run(["-np", "1", sys.executable, "-c", "raise SystemExit(5)"])
    assert res.returncode == 5, res.stderr
    assert "ddlrun: rank 0 exited with code 5\n" in res.stderr and "terminat" not in res.stderr


def _start_sleepers(tmp_path, *ignored: str, preexec_fn=None) -> subprocess.Popen:
    """ddlrun with 2 sleeping ranks (ignoring the signals named), once both are up."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    proc = subprocess.Popen(
        DDLRUN + ["-np", "2", str(SCRIPTS / "sleeper.py"), str(tmp_path), *ignored],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=preexec_fn,
    )
    deadline = time.monotonic() + 30
    while len(_pids(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_pids(tmp_path)) == 2
    time.sleep(0.2)  # the ranks' signal dispositions are set once their pid is written
    return proc


def test_sigterm_to_ddlrun_stops_every_rank(tmp_path):
    proc = _start_sleepers(tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert b"ddlrun: stopped by SIGTERM" in err
    time.sleep(0.2)
    assert not any(_alive(p) for p in _pids(tmp_path))


def test_sigint_stops_the_ranks_although_ddlrun_started_with_sigint_ignored(tmp_path):
    # As a background job of a script (``ddlrun ... &``) starts: SIGINT ignored, inherited.
    proc = _start_sleepers(
        tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)
    )
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT, err
    time.sleep(0.2)
    assert not any(_alive(p) for p in _pids(tmp_path))


def test_second_sigint_escalates_to_sigterm_then_sigkill(tmp_path):
    proc = _start_sleepers(tmp_path, "SIGINT", "SIGTERM")  # only SIGKILL stops these ranks
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    assert proc.poll() is None and all(_alive(p) for p in _pids(tmp_path))
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)  # SIGTERM (ignored), then SIGKILL after the grace
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert time.monotonic() - t0 < launcher.GRACE_S + 10
    time.sleep(0.2)
    assert not any(_alive(p) for p in _pids(tmp_path))


@pytest.mark.parametrize("mode,code", [("raise", 1), ("exit", 7)])
def test_the_rank_that_failed_first_is_named(mode, code):
    # The other ranks fail with a PeerFailureError naming rank 1, and often exit first.
    res = _run(["-np", "3", "--timeout", "30", str(SCRIPTS / "fail_in_with.py"), mode], timeout=120)
    ddlrun_lines = [line for line in res.stderr.splitlines() if line.startswith("ddlrun:")]
    assert res.returncode == code, res.stderr
    # "; terminating the other ranks" follows where some still run (none may, under load).
    assert ddlrun_lines and re.match(
        rf"ddlrun: rank 1 exited with code {code}(;|$)", ddlrun_lines[0]
    ), res.stderr


def _job_with_exits(
    exits: dict[int, tuple[float, int]], origins: dict[int, int]
) -> launcher.LocalJob:
    """A LocalJob of 4 ranks as `LocalJob.wait` sees it: exit times and codes, and the origins
    the failed ranks recorded (what `ddlcore.job.failure_report.record_failure` sends)."""
    job = launcher.LocalJob.__new__(launcher.LocalJob)
    job.procs, job.exits, job.origins = [None] * 4, dict(exits), dict(origins)
    return job


def test_ranks_that_all_failed_before_ddlrun_looked_fail_the_job():
    # On a loaded machine every rank may be gone by ddlrun's first look: still a failed job.
    job = launcher.LocalJob([sys.executable, "-c", "raise SystemExit(5)"], 3, {}, False)
    try:
        for proc in job.procs:
            proc.wait(60)
        assert job.wait(None) == 5
    finally:
        job.close()


def test_culprit_rules():
    # A failed rank naming no other rank beats earlier ranks that name one.
    job = _job_with_exits({0: (1.0, 1), 2: (1.1, 1), 1: (1.2, 7)}, {0: 1, 2: 1})
    assert job.culprit(settled=False) == 1
    # Only relayed failures so far, and the rank they name still runs: wait for it ...
    job = _job_with_exits({0: (1.0, 1), 2: (1.1, 1)}, {0: 3, 2: 3})
    assert job.culprit(settled=False) is None
    # ... until the grace has passed: then the first to fail is named ...
    assert job.culprit(settled=True) == 0
    # ... or the named rank exits cleanly (it closed early): then too.
    job.exits[3] = (1.2, 0)
    assert job.culprit(settled=False) == 0
    # Own failures (no record, or the rank names itself): the first to exit, ties by rank.
    job = _job_with_exits({3: (1.0, -9), 1: (1.0, 1), 2: (0.9, 1)}, {2: 2})
    assert job.culprit(settled=False) == 2
    job = _job_with_exits({3: (1.0, -9), 1: (1.0, 1)}, {})
    assert job.culprit(settled=False) == 1
    job = _job_with_exits({3: (1.0, 0)}, {})
    assert job.culprit(settled=True) is None  # nobody failed


def test_each_job_gets_a_fresh_secret_never_on_a_command_line():
    seen = []
    for _ in range(2):
        res = _run(["-np", "2", str(SCRIPTS / "show_secret.py")])
        assert res.returncode == 0, res.stderr
        lines = sorted(res.stdout.splitlines())
        assert len(lines) == 2 and lines[0][4:] == lines[1][4:], lines  # both ranks: the same
        assert "len=64 on_cmdline=False file=-" in lines[0], lines
        seen.append(lines[0])
    assert seen[0] != seen[1]


def test_a_secret_the_user_set_is_kept(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    res = subprocess.run(
        DDLRUN + ["-np", "1", str(SCRIPTS / "show_secret.py")],
        env={**env, "DDL_SECRET": "the-users-own-secret"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    import hashlib

    want = hashlib.sha256(b"the-users-own-secret").hexdigest()[:16]
    assert f"secret={want} len=20 on_cmdline=False" in res.stdout, res.stdout + res.stderr
    secret_file = tmp_path / "secret"
    secret_file.write_text("from a file\n")
    secret_file.chmod(0o600)
    res = subprocess.run(
        DDLRUN + ["-np", "1", str(SCRIPTS / "show_secret.py")],
        env={**env, "DDL_SECRET_FILE": str(secret_file)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert f"secret=- len=0 on_cmdline=False file={secret_file}" in res.stdout, res.stdout


def test_job_timeout(tmp_path):
    res = _run(["-np", "2", "--job-timeout", "1", str(SCRIPTS / "sleeper.py"), str(tmp_path)])
    assert res.returncode == 124 and "--job-timeout" in res.stderr


def test_bad_options_are_rejected_before_spawning():
    res = _run(["-np", "2", "--topology", "4by2", str(SCRIPTS / "show_env.py")])
    assert res.returncode == 2 and "--topology" in res.stderr and "DDL_RANK" not in res.stdout
    res = _run(["-np", "2", "--transport", "pigeon", str(SCRIPTS / "show_env.py")])
    assert res.returncode == 2 and "--transport" in res.stderr


def _error_line(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2 and not res.stdout, (res.stdout, res.stderr)
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, res.stderr  # once, from ddlrun, not once per rank
    return errors[0]


def test_mistakes_get_one_line_from_ddlrun_before_spawning(tmp_path):
    assert "no program given" in _error_line(_run(["-np", "2"]))
    assert "--topology 3x3 holds 9 ranks, but -np is 4" in _error_line(
        _run(["-np", "4", "--topology", "3x3", str(SCRIPTS / "show_env.py")])
    )
    missing = tmp_path / "nope.py"
    assert f"no such script: {missing}" in _error_line(_run(["-np", "3", str(missing)]))
    assert "no module named 'no_such_module_here'" in _error_line(
        _run(["-np", "2", "-m", "no_such_module_here"])
    )
    assert "command not found: no-such-command-here" in _error_line(
        _run(["-np", "2", "no-such-command-here"])
    )
    usage = _run(["-np", "2"]).stderr
    assert "args" not in usage.replace("[args...]", ""), usage


def test_python_and_a_missing_script_get_one_line_before_spawning(tmp_path):
    missing = tmp_path / "missing.py"
    for program in (
        [sys.executable, str(missing)],
        [sys.executable, "-u", "-W", "ignore", str(missing), "--lr", "0.1"],
    ):
        res = _run(["-np", "2", *program])
        assert f"no such script: {missing}" in _error_line(res), res.stderr
        assert len(res.stderr.splitlines()) == 1, res.stderr  # no rank said anything
    # What runs no file is not checked.
    res = _run(["-np", "1", sys.executable, "-c", "print('ran')"])
    assert res.returncode == 0 and "[0] ran" in res.stdout, res.stderr


def test_python_script_finds_the_file_among_pythons_options():
    assert launcher.python_script(["-u", "-W", "ignore", "-X", "dev", "a.py", "-c"]) == "a.py"
    assert launcher.python_script(["-Wignore", "-OO", "a.py"]) == "a.py"
    assert launcher.python_script(["--", "a.py"]) == "a.py"
    for no_file in (["-c", "x"], ["-uc", "x"], ["-m", "mod"], ["-"], ["-V"], ["--help"], []):
        assert launcher.python_script(no_file) is None, no_file


def test_a_transport_that_cannot_run_locally_is_refused(tmp_path):
    line = _error_line(_run(["-np", "2", "--transport", "mpi", str(SCRIPTS / "show_env.py")]))
    assert "--transport mpi cannot run a local job" in line and "--hosts" in line, line
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    res = subprocess.run(
        DDLRUN + ["-np", "2", str(SCRIPTS / "show_env.py")],
        env={**env, "DDL_TRANSPORT": "mpi"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "DDL_TRANSPORT=mpi cannot run a local job" in _error_line(res), res.stderr


# As the ``ddlrun`` console script runs: the first entry of its sys.path is its own directory,
# not the working directory (``python -m ddlcore.launcher`` would put the latter there).
_DDLRUN_SCRIPT = [
    sys.executable,
    "-c",
    "import os, sys; sys.path[0] = os.path.dirname(sys.executable); "
    "from ddlcore.launcher import main; sys.exit(main(sys.argv[1:]))",
]


def test_a_module_is_found_in_the_working_directory_as_python_m_finds_it(tmp_path):
    (tmp_path / "hellomod.py").write_text("import os\nprint('hello from', os.environ['RANK'])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    res = subprocess.run(
        _DDLRUN_SCRIPT + ["-np", "2", "-m", "hellomod"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[0] hello from 0", "[1] hello from 1"]
    # Still refused where python -m would not find it, and without importing a package.
    res = subprocess.run(
        _DDLRUN_SCRIPT + ["-np", "2", "-m", "hellomod"],
        cwd=tmp_path.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "no module named 'hellomod'" in _error_line(res)


def test_an_unexpected_error_is_one_line_unless_debugging(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("something broke\nover two lines")

    monkeypatch.delenv("DDL_DEBUG", raising=False)
    monkeypatch.delenv("DDL_TRANSPORT", raising=False)
    monkeypatch.setattr(launcher, "LocalJob", broken)
    assert launcher.main(["-np", "1", sys.executable, "-V"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ddlrun: error: RuntimeError: something broke" in err, err
    monkeypatch.setenv("DDL_DEBUG", "1")
    with pytest.raises(RuntimeError, match="something broke"):
        launcher.main(["-np", "1", sys.executable, "-V"])


def test_ddl_bench_says_an_init_error_in_one_line_per_rank():
    res = _run(["-np", "2", "-m", "ddlcore.bench", "--transport", "mpi", "-e", "8"])
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    # The first rank to fail gets the other stopped, maybe before it got that far itself.
    lines = [line for line in res.stderr.splitlines() if line.startswith("[")]
    assert 1 <= len(lines) <= 2 and len({line[:4] for line in lines}) == len(lines), res.stderr
    for line in lines:
        assert line[4:].startswith("ddl-bench: ") and "DDL_TRANSPORT=mpi cannot" in line, line
    # DDL_DEBUG=1: the traceback, for whoever debugs it.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    res = subprocess.run(
        DDLRUN + ["-np", "2", "-m", "ddlcore.bench", "--transport", "mpi", "-e", "8"],
        env={**env, "DDL_DEBUG": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1 and "Traceback" in res.stderr, res.stderr


_SHOW_CPUS = "import os; print(','.join(map(str, sorted(os.sched_getaffinity(0)))))"


@pytest.mark.parametrize("np_", [1, 2, 3])
def test_bind_to_core_pins_each_rank_to_its_share(np_):
    cpus = sorted(os.sched_getaffinity(0))
    res = _run(["-np", str(np_), "--bind-to", "core", sys.executable, "-c", _SHOW_CPUS])
    assert res.returncode == 0, res.stderr
    got = dict(line.split(" ", 1) for line in res.stdout.splitlines())
    want = launcher.cpu_shares(np_, cpus)
    assert got == {f"[{r}]": ",".join(map(str, want[r])) for r in range(np_)}, res.stdout
    # Without it, every rank may run anywhere ddlrun may.
    res = _run(["-np", str(np_), sys.executable, "-c", _SHOW_CPUS])
    assert {line.split(" ", 1)[1] for line in res.stdout.splitlines()} == {
        ",".join(map(str, cpus))
    }, res.stdout


def test_bind_to_core_is_refused_with_hosts():
    assert "--bind-to places local ranks" in _error_line(
        _run(["-np", "2", "--hosts", "a:1,b:1", "--bind-to", "core", sys.executable, "-V"])
    )


def test_a_cpu_that_cannot_be_used_fails_before_the_rank_starts():
    before = os.sched_getaffinity(0)
    with pytest.raises(OSError, match=r"cannot bind rank 0 to CPUs \[100000\]"):
        launcher.LocalJob([sys.executable, "-V"], 2, {}, False, cpus=[[100000], [0]])
    assert os.sched_getaffinity(0) == before


def test_module_mode_and_program_flags_pass_through():
    res = _run(["-np", "2", "-m", "ddlcore", "info", "--np", "2"])
    assert res.returncode == 0, res.stderr
    assert "[0] ddlcore" in res.stdout and "[1] ddlcore" in res.stdout
    res = _run(["-np", "1", sys.executable, "-c", "import sys; print(sys.argv[1:])", "-x", "--y"])
    assert "['-x', '--y']" in res.stdout


def test_mpiexec_command():
    argv = launcher.mpiexec_command(
        "mpiexec", 8, "h1:4,h2:4", {"DDL_TRANSPORT": "tcp"}, ["python", "prog.py", "--lr", "0.1"]
    )
    assert argv == [
        "mpiexec",
        "-n",
        "8",
        "-hosts",
        "h1:4,h2:4",
        "-genv",
        "DDL_TRANSPORT",
        "tcp",
        "python",
        "prog.py",
        "--lr",
        "0.1",
    ]
    assert launcher.mpiexec_command("mpiexec", 2, "h1:2", {}, ["prog"], prefix=True) == [
        "mpiexec",
        "-n",
        "2",
        "-hosts",
        "h1:2",
        "-prepend-rank",
        "prog",
    ]
    with pytest.raises(ValueError, match="fewer than"):
        launcher.mpiexec_command("mpiexec", 9, "h1:4,h2:4", {}, ["prog"])
    with pytest.raises(ValueError, match="host"):
        launcher.parse_hosts("h1:x")


def test_hosts_mode_hands_off_to_mpiexec():
    require(
        launcher.find_mpiexec() is not None, "mpiexec not installed (pip install 'ddlcore[mpi]')"
    )
    res = _run(
        ["-np", "2", "--hosts", "localhost:2", "--timeout", "30", str(SCRIPTS / "show_env.py")]
    )
    assert res.returncode == 0, res.stderr
    ranks = sorted(re.findall(r"PMI_RANK=(\d+)", res.stdout))
    assert ranks == ["0", "1"], (res.stdout, res.stderr)
    for line in res.stdout.splitlines():  # prefixed by rank, as in local mode
        assert line.startswith(f"[{line.split('PMI_RANK=')[1].split()[0]}] DDL_RANK="), line
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
        "    sys.stdout.flush()\n"
    )
    return script


def test_allreduce_job_under_ddlrun_and_mpiexec(tmp_path):
    script = _allreduce_script(tmp_path)
    res = _run(["-np", "3", str(script)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(line.split("sum ")[1] for line in res.stdout.splitlines()) == [
        "6.0 0 3 0",
        "6.0 1 3 1",
        "6.0 2 3 2",
    ]
    require(
        launcher.find_mpiexec() is not None, "mpiexec not installed (pip install 'ddlcore[mpi]')"
    )
    res = _run(["-np", "2", "--hosts", "localhost:2", str(script)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(line.split("sum ")[1] for line in res.stdout.splitlines()) == [
        "3.0 0 2 0",
        "3.0 1 2 1",
    ]


def test_no_shared_memory_left_when_ranks_die(tmp_path):
    res = _run(
        [
            "-np",
            "3",
            "--transport",
            "shm",
            "--timeout",
            "20",
            str(SCRIPTS / "shm_then_die.py"),
            str(tmp_path),
        ]
    )
    assert res.returncode == 128 + signal.SIGKILL, res.stderr
    assert "ddlrun: rank 1 exited with SIGKILL" in res.stderr, res.stderr  # not a survivor
    made = [n for f in tmp_path.glob("*.shm") for n in f.read_text().split()]
    # Each rank's shm inbox and its host-collective board, named after its pid.
    assert len({n.split("-")[1] for n in made}) == 3 and len(made) == 6, (made, res.stderr)
    left = [n for n in made if os.path.exists(f"/dev/shm/{n}")]
    assert not left, f"segments left after ddlrun: {left}\n{res.stderr}"


@pytest.mark.parametrize("wrapped", [False, True])
def test_the_store_port_is_held_from_launch_until_rank_0_serves_it(wrapped):
    """ddlrun binds the store's sockets and hands them to rank 0: between its choice of the port
    and rank 0's start no other process can take it (a launch never fails "address in use"),
    also where a wrapper between ddlrun and the rank closes inherited descriptors."""
    program = [str(SCRIPTS / "port_held.py")]
    if wrapped:
        program = ["python", str(SCRIPTS / "wrap.py"), *program]
    res = _run(["-np", "2", "--timeout", "60", *program], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[1] port-held" in res.stdout, res.stdout
    assert re.search(r"\[0\] store-sockets=@ddlcore-store-", res.stdout), res.stdout
    assert res.stdout.count("sum=2") == 2, res.stdout
