"""Device arrays through the public API, on Numba's CUDA simulator (no GPU needed): every
collective, results of the same kind, in place and async, and mixing host and device refused;
through the host boards (whole-buffer staging, the default on one host) and through the
stream-pipelined device engine (any schedule algorithm)."""

from __future__ import annotations

import importlib.util

import ml_dtypes
import numpy as np
import pytest

from tests.collectives.matrix import few_simulator_threads
from tests.harness import require, run_ranks

SIM = {"NUMBA_ENABLE_CUDASIM": "1"}
DTYPES = [
    np.float16,
    ml_dtypes.bfloat16,
    np.float32,
    np.float64,
    np.int8,
    np.uint8,
    np.int32,
    np.int64,
]
COUNTS = [0, 1, 7, 1001]
OPS = ["sum", "avg", "max"]


def _cases(thin: bool):
    """(dtype, count, allreduce ops): every dtype x count x op, or the thin slice for a transport
    or algorithm the full matrix already proves the engine over: every dtype (sum) at the count
    of many chunks, and float32 (every op) at every count."""
    for dtype in DTYPES:
        for count in COUNTS:
            if not thin:
                yield dtype, count, OPS
            elif dtype is np.float32:
                yield dtype, count, OPS
            elif count == COUNTS[-1]:
                yield dtype, count, OPS[:1]


def _numba_cuda_installed() -> bool:
    try:
        import numba.cuda  # noqa: F401
    except ImportError:
        return False
    return True


def _uploader(dtype):
    """(to the device, back to the host) for arrays of dtype: Numba device arrays, except for
    bfloat16 on a real GPU, where Numba has no such arrays: PyTorch CUDA tensors there (None
    where torch is missing)."""
    import os

    from numba import cuda

    if dtype is not ml_dtypes.bfloat16 or os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return cuda.to_device, lambda d: d.copy_to_host()
    try:
        import torch
    except ImportError:
        return None

    def up(x):
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16).cuda()

    return up, lambda t: t.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def _device_collectives(rank, size, engine_expected=None, direct=False, thin=False):
    import os

    from ddlcore.kernels import reference
    from numba import cuda

    import ddlcore
    from ddlcore.device import is_simulator
    from tests.collectives.matrix import check_close, random_input

    few_simulator_threads()
    with ddlcore.init() as comm:
        for dtype, count, ops in _cases(thin):
            if _uploader(dtype) is None:
                continue  # a real GPU without torch: no way to hold bfloat16 on the device
            to_device, to_host = _uploader(dtype)
            for op in ops:
                xs = [random_input(dtype, count, r, 7, op) for r in range(size)]
                d = to_device(xs[rank])
                got = comm.allreduce(d, op=op)
                assert type(got) is type(d), type(got)
                check_close(
                    to_host(got),
                    reference.reduce_ref(xs, op),
                    dtype,
                    op,
                    size,
                    f"allreduce {np.dtype(dtype)} {op} {count}",
                )
                comm.allreduce(d, op=op, out=d)  # in place on the device
                check_close(to_host(d), reference.reduce_ref(xs, op), dtype, op, size, "in place")
            xs = [random_input(dtype, count * size, r, 8, "sum") for r in range(size)]
            rs = comm.reduce_scatter(to_device(xs[rank]))
            check_close(
                to_host(rs),
                reference.reduce_ref(xs, "sum")[rank * count : (rank + 1) * count],
                dtype,
                "sum",
                size,
                "reduce_scatter",
            )
            ag = comm.allgather(to_device(xs[rank][:count]))
            np.testing.assert_array_equal(to_host(ag), np.concatenate([x[:count] for x in xs]))
            b = to_device(xs[rank][:count])
            assert comm.broadcast(b, root=size - 1) is b
            np.testing.assert_array_equal(to_host(b), xs[size - 1][:count])
        h = comm.allreduce_async(cuda.to_device(np.full(5, rank + 1, np.float32)), op="sum")
        np.testing.assert_array_equal(h.wait().copy_to_host(), size * (size + 1) / 2)
        if engine_expected is not None:  # which data path the calls took
            assert bool(comm._device_path.slots) == engine_expected
        if os.environ.get("DDL_SEGMENTS") and not is_simulator():
            # a pipelined mdring: its schedule streams ran on CUDA streams of their own
            assert any(s._streams for s in comm._device_path.slots.values())
        if direct:  # the transport moved the device arrays' bytes itself (no pinned slots)
            assert all(comm._links.pair(p).device_memory for p in range(size) if p != rank)
        try:
            comm.allreduce(cuda.to_device(np.ones(3, np.float32)), out=np.ones(3, np.float32))
        except ValueError as exc:
            assert "same device" in str(exc)
        else:
            raise AssertionError("mixing host and device memory was accepted")
    return True


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_device_arrays_on_the_simulator(nprocs, pools):
    require(_numba_cuda_installed(), "numba-cuda not installed (pip install 'ddlcore[cuda]')")
    pools.run(_device_collectives, nprocs, env=SIM, timeout=240)


# The full matrix through the engine once (rhd on three ranks: a world that is not a power of
# two folds, so its schedule has every kind of step); the other algorithms and transports (ucx
# and mpi moving device memory themselves) carry the thin slice.
@pytest.mark.parametrize(
    "nprocs,algo,transport,thin",
    [
        pytest.param(3, "rhd", "tcp", False, marks=pytest.mark.slow),
        (2, "ring", "tcp", True),
        (3, "ring", "shm", True),
        (3, "ring", "ucx", True),
        (2, "rhd", "mpi", True),
    ],
)
def test_device_arrays_through_the_stream_engine(nprocs, algo, transport, thin, pools):
    """A schedule algorithm: chunks pipelined over (simulated) CUDA streams, small chunks so
    every size above a few elements takes many. Over ucx and mpi with DDL_GPU_DIRECT=on the
    transports take the device arrays' memory directly."""
    require(_numba_cuda_installed(), "numba-cuda not installed (pip install 'ddlcore[cuda]')")
    direct = transport in ("ucx", "mpi")
    env = dict(
        SIM,
        DDL_ALGO=algo,
        DDL_TRANSPORT=transport,
        DDL_CHUNK_BYTES="256",
        DDL_GPU_DIRECT="on" if direct else "off",
    )
    if transport == "mpi":
        run_ranks(
            _device_collectives,
            nprocs,
            True,
            direct,
            thin,
            env=env,
            timeout=240,
            launcher="mpiexec",
        )
    else:
        pools.run(_device_collectives, nprocs, True, direct, thin, env=env, timeout=240)


def _gpu_present() -> bool:
    if not _numba_cuda_installed():
        return False
    from ddlcore.device import cuda_usable

    return cuda_usable()


def _frameworks(rank, size):
    """Real GPU: CuPy arrays and PyTorch CUDA tensors come back as themselves, on their device."""
    import ddlcore

    seen = []
    with ddlcore.init() as comm:
        try:
            import cupy
        except ImportError:
            cupy = None
        if cupy is not None:
            x = cupy.full(1001, rank + 1, dtype=cupy.float32)
            y = comm.allreduce(x)
            assert isinstance(y, cupy.ndarray)
            assert float(y[0]) == size * (size + 1) / 2
            seen.append("cupy")
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None and torch.cuda.is_available():
            t = torch.full((4, 3), float(rank + 1), device="cuda")
            t.mul_(2)  # queued on the current stream: the collective must see it
            y = comm.allreduce(t, op="avg")
            assert isinstance(y, torch.Tensor) and y.is_cuda and y.shape == t.shape
            assert torch.allclose(y, torch.full_like(t, float(size + 1)))
            comm.allreduce(t, out=t)
            assert torch.allclose(t, torch.full_like(t, float(size * (size + 1))))
            seen.append("torch")
    return seen


@pytest.mark.parametrize(
    "nprocs,algo,transport",
    [(1, "", ""), (2, "", ""), (2, "ring", "tcp"), (2, "ring", "ucx"), (4, "mdring", "shm")],
)
def test_device_arrays_on_a_gpu(nprocs, algo, transport):
    """On a real GPU: the board path (default on one host), the stream engine (ring) staging
    through pinned memory (tcp), UCX moving device memory itself (DDL_GPU_DIRECT=auto: direct
    when UCX reports CUDA support), and mdring pipelined in segments on a 2x2 box (its
    schedule's streams on host threads and CUDA streams of their own)."""
    # Checked here, not at import: rank processes import this module before they set
    # NUMBA_ENABLE_CUDASIM, and numba must not be imported before that.
    if not _gpu_present():
        pytest.skip("needs a real GPU (the simulator test covers CI)")
    if transport == "ucx":
        require(
            importlib.util.find_spec("ucxx") is not None,
            "ucxx is not installed (pip install 'ddlcore[ucx]')",
        )
    # Small chunks: calls of one chunk or less are staged whole, not run on the streams.
    env = {"DDL_ALGO": algo, "DDL_TRANSPORT": transport, "DDL_CHUNK_BYTES": "256"} if algo else {}
    if algo == "mdring":
        env.update(DDL_TOPOLOGY="2x2", DDL_SEGMENTS="4")
    run_ranks(
        _device_collectives,
        nprocs,
        bool(algo) if nprocs > 1 else None,
        transport == "ucx",
        env=env,
        timeout=300,
    )
    print(run_ranks(_frameworks, nprocs, env=env, timeout=300))


def test_debug_log_says_whether_device_memory_goes_straight_to_the_transport(tmp_path):
    """DDL_DEBUG=1 names the peers whose transport takes device memory (ucx with
    DDL_GPU_DIRECT=on here), or says the chunks go through pinned host slots (tcp)."""
    import os
    import subprocess
    import sys

    require(_numba_cuda_installed(), "numba-cuda not installed (pip install 'ddlcore[cuda]')")
    script = tmp_path / "one_call.py"
    script.write_text(
        "import numpy as np\nfrom numba import cuda\nimport ddlcore\n"
        "with ddlcore.init() as comm:\n"
        "    comm.allreduce(cuda.to_device(np.ones(1000, np.float32)))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    # 1 KiB chunks: a call of one chunk or less is staged whole, not run on the streams
    env.update(SIM, DDL_DEBUG="1", DDL_ALGO="ring", DDL_GPU_DIRECT="on", DDL_CHUNK_BYTES="1024")
    for transport, want in (
        ("ucx", "(device memory straight to and from rank 1)"),
        ("tcp", "(through pinned host slots)"),
    ):
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "ddlcore.launcher",
                "-np",
                "2",
                "--transport",
                transport,
                str(script),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert res.returncode == 0, res.stderr
        assert "on CUDA streams " + want in res.stderr, res.stderr


def _streams_and_context_body(rank, size):
    """Record what a device collective through the boards does around the caller's streams."""
    import contextlib

    from numba import cuda

    import ddlcore
    from ddlcore import device

    entered: list[int] = []  # the GPUs whose context is current, innermost last
    staged: list[tuple[str, list[int]]] = []
    outs: list[bool] = []

    @contextlib.contextmanager
    def recording(gpu):
        entered.append(gpu)
        try:
            yield
        finally:
            entered.pop()

    def logged(name, method):
        def run(*args, **kwargs):
            staged.append((name, list(entered)))
            return method(*args, **kwargs)

        return run

    ready = device.ready_event
    device.on_device = recording
    device.ready_event = lambda obj, out=None: (outs.append(out is not None), ready(obj, out))[1]
    staging = device.DeviceStaging
    staging.download = logged("download", staging.download)
    staging.upload = staticmethod(logged("upload", staging.upload))
    few_simulator_threads()
    with ddlcore.init() as comm:
        x = cuda.to_device(np.arange(10, dtype=np.float32) + rank)
        out = cuda.device_array(10, np.float32)
        comm.allreduce(x, out=out)  # 40 bytes: through the boards' slots, staged whole
        np.testing.assert_array_equal(out.copy_to_host(), size * np.arange(10) + sum(range(size)))
        comm.allreduce(x)  # no out: nothing of the caller's to wait for
    return staged, outs


def test_device_buffers_are_staged_in_their_gpus_context_and_out_streams_are_seen():
    """The board paths download and upload inside the buffers' GPU context (a caller on the
    legacy default stream of GPU k is ordered only by that context's legacy stream), and the
    caller's ``out`` reaches ready_event (an out bound to another stream is waited for)."""
    require(_numba_cuda_installed(), "numba-cuda is not installed (pip install 'ddlcore[cuda]')")
    for staged, outs in run_ranks(_streams_and_context_body, 2, env=SIM, timeout=120):
        assert staged[:2] == [("download", [0]), ("upload", [0])], staged
        assert outs == [True, False]


def _mixed_memory_body(rank, size, expect_mismatch):
    """Rank 0 passes a device array, the others host arrays, to a schedule (ring over tcp)."""
    from numba import cuda

    import ddlcore

    few_simulator_threads()
    n = 600_011  # 2.4 MB: one device chunk (4 MiB), three host chunks (1 MiB)
    x = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
    want = sum(np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(size))
    with ddlcore.init() as comm:
        arg = cuda.to_device(x) if rank == 0 else x
        try:
            got = comm.allreduce(arg)
        except ddlcore.CollectiveMismatchError as exc:
            assert expect_mismatch, exc
            assert "device (CUDA) buffers on some ranks" in str(exc), exc
            return "mismatch"
        assert not expect_mismatch, "ranks chunking differently were not told"
        got = got.copy_to_host() if rank == 0 else got
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        return "ok"


@pytest.mark.parametrize("chunk", ["", "1M"])
def test_device_buffers_on_some_ranks_and_host_buffers_on_others(chunk):
    """Device schedules take bigger chunks than host ones by default: ranks that mix them are
    told (every message carries its schedule's chunk in its check word); with DDL_CHUNK_BYTES
    set, both kinds cut the buffer alike and the result is right."""
    require(_numba_cuda_installed(), "numba-cuda not installed (pip install 'ddlcore[cuda]')")
    env = dict(SIM, DDL_ALGO="ring", DDL_TRANSPORT="tcp", DDL_CHUNK_BYTES=chunk or None)
    want = "ok" if chunk else "mismatch"
    assert run_ranks(_mixed_memory_body, 2, not chunk, env=env, timeout=120) == [want] * 2
