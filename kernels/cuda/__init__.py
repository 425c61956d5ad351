"""Numba CUDA kernels (see ``reduce``). Importing this package does not import numba."""

from ddlcore.kernels.cuda.reduce import (
    DTYPES,
    avg_scale,
    compile_all_ptx,
    describe,
    launch_config,
    reduce_copy,
    reduce_into,
)

__all__ = ["DTYPES", "avg_scale", "compile_all_ptx", "describe", "launch_config", "reduce_copy",
           "reduce_into"]
