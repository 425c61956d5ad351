"""`UcxTransport`, the backend: whether UCX can run in this process (ucxx installed, no foreign
UCX loaded, a context can be made) and its contexts.
"""

from __future__ import annotations

from ddlcore.transports.base import (
    Context,
    PeerInfo,
    Store,
    Transport,
    TransportOptions,
    options_or_default,
)
from ddlcore.transports.ucx.context import UcxContext
from ddlcore.transports.ucx.options import (
    _features,
    _foreign_ucx,
    _import_ucxx,
    net_device_rails,
    ucx_options,
)

_TRIED: dict[tuple[tuple[str, str], ...], str] = {}  # UCX_* settings -> "" (ok) or why not


class UcxTransport(Transport):
    """UCX through ucxx: InfiniBand, RoCE, TCP (and, later, GPU memory) across hosts."""

    name = "ucx"

    @classmethod
    def is_available(cls, options: TransportOptions | None = None) -> tuple[bool, str]:
        ucx_environ = options_or_default(options).ucx_environ
        clash = _foreign_ucx()
        if clash:
            return False, (
                f"this process already runs MPI with its own UCX ({clash}); ucxx's "
                "UCX cannot load beside it. Use DDL_TRANSPORT=mpi under mpiexec, or "
                "start the job with ddlrun/torchrun for ucx"
            )
        try:
            lib, _ = _import_ucxx()
        except ImportError as exc:
            import importlib.util

            reason = (
                f"ucxx is not installed ({exc}); pip install 'ddlcore[ucx]' (the ucxx-cu12 "
                "wheel brings UCX itself)"
            )
            if importlib.util.find_spec("ucp") is not None:
                reason += (
                    "; ucx-py (ucp) is installed but not supported: its synchronous layer "
                    "differs from ucxx's, and ucxx is its maintained successor"
                )
            return False, reason
        except Exception as exc:  # e.g. libucx fails to load
            return False, f"ucxx failed to import: {exc!r}; reinstall ucxx-cu12 / libucx-cu12"
        # A trial context per process and UCX_* settings, not per question: every init asks
        # twice (`links.local_transports`), and a context costs ~0.1-0.5 s on a busy machine.
        key = tuple(sorted(ucx_environ.items()))
        if key not in _TRIED:
            try:
                lib.UCXContext(ucx_options(ucx_environ), _features(lib))
                _TRIED[key] = ""
            except Exception as exc:
                _TRIED[key] = (
                    f"UCX cannot create a context here: {exc}; check the UCX_* variables "
                    "(UCX_TLS, UCX_NET_DEVICES; ucx_info -d lists the devices UCX sees)"
                )
        return (not _TRIED[key]), _TRIED[key]

    @classmethod
    def rails(cls, options: TransportOptions) -> int:
        """One per device ``UCX_NET_DEVICES`` lists (UCX's default, all devices: 1)."""
        return max(1, len(net_device_rails(options.ucx_environ)))

    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        return True

    def create_context(
        self,
        rank: int,
        size: int,
        store: Store,
        timeout: float,
        options: TransportOptions | None = None,
    ) -> Context:
        return UcxContext(rank, size, store, timeout, options_or_default(options))
