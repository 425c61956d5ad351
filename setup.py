"""Build only the Cython extensions (CPU kernels, the shm transport's and the host collectives'
native halves, the communicator's compiled front end, the tcp transport's native steps, the
failure detector's heartbeat); everything else is declared in pyproject.toml."""

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

COMPILE_ARGS = ["-O3", "-fno-strict-aliasing"]

extensions = [
    Extension(
        "ddlcore.kernels.cpu._reduce",
        ["kernels/cpu/_reduce.pyx"],
        include_dirs=["kernels/cpu", numpy.get_include()],
        extra_compile_args=COMPILE_ARGS,
    ),
    Extension(
        "ddlcore.kernels.cpu._pack",
        ["kernels/cpu/_pack.pyx"],
        include_dirs=["kernels/cpu", numpy.get_include()],
        extra_compile_args=COMPILE_ARGS,
    ),
    Extension(
        "ddlcore.transports._arena",
        ["transports/_arena.pyx"],
        include_dirs=["transports", "kernels/cpu"],
        extra_compile_args=COMPILE_ARGS,
    ),
    Extension(
        "ddlcore.execution._frontend",
        ["ddlcore/execution/_frontend.pyx"],
        include_dirs=["transports", "kernels/cpu", numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=COMPILE_ARGS,
    ),
    Extension(
        "ddlcore.transports.tcp._steps",
        ["transports/tcp/_steps.pyx"],
        include_dirs=["kernels/cpu"],
        extra_compile_args=COMPILE_ARGS,
    ),
    Extension(
        "ddlcore.transports._shm",
        ["transports/_shm.pyx"],
        include_dirs=["transports"],
        extra_compile_args=COMPILE_ARGS,
    ),
    Extension(
        "ddlcore.resilience._heartbeat",
        ["ddlcore/resilience/_heartbeat.pyx"],
        include_dirs=["ddlcore/resilience"],
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=["-pthread"],
    ),
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False},
        include_path=["transports"],  # ddl_arena_api.pxd: the boards' engine, for two modules
    )
)
