"""Broadcasts that make every rank start alike: parameters and buffers, and optimizer state.

Nothing is pickled: the optimizer state's structure goes as JSON (shapes, dtypes, plain scalars)
and its tensors as packed buffers, one broadcast per (dtype, device).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ddlcore.communicator import Communicator
from ddlcore.integrations.torch._common import (
    check_same_layout,
    communicator,
    pack_into,
    settle_stream,
    unpack_from,
)


def _broadcast_tensors(comm: Communicator, tensors: list[torch.Tensor], root: int) -> None:
    """Broadcast ``tensors`` from ``root`` in place: one collective per (dtype, device) group."""
    groups: dict[tuple[str, str], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((str(t.dtype), str(t.device)), []).append(t)
    for key in sorted(groups):
        members = [t for t in groups[key] if t.numel()]
        if not members:
            continue
        flat = torch.empty(sum(t.numel() for t in members), dtype=members[0].dtype,
                           device=members[0].device)
        if comm.rank == root:
            pack_into(flat, members)
        settle_stream(flat)
        comm.broadcast(flat, root=root)
        unpack_from(flat, members)


def _named_tensors(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, torch.nn.Module):
        params = params.state_dict()
    if isinstance(params, Mapping):
        return sorted(params.items(), key=lambda kv: kv[0])
    out = []
    for i, item in enumerate(params):
        if isinstance(item, torch.Tensor):
            out.append((f"[{i}]", item))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            out.append((str(item[0]), item[1]))
        else:
            raise TypeError(f"params[{i}] is a {type(item).__name__}; pass a module, a state_dict, "
                            "named_parameters() or tensors")
    return sorted(out, key=lambda kv: kv[0]) if out and out[0][0][0] != "[" else out


def broadcast_parameters(params: Any, comm: Communicator, root: int = 0) -> None:
    """Overwrite every rank's parameters and buffers with ``root``'s, in place.

    Parameters
    ----------
    params : torch.nn.Module, state_dict, named_parameters() or an iterable of tensors
        A module stands for its ``state_dict()`` (parameters and buffers, e.g. batch-norm
        statistics).
    comm : Communicator
    root : int
        The rank whose values everyone takes.

    Raises
    ------
    CollectiveMismatchError
        The ranks hold different tensors (names, shapes or dtypes): different models.
    """
    comm = communicator(comm, "broadcast_parameters")
    entries = _named_tensors(params)
    check_same_layout(comm, entries, "broadcast_parameters")
    with torch.no_grad():
        _broadcast_tensors(comm, [t.detach() for _, t in entries], root)


def _describe(value: Any, tensors: list[torch.Tensor], where: str) -> Any:
    """A JSON-able description of ``value``; tensors become references into ``tensors``."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return {"tensor": len(tensors) - 1, "shape": list(value.shape),
                "dtype": str(value.dtype).removeprefix("torch."), "cpu": not value.is_cuda}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if isinstance(value, (list, tuple)):
        return {"seq": [_describe(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)],
                "tuple": isinstance(value, tuple)}
    if isinstance(value, Mapping):
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in value):
            raise TypeError(f"broadcast_optimizer_state: {where} has keys that are not str or int")
        return {"map": [[k, _describe(v, tensors, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise TypeError(f"broadcast_optimizer_state: {where} is a {type(value).__name__}, which "
                    "cannot be sent without pickling (tensors, numbers, strings, lists, dicts can)")


def _rebuild(desc: Any, tensors: list[torch.Tensor]) -> Any:
    if "tensor" in desc:
        device = "cpu" if desc["cpu"] else torch.device("cuda", torch.cuda.current_device())
        t = torch.empty(desc["shape"], dtype=getattr(torch, desc["dtype"]), device=device)
        tensors.append(t)
        return t
    if "value" in desc:
        return desc["value"]
    if "seq" in desc:
        items = [_rebuild(d, tensors) for d in desc["seq"]]
        return tuple(items) if desc["tuple"] else items
    return {k: _rebuild(d, tensors) for k, d in desc["map"]}


def _broadcast_bytes(comm: Communicator, payload: bytes, root: int) -> bytes:
    length = np.array([len(payload)], np.int64)
    comm.broadcast(length, root=root)
    buf = np.frombuffer(payload, np.uint8).copy() if comm.rank == root else \
        np.empty(int(length[0]), np.uint8)
    comm.broadcast(buf, root=root)
    return buf.tobytes()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, comm: Communicator,
                              root: int = 0) -> None:
    """Give every rank ``root``'s optimizer state (e.g. momentum, Adam moments, step counts) and
    hyper-parameters (``param_groups``: learning rate ...), in place.

    The structure goes as JSON, the tensors as packed buffers; nothing is pickled. Works when
    the other ranks have no state yet (a fresh optimizer) as well as when they have some.

    Raises
    ------
    TypeError
        The state holds a value that is not a tensor, number, string, list or dict.
    CollectiveMismatchError
        The optimizers manage different parameters on different ranks.
    """
    comm = communicator(comm, "broadcast_optimizer_state")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    check_same_layout(comm, [(str(i), p) for i, p in enumerate(params)],
                       "broadcast_optimizer_state")
    state = optimizer.state_dict()
    sent: list[torch.Tensor] = []
    payload = json.dumps(_describe(state, sent, "state_dict()")).encode() \
        if comm.rank == root else b""
    desc = json.loads(_broadcast_bytes(comm, payload, root).decode())
    if comm.rank == root:
        with torch.no_grad():
            _broadcast_tensors(comm, [t.contiguous() for t in sent], root)
        return
    received: list[torch.Tensor] = []
    new_state = _rebuild(desc, received)
    with torch.no_grad():
        _broadcast_tensors(comm, received, root)
    optimizer.load_state_dict(new_state)
