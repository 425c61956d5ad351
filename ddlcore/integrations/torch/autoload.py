"""The ``torch.backends`` entry point: torch calls `register_ddl` at the end of ``import torch``.

It lives apart from `backend`, which imports torch at its top: when a script imports
``ddlcore.integrations.torch`` before torch, torch's import (and so this entry point) runs while
`backend` is still half loaded. Then registering here finds nothing to call, and the package
registers the backend itself once its import completes.
"""

from __future__ import annotations

import logging

_log = logging.getLogger("ddlcore")


def register_ddl() -> None:
    """Register the backend "ddl". Never raises: torch turns any exception of an entry point
    into a failed ``import torch``."""
    try:
        from ddlcore.integrations.torch import backend

        if backend.dist.is_available():
            backend.register()
    except Exception:  # a half-loaded backend (see above) or a torch that changed its API
        _log.debug("ddlcore: the torch.backends entry point did not register 'ddl'", exc_info=True)
