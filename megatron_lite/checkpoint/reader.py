"""Read a megatron_lite checkpoint of any TP x PP layout back into full (TP = 1) tensors.

Everything is checked before it is used: the tag folder and its metadata,
every layer file and every per-rank state file the layout needs, that each
file can be read, and that it holds exactly the tensors, with the shapes, that
the config in megatron_lite.json describes. Problems are `CheckpointError`s
naming the file and what is wrong with it.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch

from megatron_lite.config import Config
from megatron_lite.checkpoint import slicing
from megatron_lite.checkpoint.format import (
    METADATA,
    CheckpointError,
    layer_file,
    load_file,
    model_states_file,
    read_metadata,
    resolve_tag,
)
from megatron_lite.checkpoint.layout import ModelLayout

Key = Tuple[int, str]  # (spec index, parameter name)


def _list_some(names: List[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_layer_state(path: str, state, expected: Dict[str, Tuple[int, ...]], tp: int) -> None:
    """A layer file holds exactly the tensors `expected` names, with those shapes (one TP rank's, at TP = tp)."""
    if isinstance(state, dict) and set(state) < set(expected) and \
            all(name.endswith("router.bias") for name in set(expected) - set(state)):
        raise CheckpointError(f"{path} has no {min(set(expected) - set(state))}: it was written before the MoE "
                              f"router had a bias (issue 57 gave it one with every linear's bias, as Megatron-LM's "
                              f"router has), and this version does not resume such a checkpoint; resume it with the "
                              f"version that wrote it")
    if not isinstance(state, dict) or set(state) != set(expected) or \
            not all(torch.is_tensor(v) for v in state.values()):
        got = sorted(state) if isinstance(state, dict) else [type(state).__name__]
        raise CheckpointError(f"{path} holds {_list_some(got)}, but the config in {METADATA} expects "
                              f"{_list_some(sorted(expected))}: the file belongs to another model")
    for name, want in expected.items():
        if tuple(state[name].shape) != tuple(want):
            raise CheckpointError(f"{path}: {name} has shape {tuple(state[name].shape)}, the config in "
                                  f"{METADATA} gives {tuple(want)} at TP={tp}: the file belongs to another model")


def check_model_states(path: str, state) -> None:
    """DeepSpeed's per-rank engine state (step counters, LR schedule, ZeRO-0 optimizer)."""
    if not isinstance(state, dict) or "global_steps" not in state:
        raise CheckpointError(f"{path}: not a DeepSpeed model-states file (no 'global_steps')")


def check_zero_state(path: str, state) -> None:
    """A ZeRO / bf16-optimizer partition file."""
    if not isinstance(state, dict) or not isinstance(state.get("optimizer_state_dict"), dict):
        raise CheckpointError(f"{path}: not a DeepSpeed optimizer partition file (no 'optimizer_state_dict')")


class CheckpointReader:
    def __init__(self, load_dir: str, iteration: Optional[int] = None):
        self.load_dir = load_dir
        self.tag = resolve_tag(load_dir, iteration)
        self.path = os.path.join(load_dir, self.tag)
        if not os.path.isfile(os.path.join(self.path, METADATA)):
            raise CheckpointError(f"{os.path.join(self.path, METADATA)}: no such file; this folder was not written "
                                  f"by megatron_lite's pretrain_gpt.py, or the save did not finish")
        self.metadata = read_metadata(load_dir, self.tag)
        try:
            self.config = Config.from_dict(self.metadata["config"])
            self.tp = int(self.metadata["layout"]["tensor_model_parallel_size"])
            self.pp = int(self.metadata["layout"]["pipeline_model_parallel_size"])
            self.iteration = int(self.metadata["iteration"])
            self.consumed_samples = int(self.metadata["consumed_samples"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{os.path.join(self.path, METADATA)}: missing or malformed entry ({e})") from None
        self.layout = ModelLayout(self.config)
        self.bounds = self.layout.saved_stage_bounds(self.metadata)
        self._check_files_exist()

    def _check_files_exist(self) -> None:
        if self.config.parallel.zero_stage >= 2:
            raise CheckpointError(f"{self.path} was written with --zero-stage {self.config.parallel.zero_stage} "
                                  f"(DeepSpeed's non-pipeline engine: one module file plus ZeRO shards, no per-layer "
                                  f"files); these tools read ZeRO 0 and 1 checkpoints only")
        needed = [layer_file(spec, t) for spec in self.layout.layer_specs_with_files() for t in range(self.tp)]
        needed += [model_states_file(s, t, self.tp) for s in range(self.pp) for t in range(self.tp)]
        missing = [n for n in needed if not os.path.isfile(os.path.join(self.path, n))]
        if missing:
            raise CheckpointError(
                f"{self.path} is incomplete for TP={self.tp}, PP={self.pp}: missing {_list_some(missing)}")

    def layer_shards(self, spec: int) -> List[Dict[str, torch.Tensor]]:
        """Each TP rank's state dict of one layer, checked against the config."""
        shards = []
        for t in range(self.tp):
            path = os.path.join(self.path, layer_file(spec, t))
            sd = load_file(path, mmap=True)  # mapped: merging reads each slice once, into the full tensor
            check_layer_state(path, sd, self.layout.file_shapes(spec, self.tp), self.tp)
            shards.append(sd)
        return shards

    def full_weights(self) -> Dict[Key, torch.Tensor]:
        """Every parameter as its full fp32 tensor, and every saved buffer (an MoE router's expert bias)."""
        weights: Dict[Key, torch.Tensor] = {}
        self.dtypes: Dict[Key, torch.dtype] = {}
        for spec in self.layout.layer_specs_with_files():
            shards = self.layer_shards(spec)
            for info in self.layout.params[spec]:
                full = slicing.merge([sd[info.name] for sd in shards], info.partition_dim, info.partition_sections)
                weights[(spec, info.name)] = full.float()
                self.dtypes[(spec, info.name)] = full.dtype
            for name in self.layout.buffers[spec]:  # whole on every TP rank
                weights[(spec, name)] = shards[0][name].float()
                self.dtypes[(spec, name)] = shards[0][name].dtype
        return weights
