"""A consistent copy, in host memory, of what a save writes, so training can go on while it is written.

`snapshot(obj)` copies every tensor's storage once (views of one storage stay views of one copy, as
torch.save would write them: the file is byte for byte the one a synchronous save writes from the live
objects) into CPU memory, and copies the containers and other values around them, so that nothing the
training step changes afterwards (parameters, optimizer state, the LR schedule's lists) reaches the file.
A CUDA tensor's copy lives on the host; its file then records CPU storage, which every load maps to CPU.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Dict, Tuple

import torch


def _tensor(t: torch.Tensor, storages: Dict[Tuple[str, int], torch.UntypedStorage]) -> torch.Tensor:
    source = t.untyped_storage()
    key = (str(source.device), source.data_ptr())
    copied = storages.get(key) if source.nbytes() else None  # empty storages all sit at address 0
    if copied is None:
        copied = torch.UntypedStorage(source.nbytes())
        copied.copy_(source)  # a device-to-host copy for CUDA storages, a memcpy on CPU
        storages[key] = copied
    out = torch.empty(0, dtype=t.dtype).set_(copied, t.storage_offset(), t.size(), t.stride())
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad)  # pickled with the tensor, views of trained parameters included


def _copy(obj: Any, storages, memo: Dict[int, Any]) -> Any:
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        out = _tensor(obj, storages)
    elif isinstance(obj, (dict, OrderedDict)):
        out = type(obj)() if type(obj) in (dict, OrderedDict) else copy.copy(obj)
        out.clear()
        for k, v in obj.items():
            out[k] = _copy(v, storages, memo)
    elif type(obj) is list:
        out = [_copy(v, storages, memo) for v in obj]
    elif type(obj) is tuple:
        out = tuple(_copy(v, storages, memo) for v in obj)
    else:  # numbers, strings, torch.Size, named tuples, sets of names, small config objects
        out = copy.deepcopy(obj)
    memo[id(obj)] = out
    return out


def snapshot(obj: Any) -> Any:
    """`obj` with every tensor copied to host memory, sharing kept."""
    return _copy(obj, {}, {})


def snapshot_bytes(obj: Any) -> int:
    """Host bytes a snapshot of `obj` takes: its distinct tensor storages (what the memory estimate's
    `snapshot` is tested against)."""
    seen, total = set(), 0

    def walk(o):
        nonlocal total
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            if (str(s.device), s.data_ptr()) not in seen:
                seen.add((str(s.device), s.data_ptr()))
                total += s.nbytes()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
    walk(obj)
    return total
