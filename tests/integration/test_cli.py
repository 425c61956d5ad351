"""Command lines end to end: `python -m ddlcore info`, and `ddl-bench` under ddlrun and mpiexec."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.harness import mpiexec_path, require

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(
    args: list[str], timeout: float = 120, env: dict | None = None
) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("DDL_", "PMI_", "OMPI_"))}
    full_env.update(env or {})
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=full_env
    )


def test_info_prints_versions_transports_kernels_and_config():
    res = _run([sys.executable, "-m", "ddlcore", "info", "--np", "4"])
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for word in (
        "ddlcore",
        "numpy",
        "kernels:",
        "transports:",
        "tcp",
        "available",
        "DDL_TIMEOUT",
        "allreduce",
        "ring",
    ):
        assert word in out, f"{word!r} missing from:\n{out}"
    assert "NOT BUILT" not in out


@pytest.mark.parametrize("np_", [2, 4])
def test_info_shows_where_init_would_pin_the_ranks(np_):
    from ddlcore.job import placement

    res = _run([sys.executable, "-m", "ddlcore", "info", "--np", str(np_)])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    given = frozenset(os.sched_getaffinity(0))
    head = f"placement (DDL_BIND=auto) of {np_} rank(s) on this host, given CPUs "
    at = lines.index(head + placement.encode(given) + ":")
    want = []
    for local_rank in range(np_):
        cpus, why = placement.plan("auto", local_rank, [given] * np_, placement.host_has_gpu())
        if cpus is None:
            want.append(f"  not pinned: {why}")
            break
        want.append(f"  local rank {local_rank}: CPUs {placement.encode(cpus)}")
    assert lines[at + 1 : at + 1 + len(want)] == want, res.stdout


def test_info_rejects_bad_environment_with_the_variable_name():
    res = _run([sys.executable, "-m", "ddlcore", "info"], env={"DDL_TIMEOUT": "never"})
    assert res.returncode != 0
    assert "DDL_TIMEOUT" in res.stderr


def test_bench_under_ddlrun(tmp_path):
    out = tmp_path / "rows.json"
    res = _run(
        [
            sys.executable,
            "-m",
            "ddlcore.launcher",
            "-np",
            "2",
            sys.executable,
            "-m",
            "ddlcore.bench",
            "-b",
            "1K",
            "-e",
            "64K",
            "-f",
            "4",
            "-n",
            "3",
            "-w",
            "1",
            "--json",
            str(out),
            "--csv",
            str(tmp_path / "rows.csv"),
        ]
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Avg bus bandwidth" in res.stdout and "OK" in res.stdout
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    # The record names the machine: a pool of VMs does not always give the same CPU.
    model, count = doc["cpu"].rsplit(", ", 1)
    assert model.strip() and count == f"{os.cpu_count()} CPUs"
    assert [r["size"] for r in rows] == [1024, 4096, 16384, 65536]
    assert all(r["wrong"] == 0 and r["ip_wrong"] == 0 and r["busbw"] > 0 for r in rows)
    assert (tmp_path / "rows.csv").read_text().startswith("size,count,type")


@pytest.mark.parametrize(
    "collective",
    ["reduce_scatter", "allgather", "broadcast", "reduce", "gather", "scatter", "alltoall"],
)
def test_bench_other_collectives(collective):
    res = _run(
        [
            sys.executable,
            "-m",
            "ddlcore.launcher",
            "-np",
            "3",
            sys.executable,
            "-m",
            "ddlcore.bench",
            "-C",
            collective,
            "-b",
            "3K",
            "-e",
            "12K",
            "-f",
            "2",
            "-n",
            "2",
            "-w",
            "1",
            "-d",
            "int32",
        ]
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Out of bounds values : 0 OK" in res.stdout


def test_bench_beside_mpi_and_gloo_under_mpiexec():
    mpiexec = mpiexec_path()
    require(mpiexec is not None, "mpiexec not installed (pip install 'ddlcore[mpi]')")
    try:
        import mpi4py  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:
        require(False, f"mpi4py and torch are needed to compare: {exc}")
    res = _run(
        [
            mpiexec,
            "-n",
            "2",
            sys.executable,
            "-m",
            "ddlcore.bench",
            "-b",
            "4K",
            "-e",
            "64K",
            "-f",
            "4",
            "-n",
            "3",
            "-w",
            "1",
            "--compare",
            "mpi,gloo",
        ],
        timeout=180,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "mpi:busbw" in res.stdout and "gloo:busbw" in res.stdout
    assert "Avg bus bandwidth mpi" in res.stdout and "Avg bus bandwidth gloo" in res.stdout


def test_latency_loop_quiet_and_beside_a_pinned_busy_process(tmp_path):
    mpiexec = mpiexec_path()
    require(mpiexec is not None, "mpiexec not installed (pip install 'ddlcore[mpi]')")
    quiet, busy = tmp_path / "quiet.json", tmp_path / "busy.json"
    script = str(ROOT / "benchmarks" / "allreduce_loop.py")
    args = ["4096", "400", "--blocks", "2", "--mpi", "--place", "spread"]
    res = _run(
        [mpiexec, "-n", "2", sys.executable, script, *args, "--json", str(quiet)]
        + ["--busy-json", str(busy)],
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    for path in (quiet, busy):
        doc = json.loads(path.read_text())
        assert doc["nbytes"] == 4096 and doc["ranks"] == 2 and doc["place"] == "spread", doc
        assert doc["bound"] is False, doc  # mpiexec left the ranks every CPU it has
        for name in ("ddlcore", "mpi"):
            st = doc[name]
            assert 0 < st["median_us"] <= st["p90_us"] <= st["p99_us"] <= st["max_us"], st
    assert "ddlcore (busy)" in res.stdout and "mpi (busy)" in res.stdout, res.stdout


def test_bench_on_device_memory_with_the_simulator():
    try:
        import numba.cuda  # noqa: F401
    except ImportError:
        require(False, "numba-cuda not installed (pip install 'ddlcore[cuda]')")
    res = _run(
        [
            sys.executable,
            "-m",
            "ddlcore.launcher",
            "-np",
            "2",
            sys.executable,
            "-m",
            "ddlcore.bench",
            "-b",
            "1K",
            "-e",
            "16K",
            "-f",
            "4",
            "-n",
            "2",
            "-w",
            "1",
            "--memory",
            "cuda",
        ],
        env={"NUMBA_ENABLE_CUDASIM": "1"},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "cuda memory" in res.stdout and "Out of bounds values : 0 OK" in res.stdout


def test_gpu_kernel_benchmark_runs_on_the_simulator(tmp_path):
    """benchmarks/bench_cuda.py end to end on tiny sizes (its numbers mean nothing on the
    simulator; the pack it times is checked against the inputs inside the script)."""
    try:
        import numba.cuda  # noqa: F401
    except ImportError:
        require(False, "numba-cuda not installed (pip install 'ddlcore[cuda]')")
    out = tmp_path / "bench_cuda.json"
    res = _run(
        [
            sys.executable,
            "benchmarks/bench_cuda.py",
            "--mib",
            "0.002",
            "--reps",
            "1",
            "--tensors",
            "5",
            "--tensor-kib",
            "1",
            "--json",
            str(out),
        ],
        env={"NUMBA_ENABLE_CUDASIM": "1"},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Numba CUDA simulator" in res.stdout and "5 separate copies" in res.stdout
    rows = json.loads(out.read_text())
    assert set(rows["reduce"]["0.002"]) >= {"copy_GBps", "bfloat16", "float32", "int64"}
    assert "fused pack (addresses)" in rows["pack"]


@pytest.mark.parametrize(
    "nprocs,collective,dtype",
    [
        (2, "allreduce", "int8"),
        (3, "allreduce", "int64"),
        (3, "reduce_scatter", "uint8"),
        (2, "reduce_scatter", "int32"),
    ],
)
def test_bench_checks_integer_avg_as_the_floor_of_the_mean(nprocs, collective, dtype):
    res = _run(
        [
            sys.executable,
            "-m",
            "ddlcore.launcher",
            "-np",
            str(nprocs),
            sys.executable,
            "-m",
            "ddlcore.bench",
            "-C",
            collective,
            "-o",
            "avg",
            "-d",
            dtype,
            "-b",
            "3K",
            "-e",
            "300K",
            "-f",
            "10",
            "-n",
            "2",
            "-w",
            "1",
        ]
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Out of bounds values : 0 OK" in res.stdout


def test_bench_times_in_place_without_resetting_inside_the_loop():
    """The timed function is the collective alone: the reset runs once, before the loop (and
    again before the check), never per iteration."""
    import numpy as np

    import ddlcore
    from ddlcore import bench

    with ddlcore.init(rank=0, size=1) as comm:
        for collective in bench.COLLECTIVES:
            case = bench.Case(collective, 4096, np.dtype(np.float32), 0, 1, "sum", 0)
            reset, run, result = bench._ddl_ops(comm, case, in_place=True)
            resets = []

            def counted(reset=reset, resets=resets):
                resets.append(reset())

            bench._time(comm, run, 3, 7, counted)
            assert len(resets) == 1, collective
            result()[...] = -5.0  # not the input: a run that reset it would put case.x back
            run()
            # out of place, even in the in-place columns: the run writes the result anew
            anew = ("reduce_scatter", "gather", "scatter", "alltoall")
            assert (result() == -5.0).all() or collective in anew, collective


def test_bench_without_a_gpu_says_so_in_one_line():
    try:
        from ddlcore.kernels.cuda import unusable_reason

        reason = unusable_reason()
    except ImportError:
        reason = "numba-cuda not installed"
    if reason is None:
        pytest.skip("a GPU is usable here")
    res = _run([sys.executable, "-m", "ddlcore.bench", "--memory", "cuda", "-e", "4K"])
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--memory cuda" in lines[0] and "GPU" in lines[0], res.stderr


SIZES = (0, 1000, 1 << 18, (1 << 18) + 8, 16_000_000)  # around the slots of 2-4 ranks


def _real_choices(rank, size):
    """The choices a real job makes (comm.describe), and `job_choice`'s for its shape."""
    import ddlcore
    from ddlcore import config
    from ddlcore.__main__ import job_choice
    from ddlcore.algorithms import ALGORITHMS

    with ddlcore.init() as comm:
        host = "shm" if set(comm.transports.values()) <= {"shm"} else None
        if comm.nhosts > 1:  # the transport two ranks of one host talk
            local = [
                p
                for p in range(size)
                if p != rank and comm.peers[p].host_id == comm.peers[rank].host_id
            ]
            host = comm.transports[local[0]] if local else None
        real, planned = {}, {}
        for coll in ALGORITHMS:
            for nbytes in SIZES:
                real[f"{coll} {nbytes}"] = comm.describe(coll, nbytes).describe()
                planned[f"{coll} {nbytes}"] = job_choice(
                    coll,
                    comm.topology,
                    nbytes,
                    config.get("DDL_ALGO"),
                    config.get("DDL_CHUNK_BYTES"),
                    host,
                    None
                    if comm._host is None and comm._node is None
                    else (comm._host or comm._node).direct,
                ).describe()
        return real, planned


@pytest.mark.parametrize(
    "nprocs,env,rank_envs",
    [
        (3, {}, None),
        (2, {"DDL_ALGO": "rhd"}, None),
        (
            4,
            {"DDL_LINK_BW": "5e9,1e8", "DDL_LINK_LAT": "1e-6,1e-3"},
            {r: {"DDL_HOST_ID": h} for r, h in enumerate("aabb")},
        ),
    ],
    ids=["one-host", "one-host-rhd", "two-hosts"],
)
def test_info_choice_is_the_choice_of_a_real_job(nprocs, env, rank_envs):
    from tests.harness import run_ranks

    results = run_ranks(_real_choices, nprocs, env=env, rank_envs=rank_envs, timeout=180)
    for real, planned in results:
        assert real == planned
    if rank_envs is None:  # info itself, on the same shape, prints the same lines
        for nbytes in (1000, 16_000_000):
            res = _run(
                [
                    sys.executable,
                    "-m",
                    "ddlcore",
                    "info",
                    "--np",
                    str(nprocs),
                    "--bytes",
                    str(nbytes),
                ],
                env=env,
            )
            assert res.returncode == 0, res.stderr
            for coll in ("allreduce", "reduce_scatter", "allgather", "broadcast", "barrier"):
                line = f"  {coll:15s} {results[0][0][f'{coll} {nbytes}']}"
                assert line in res.stdout.splitlines(), (line, res.stdout)


def test_info_without_host_collectives_plans_schedules():
    """DDL_HOST_COLLECTIVES=off: info plans what such a job runs (the test above compares
    info with a real job; test_host_staged runs one with the setting)."""
    lines = {}
    for setting in ("auto", "off"):
        res = _run(
            [sys.executable, "-m", "ddlcore", "info", "--np", "3", "--bytes", "1000"],
            env={"DDL_HOST_COLLECTIVES": setting},
        )
        assert res.returncode == 0, res.stderr
        lines[setting] = [s for s in res.stdout.splitlines() if s.startswith("  allreduce ")]
    assert lines["auto"][0].split()[1] == "direct,", lines
    assert lines["off"][0].split()[1] != "direct,", lines


def test_p2p_benchmark_under_mpiexec_runs_and_says_what_it_skips():
    """The README's command: every transport named that can run is measured; one that cannot
    (ucx beside the MPICH wheel's own UCX) is skipped with the reason, as info reports it."""
    mpiexec = mpiexec_path()
    require(mpiexec is not None, "mpiexec not installed (pip install 'ddlcore[mpi]')")
    res = _run(
        [
            mpiexec,
            "-n",
            "2",
            sys.executable,
            "benchmarks/p2p.py",
            "--transport",
            "shm,tcp,ucx,mpi",
            "--max",
            "64",
        ],
        timeout=180,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "shm us" in res.stdout and "mpi4py us" in res.stdout
    info = _run([mpiexec, "-n", "1", sys.executable, "-m", "ddlcore", "info"], timeout=120)
    assert info.returncode == 0, info.stderr
    ucx_line = next(line for line in info.stdout.splitlines() if line.startswith("  ucx "))
    if "ucx us" not in res.stdout:  # skipped: said so, with the same reason info gives
        skip = next(line for line in res.stdout.splitlines() if line.startswith("# ucx: skipped"))
        assert "unavailable" in ucx_line and ucx_line.split(": ", 1)[1] in skip, (ucx_line, skip)


def test_info_says_when_the_cuda_kernels_cannot_run_and_why():
    from ddlcore.kernels.cuda import unusable_reason

    reason = unusable_reason()
    res = _run([sys.executable, "-m", "ddlcore", "info"])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  cuda "))
    said = " ".join(lines[at : at + 2])
    if reason is None:
        assert "cannot run here" not in said and "not available" not in said, said
    else:
        assert reason in said and ("cannot run here" in said or "not available" in said), said
    assert "Cython" in res.stdout and "not available" not in next(
        line for line in lines if line.strip().startswith("Cython")
    )
