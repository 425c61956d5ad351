"""What the harness's fork server (tests/harness.py) does once for every rank it forks: imports
that every rank makes, and the transport registry's scan of the installed metadata.

Nothing here may read a process-wide setting (``harness.PROCESS_WIDE``: numba, ucxx read theirs
at import) or start a thread that does not survive a fork (OpenBLAS's, which NumPy starts, stop
and restart around it): ranks are forked from this state.
"""

import ddlcore.transports
import ml_dtypes  # noqa: F401
import numpy  # noqa: F401
import pytest  # noqa: F401

import ddlcore  # noqa: F401
import ddlcore.bootstrap  # noqa: F401
import ddlcore.communicator  # noqa: F401
import tests.collectives.matrix  # noqa: F401
import tests.harness  # noqa: F401

ddlcore.transports.names()
