"""The ways a collective runs, one object each (Horovod's op managers): the communicator checks
a call, then walks `PATHS` in order and the first path whose ``plan`` accepts the call runs it
(``run``); after a failure it tells every path (``abort``), which tells the peers of its call in
progress that the failing step did not reach.

* `BoardsPath`: every rank on this host, through the shared boards (``hostcoll``);
* `HostStagedPath`: mdring across hosts, its host dimensions through this host's boards;
* `DevicePath`: device buffers, a schedule on CUDA streams (``device_engine``);
* `SchedulePath`: everything else, a schedule over the links (``engine``).

Each owns its caches and staging; what they share is the `Context` they are made with.
"""

from __future__ import annotations

from ddlcore.execution.paths.base import ON_BOARDS, Context, Path, Plan, label
from ddlcore.execution.paths.boards import BoardsPath
from ddlcore.execution.paths.device import DevicePath
from ddlcore.execution.paths.host_staged import HostStagedPath
from ddlcore.execution.paths.schedule import SchedulePath

# In the order the communicator asks them.
PATHS = (BoardsPath, HostStagedPath, DevicePath, SchedulePath)

__all__ = [
    "ON_BOARDS",
    "PATHS",
    "BoardsPath",
    "Context",
    "DevicePath",
    "HostStagedPath",
    "Path",
    "Plan",
    "SchedulePath",
    "label",
]
