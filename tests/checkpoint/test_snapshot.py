"""The snapshot an async save writes: independent of the live tensors, and torch.save'd to the same bytes."""
import io
from collections import OrderedDict

import torch

from megatron_lite.checkpoint.snapshot import snapshot, snapshot_bytes


def _saved(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _state():
    flat = torch.arange(12, dtype=torch.float32)
    weight = torch.nn.Parameter(torch.randn(3, 4))
    trained = torch.zeros(8, requires_grad=True)
    # "partition": a view of a parameter, not a leaf, is saved with requires_grad
    return {"partition": trained[:4], "flat": flat, "views": [flat[:6].view(2, 3), flat[6:]], "weight": weight,
            "bf16": torch.ones(5, dtype=torch.bfloat16), "empty": [torch.zeros(0), torch.zeros(0)],
            "schedule": OrderedDict(last_lr=[0.1, 0.2], step=3), "shape": torch.Size([3, 4]), "name": "x"}


def test_a_snapshot_saves_to_the_same_bytes_as_the_live_state_with_views_still_sharing_storage():
    state = _state()
    copy = snapshot(state)
    assert _saved(copy) == _saved(state)
    assert copy["views"][0].untyped_storage().data_ptr() == copy["flat"].untyped_storage().data_ptr()
    assert isinstance(copy["weight"], torch.nn.Parameter) and copy["weight"].requires_grad


def test_a_snapshot_does_not_change_when_training_changes_the_live_state():
    state = _state()
    before = _saved(state)
    copy = snapshot(state)
    with torch.no_grad():
        state["flat"].add_(1)
        state["weight"].mul_(2)
        state["bf16"].zero_()
    state["schedule"]["last_lr"][0] = 0.5
    state["schedule"]["step"] = 4
    assert _saved(copy) == before
    assert copy["flat"].untyped_storage().data_ptr() != state["flat"].untyped_storage().data_ptr()


def test_snapshot_bytes_counts_each_storage_once():
    state = _state()
    assert snapshot_bytes(state) == 8 * 4 + 12 * 4 + 12 * 4 + 5 * 2
