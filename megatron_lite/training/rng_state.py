"""Every random generator of a rank (Python, numpy, torch CPU and CUDA, the tracker's streams), as a
checkpoint holds it: tensors and plain values only, so the file loads with torch.load(weights_only=True)."""
from __future__ import annotations

import os
import random
from typing import Optional

import numpy as np
import torch

from megatron_lite.checkpoint.format import CheckpointError, load_file, rng_file
from megatron_lite.parallel.random import get_rng_tracker


def rng_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": get_rng_tracker().get_states(),
    }


def check_rng_state(path: str, saved) -> None:
    if not isinstance(saved, dict) or not {"python", "numpy", "torch", "tracker"} <= set(saved):
        raise CheckpointError(f"{path}: not a megatron_lite random-generator file")


def read_rng_state(folder: str, rank: int) -> Optional[dict]:
    """Rank `rank`'s saved generators in a checkpoint folder, checked; None when the folder has no such file."""
    path = os.path.join(folder, rng_file(rank))
    if not os.path.isfile(path):
        return None
    saved = load_file(path)
    check_rng_state(path, saved)
    return saved


def set_rng_state(saved: dict) -> None:
    random.setstate(saved["python"])
    numpy_state = saved["numpy"]
    if isinstance(numpy_state, dict):
        np.random.set_state((numpy_state["name"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                             numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    else:  # checkpoints before the tensor-only format kept numpy's own tuple
        np.random.set_state(numpy_state)
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
    get_rng_tracker().set_states(saved["tracker"])
