"""Every kernel compiled to PTX without a GPU (``numba.cuda.compile_ptx`` needs only NVVM), and,
where the CUDA toolkit's ``ptxas`` is on PATH, each kernel's registers and spills as the
assembler reports them. The tests use this to prove every kernel builds for sm_80 and sm_90.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from typing import Any

import numpy as np
from ddlcore.kernels.cuda import packing, reduce, widen
from ddlcore.kernels.cuda.runtime import DTYPES, HALF_DTYPES, numba_cuda, storage_dtype

_FLOATS = [d for d in DTYPES if d.kind == "f" or d in HALF_DTYPES]


def _array(dtype: np.dtype) -> str:
    return f"{storage_dtype(dtype).name}[::1]"


def signatures() -> dict[str, tuple[Any, str]]:
    """Every kernel the API can launch: name -> (Python function, concrete signature)."""
    out: dict[str, tuple[Any, str]] = {}
    for dt in DTYPES:
        arr = _array(dt)
        for op in reduce.OPS:
            out[f"reduce_copy_{op.name.lower()}_{dt.name}"] = (
                reduce.reduce_copy_kernel(op, dt.name).py_func,
                f"void({arr}, {arr}, {arr}, int64)",
            )
        out[f"avg_scale_{dt.name}"] = (
            reduce.avg_scale_kernel(dt.name).py_func,
            f"void({arr}, int64, int64)",
        )
    for dt in HALF_DTYPES:
        arr = _array(dt)
        out[f"widen_copy_{dt.name}"] = (
            widen.widen_copy_kernel(dt.name).py_func,
            f"void(float32[::1], {arr}, int64)",
        )
        for op in reduce.OPS:
            out[f"reduce_widen_{op.name.lower()}_{dt.name}"] = (
                widen.reduce_widen_kernel(op, dt.name).py_func,
                f"void(float32[::1], float32[::1], {arr}, int64)",
            )
        out[f"narrow_copy_{dt.name}"] = (
            widen.narrow_copy_kernel(dt.name).py_func,
            f"void({arr}, float32[::1], int64, int64)",
        )
    for itemsize in (1, 2, 4, 8):
        out[f"copy_ranges_{itemsize * 8}bit"] = (
            packing.copy_ranges_kernel(itemsize).py_func,
            "void(int64[::1], int64, int64)",
        )
    for src in _FLOATS:
        for dst in _FLOATS:
            out[f"cast_ranges_{src.name}_to_{dst.name}"] = (
                packing.cast_ranges_kernel(src.name, dst.name).py_func,
                "void(int64[::1], int64, int64, float64, boolean)",
            )
    return out


def compile_all_ptx(cc: tuple[int, int] = (8, 0)) -> dict[str, str]:
    """PTX of every kernel for compute capability ``cc`` (no GPU needed, only NVVM)."""
    cuda = numba_cuda()
    return {name: cuda.compile_ptx(fn, sig, cc=cc)[0] for name, (fn, sig) in signatures().items()}


def ptxas_usage(ptx: dict[str, str], cc: tuple[int, int]) -> dict[str, dict[str, int]] | None:
    """Per kernel, what ``ptxas -v`` reports: registers, spill_stores and spill_loads (bytes).
    None when ptxas is not on PATH."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    usage = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in ptx.items():
            path = os.path.join(tmp, f"{name}.ptx")
            with open(path, "w") as f:
                f.write(text)
            run = subprocess.run(
                [ptxas, f"-arch=sm_{cc[0]}{cc[1]}", "-v", "-o", os.devnull, path],
                capture_output=True,
                text=True,
                check=True,
            )
            report = run.stdout + run.stderr
            registers = re.search(r"Used (\d+) registers", report)
            spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
            usage[name] = {
                "registers": int(registers.group(1)) if registers else 0,
                "spill_stores": int(spills.group(1)) if spills else 0,
                "spill_loads": int(spills.group(2)) if spills else 0,
            }
    return usage
