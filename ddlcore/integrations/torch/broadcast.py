"""Broadcasts that make every rank start alike: parameters and buffers, and optimizer state.

Nothing is pickled: the optimizer state's structure goes as JSON (shapes, dtypes, plain scalars)
and its tensors as packed bytes, one broadcast per device.
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
    unpack_from,
)


def _broadcast_tensors(comm: Communicator, tensors: list[torch.Tensor], root: int) -> None:
    """Broadcast ``tensors`` from ``root`` in place, as bytes: one collective per device, for
    any dtype (bool buffers, complex ...), non-contiguous tensors through a contiguous copy.
    Devices go in the order they first appear in ``tensors`` (the same on every rank when the
    tensors are laid out alike, whichever GPU each rank holds them on)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_device.setdefault(t.device, []).append(t)
    for members in by_device.values():
        staged = [t if t.is_contiguous() else t.contiguous() for t in members]
        raw = [t.reshape(-1).view(torch.uint8) for t in staged]
        flat = torch.empty(sum(r.numel() for r in raw), dtype=torch.uint8, device=members[0].device)
        if comm.rank == root:
            pack_into(flat, raw)
        comm.broadcast(flat, root=root)
        unpack_from(flat, raw)
        for t, copy in zip(members, staged, strict=True):
            if copy is not t:
                t.copy_(copy)


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
            raise TypeError(
                f"params[{i}] is a {type(item).__name__}; pass a module, a state_dict, "
                "named_parameters() or tensors"
            )
    return sorted(out, key=lambda kv: kv[0]) if out and out[0][0][0] != "[" else out


def broadcast_parameters(params: Any, comm: Communicator, root: int = 0) -> None:
    """Overwrite every rank's parameters and buffers with ``root``'s, in place.

    Parameters
    ----------
    params : torch.nn.Module, state_dict, named_parameters() or an iterable of tensors
        A module stands for its ``state_dict()`` (parameters and buffers, e.g. batch-norm
        statistics).
    comm : Communicator
        The ranks to make alike.
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


# The dtypes a description may name: the wire selects from this table, it never looks a name up.
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}


def _describe(value: Any, tensors: list[torch.Tensor], where: str) -> Any:
    """A JSON-able description of ``value``; tensors become references into ``tensors``."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(
                f"broadcast_optimizer_state: {where} has dtype {value.dtype}, "
                f"not one of {', '.join(_DTYPES)}"
            )
        tensors.append(value.detach())
        return {
            "tensor": len(tensors) - 1,
            "shape": list(value.shape),
            "dtype": dtype,
            "cpu": not value.is_cuda,
        }
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if isinstance(value, (list, tuple)):
        return {
            "seq": [_describe(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)],
            "tuple": isinstance(value, tuple),
        }
    if isinstance(value, Mapping):
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in value):
            raise TypeError(f"broadcast_optimizer_state: {where} has keys that are not str or int")
        return {"map": [[k, _describe(v, tensors, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise TypeError(
        f"broadcast_optimizer_state: {where} is a {type(value).__name__}, which "
        "cannot be sent without pickling (tensors, Python numbers, strings, lists, "
        "dicts can; convert NumPy scalars with float() or int())"
    )


def _rebuild(desc: Any, tensors: list[torch.Tensor], gpu: torch.device | None = None) -> Any:
    """The value ``desc`` describes, its tensors new (on ``gpu`` where the root's were on a
    GPU; default the current one) and appended to ``tensors`` in the order `_describe` met
    them."""
    if "tensor" in desc:
        device = "cpu" if desc["cpu"] else gpu or torch.device("cuda", torch.cuda.current_device())
        t = torch.empty(desc["shape"], dtype=_DTYPES[desc["dtype"]], device=device)
        tensors.append(t)
        return t
    if "value" in desc:
        return desc["value"]
    if "seq" in desc:
        items = [_rebuild(d, tensors, gpu) for d in desc["seq"]]
        return tuple(items) if desc["tuple"] else items
    return {k: _rebuild(d, tensors, gpu) for k, d in desc["map"]}


def _rebuild_state_dict(desc: Any, tensors: list[torch.Tensor], params: list[torch.Tensor]) -> Any:
    """`_rebuild` of an optimizer's state_dict: each parameter's state (``state[i]``) on that
    parameter's GPU, where ``load_state_dict`` would move it anyway."""
    if "map" not in desc:
        return _rebuild(desc, tensors)
    out = {}
    for key, d in desc["map"]:
        if key == "state" and "map" in d:
            out[key] = {
                i: _rebuild(
                    entry,
                    tensors,
                    params[i].device
                    if isinstance(i, int) and 0 <= i < len(params) and params[i].is_cuda
                    else None,
                )
                for i, entry in d["map"]
            }
        else:
            out[key] = _rebuild(d, tensors)
    return out


def _broadcast_bytes(comm: Communicator, payload: bytes | None, root: int) -> bytes | None:
    """``root``'s payload on every rank; None everywhere if the root has none (it failed)."""
    length = np.array([-1 if payload is None else len(payload)], np.int64)
    comm.broadcast(length, root=root)
    if length[0] < 0:
        return None
    buf = (
        np.frombuffer(payload, np.uint8).copy()
        if payload is not None
        else np.empty(int(length[0]), np.uint8)
    )
    comm.broadcast(buf, root=root)
    return buf.tobytes()


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, comm: Communicator, root: int = 0
) -> None:
    """Give every rank ``root``'s optimizer state (e.g. momentum, Adam moments, step counts) and
    hyper-parameters (``param_groups``: learning rate ...), in place.

    The structure goes as JSON, the tensors as packed buffers; nothing is pickled. Works when
    the other ranks have no state yet (a fresh optimizer) as well as when they have some.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The same kind of optimizer over the same parameters on every rank (a
        `DistributedOptimizer` too).
    comm : Communicator
        The ranks to make alike.
    root : int
        The rank whose state everyone takes.

    Raises
    ------
    TypeError
        The state holds a value that is not a tensor, number, string, list or dict (on every
        rank: the root says which value).
    CollectiveMismatchError
        The optimizers manage different parameters on different ranks.
    """
    comm = communicator(comm, "broadcast_optimizer_state")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    check_same_layout(
        comm, [(str(i), p) for i, p in enumerate(params)], "broadcast_optimizer_state"
    )
    sent: list[torch.Tensor] = []
    payload, failure = None, None
    if comm.rank == root:
        try:
            payload = json.dumps(_describe(optimizer.state_dict(), sent, "state_dict()")).encode()
        except TypeError as exc:
            failure = exc  # told to the other ranks first, so that they do not wait for it
    received = _broadcast_bytes(comm, payload, root)
    if failure is not None:
        raise failure
    if received is None:
        raise TypeError(
            f"broadcast_optimizer_state: rank {root}'s optimizer state cannot be "
            f"sent (rank {root} raised the reason)"
        )
    if comm.rank == root:
        with torch.no_grad():
            _broadcast_tensors(comm, sent, root)
        return
    tensors: list[torch.Tensor] = []
    new_state = _rebuild_state_dict(json.loads(received.decode()), tensors, params)
    with torch.no_grad():
        _broadcast_tensors(comm, tensors, root)
    optimizer.load_state_dict(new_state)
