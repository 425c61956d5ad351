"""UCX transport specifics the conformance suite does not reach: UCX configuration precedence
(the user's ``UCX_*`` environment wins over our defaults; nothing is written to ``os.environ``),
and the paths of messages larger than the eager size (payload on its own UCX tag: received
into a temporary buffer, drained on a mismatch, handed to a receive posted mid-transfer).
"""

from __future__ import annotations

import os
import subprocess
import sys
from unittest.mock import patch

import pytest

from tests.harness import require

JOB_TIMEOUT_S = 60.0


@pytest.fixture
def ucx():
    from ddlcore.transports.ucx import UcxTransport

    require(*UcxTransport.is_available())
    return UcxTransport


def _python(code: str, env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        text=True,
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


# --- configuration --------------------------------------------------------------------------------
def test_user_ucx_variables_win_over_our_defaults():
    from ddlcore.transports.ucx import _UCX_DEFAULTS, ucx_options

    with patch.dict(os.environ, {"UCX_KEEPALIVE_INTERVAL": "7s"}):
        assert "KEEPALIVE_INTERVAL" not in ucx_options()
    with patch.dict(os.environ, {}, clear=True):
        assert ucx_options() == _UCX_DEFAULTS
    assert ucx_options({"UCX_KEEPALIVE_INTERVAL": ""}) == {}  # set, even empty, is the user's


def test_import_touches_neither_ucxx_nor_the_environment():
    code = (
        "import os, sys; before = dict(os.environ); import ddlcore.transports.ucx; "
        "print('ucxx' in sys.modules, dict(os.environ) == before)"
    )
    assert _python(code, {}) == "False True"


def test_ucxx_import_leaves_the_environment_as_the_user_set_it(ucx):
    # ucxx's __init__ sets UCX_RNDV_THRESH, UCX_MEMTYPE_CACHE, ... when unset; we put them back.
    code = (
        "import os; from ddlcore.transports.ucx import UcxTransport; "
        "ok = UcxTransport.is_available()[0]; "
        "print(ok, sorted(k + '=' + v for k, v in os.environ.items() if k.startswith('UCX_')))"
    )
    assert _python(code, {}) == "True []"
    assert _python(code, {"UCX_RNDV_THRESH": "16384"}) == "True ['UCX_RNDV_THRESH=16384']"


def _one_rank_context(environ: dict[str, str], look=None):
    """(UCX config, the published worker address), or what ``look(ctx)`` says of the context."""
    from ddlcore.transports.ucx import UcxTransport

    from ddlcore.job.store import PrefixStore, StoreClient, StoreServer

    server = StoreServer("127.0.0.1", 0)
    client = StoreClient("127.0.0.1", server.port, 2.0, rank=0, size=1)
    try:
        with patch.dict(os.environ, environ):
            ctx = UcxTransport().create_context(0, 1, PrefixStore(client, "t/"), 2.0)
        try:
            if look is not None:
                return look(ctx)
            published = client.get("t/ucx/addr/0")
            return dict(ctx._ucx.config), published
        finally:
            ctx.close()
    finally:
        client.close()
        server.close()


def test_context_takes_our_keepalive_unless_the_user_set_one(ucx):
    config, published = _one_rank_context({})
    assert published  # the worker address every peer connects to
    assert float(config["KEEPALIVE_INTERVAL"].rstrip("us")) == pytest.approx(1e6)
    config, _ = _one_rank_context({"UCX_KEEPALIVE_INTERVAL": "3s"})
    assert float(config["KEEPALIVE_INTERVAL"].rstrip("us")) == pytest.approx(3e6)


def test_gpu_direct_auto_asks_ucx_for_the_cuda_memory_type(ucx):
    """DDL_GPU_DIRECT=auto trusts UCX with device memory only when ucp_context_query lists
    the CUDA memory type (ucxx's cuda_support only reads UCX_TLS: yes even without a GPU)."""
    from ddlcore.transports.ucx import cuda_memory

    def look(ctx):
        return ctx.device_memory, cuda_memory(ctx._ucx), bool(ctx._ucx.cuda_support)

    assert _one_rank_context({"DDL_GPU_DIRECT": "on"}, look)[0] is True
    assert _one_rank_context({"DDL_GPU_DIRECT": "off"}, look)[0] is False
    direct, cuda, _ = _one_rank_context({"DDL_GPU_DIRECT": "auto"}, look)
    assert direct is cuda
    if not os.path.exists("/dev/nvidiactl"):  # no GPU driver: UCX can only move host memory
        assert cuda is False


def test_missing_ucxx_is_reported_with_what_to_install():
    from ddlcore.transports.ucx import UcxTransport

    with patch.dict(sys.modules, {"ucxx": None, "ucxx._lib": None, "ucxx._lib.libucxx": None}):
        ok, reason = UcxTransport.is_available()
    assert not ok and "pip install 'ddlcore[ucx]'" in reason, reason


def test_refuses_to_load_beside_the_mpich_wheels_own_ucx():
    """mpi4py with the MPICH wheel loads MPICH's bundled libucs; ucxx's UCX would clash with it
    in the same process, so ucx says it is unavailable and why instead of failing to load."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        require(False, "mpi4py is not installed (pip install 'ddlcore[mpi]')")
    code = (
        "from mpi4py import MPI\n"
        "from ddlcore.transports.ucx import UcxTransport\n"
        "print(UcxTransport.is_available())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDL_", "PMI_"))}
    from importlib import metadata

    try:
        bundled = any("libucs" in str(f) for f in metadata.files("mpich") or ())
    except metadata.PackageNotFoundError:
        bundled = False
    if not bundled:
        pytest.skip("this MPI does not bundle its own UCX: nothing to clash with")
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert res.returncode == 0, res.stderr
    assert (
        "(False," in res.stdout and "own UCX" in res.stdout and "DDL_TRANSPORT=mpi" in res.stdout
    ), res.stdout
