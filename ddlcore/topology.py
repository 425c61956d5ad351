"""Topology: which ranks share a host, found from the host identities exchanged at init.

Two ranks are on the same host only if they share hostname AND network namespace, so hosts
emulated with network namespaces on one machine count as different hosts; ``DDL_HOST_ID``
overrides the identity. Local ranks are numbered by global rank within each host, and hosts by
their lowest global rank.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from ddlcore import config


def host_identity(environ: Mapping[str, str] | None = None) -> str:
    override = config.get("DDL_HOST_ID", environ)
    if override:
        return override
    try:
        netns = f"netns:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:  # not Linux, or /proc hidden: hostname alone
        netns = "netns:?"
    return f"{socket.gethostname()}/{netns}"


@dataclass(frozen=True)
class HostLayout:
    """Where each rank sits: host index per rank, and this rank's local position."""

    host_of: tuple[int, ...]      # host index of every rank
    local_rank: int
    local_size: int
    nhosts: int

    @property
    def ranks_per_host(self) -> tuple[int, ...]:
        return tuple(self.host_of.count(h) for h in range(self.nhosts))


def layout(host_ids: list[str], rank: int) -> HostLayout:
    index: dict[str, int] = {}
    host_of = tuple(index.setdefault(h, len(index)) for h in host_ids)
    mine = host_of[rank]
    local = [r for r, h in enumerate(host_of) if h == mine]
    return HostLayout(host_of, local.index(rank), len(local), len(index))
