"""Every CUDA kernel (reduce, avg, bfloat16, widen/narrow, fused pack/unpack) compiles to real PTX
for sm_80 and sm_90 without a GPU; where ``ptxas`` is on PATH, each is assembled and must not
spill (its registers are reported). sm_80 and sm_90 compile in two processes at once."""

from __future__ import annotations

import re

import pytest

from tests.harness import run_ranks

CCS = [(8, 0), (9, 0)]
KERNELS = 8 * 5 + 2 * 6 + 4 + 4 * 4  # reduce+avg per dtype, widen/narrow per half, pack ones


def _compile(rank: int, size: int) -> tuple[dict[str, str], dict[str, dict[str, int]] | None]:
    from ddlcore.kernels import cuda as kcuda

    cc = CCS[rank]
    ptx = kcuda.compile_all_ptx(cc)
    return ptx, kcuda.ptxas_usage(ptx, cc)


@pytest.fixture(scope="module")
def compiled():
    results = run_ranks(_compile, len(CCS), env={"NUMBA_ENABLE_CUDASIM": None}, timeout=600)
    return dict(zip(CCS, results, strict=True))


@pytest.mark.parametrize("cc", CCS, ids=["sm_80", "sm_90"])
def test_every_kernel_compiles_to_ptx(compiled, cc):
    ptx, _ = compiled[cc]
    assert len(ptx) == KERNELS
    for name, text in ptx.items():
        assert f".target sm_{cc[0]}{cc[1]}" in text, name
        assert re.search(r"\.entry\s", text), name
        assert ".local" not in text, f"{name} uses local memory"
    # float16 is rounded from float32 in one conversion, never through float64
    f16 = ptx["reduce_copy_sum_float16"]
    assert "cvt.rn.f16.f32" in f16 and ".f64" not in f16
    # bfloat16 works on float32 and 32-bit integers only: no float64 anywhere
    for name in ("reduce_copy_sum_bfloat16", "avg_scale_bfloat16", "narrow_copy_bfloat16"):
        assert ".f64" not in ptx[name], name
    # the pack kernels reach tensors through table addresses, as global memory
    assert "ld.global.f32" in ptx["cast_ranges_float32_to_bfloat16"]
    assert "st.global.u16" in ptx["cast_ranges_float32_to_bfloat16"]


@pytest.mark.parametrize("cc", CCS, ids=["sm_80", "sm_90"])
def test_no_kernel_spills(compiled, cc, record_property):
    _, usage = compiled[cc]
    if usage is None:
        pytest.skip("ptxas not on PATH (install the CUDA toolkit to check registers and spills)")
    registers = {name: u["registers"] for name, u in usage.items()}
    record_property("registers", registers)
    print(
        f"sm_{cc[0]}{cc[1]} registers: "
        + ", ".join(f"{name}={count}" for name, count in sorted(registers.items()))
    )
    spilling = {name: u for name, u in usage.items() if u["spill_stores"] or u["spill_loads"]}
    assert not spilling, spilling
