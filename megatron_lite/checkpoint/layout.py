"""Where every parameter of the GPT lives in a checkpoint of a given TP x PP layout.

DeepSpeed's pipeline engine writes one file per layer spec and TP rank,
`layer_{spec:02d}-model_{tp:02d}-model_states.pt`, named by the spec's index in
the whole model (so these files do not depend on the stage split), and one
`mp_rank_{stage * TP + tp:02d}_model_states.pt` per stage and TP rank holding
that rank's optimizer (ZeRO 0), LR schedule and step counters. The tied head
has no layer file (its weight is the embedding's, saved once as layer 00); the
last stage keeps a copy of the whole embedding module, with its own optimizer
state.

The optimizer's parameters are numbered in the stage module's order: the tied
embedding module first (DeepSpeed registers `tied_modules` before the numbered
layers), then the stage's layers; split into the weight-decay group (every
parameter with more than one dimension) and the no-decay group, as
`training/optimizer.parameter_groups` does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from deepspeed.pipe import TiedLayerSpec

from megatron_lite.config import Config
from megatron_lite.model.arithmetic import stage_bounds
from megatron_lite.model.gpt import layer_specs

VOCAB_PARAMETERS = ("word_embeddings.weight", "output.weight")


@dataclass(frozen=True)
class ParamInfo:
    spec: int
    """Index of the layer spec (the number in `layer_XX`)."""
    name: str
    """Name inside the layer's state dict."""
    shape: Tuple[int, ...]
    """Full (TP = 1) shape."""
    partition_dim: int
    """Dimension split across TP ranks; -1 when replicated."""
    partition_stride: int
    """Chunks per rank along partition_dim (3 for the fused QKV: whole heads of Q, K and V)."""

    @property
    def decays(self) -> bool:
        return len(self.shape) > 1


def layer_file(spec: int, tp_rank: int) -> str:
    return f"layer_{spec:02d}-model_{tp_rank:02d}-model_states.pt"


def mp_rank_file(stage: int, tp_rank: int, tp: int) -> str:
    return f"mp_rank_{stage * tp + tp_rank:02d}_model_states.pt"


class ModelLayout:
    """The parameters of a config's GPT: per spec, per pipeline stage, and the optimizer order."""

    def __init__(self, config: Config):
        self.config = config
        self.specs = layer_specs(config)
        self.params: Dict[int, List[ParamInfo]] = {}
        self.tied_spec: Dict[str, int] = {}  # tied key -> index of the spec whose file holds it
        self.tied_users: Dict[int, str] = {}  # spec index -> tied key, for every tied spec
        for index, spec in enumerate(self.specs):
            if isinstance(spec, TiedLayerSpec):
                self.tied_users[index] = spec.key
                if spec.key in self.tied_spec:
                    continue
                self.tied_spec[spec.key] = index
            self.params[index] = self._describe(index, spec)

    def _describe(self, index: int, spec) -> List[ParamInfo]:
        # Built dense (no TP state: TP = 1) only to read names, shapes and split attributes.
        with torch.random.fork_rng(devices=[]):
            module = spec.build()
        return [ParamInfo(index, name, tuple(p.shape), p.partition_dim if getattr(p, "tensor_model_parallel", False)
                          else -1, getattr(p, "partition_stride", 1))
                for name, p in module.named_parameters()]

    def layer_specs_with_files(self) -> List[int]:
        """Spec indices that have a layer file (every spec but the tied head)."""
        return sorted(self.params)

    def stage_bounds(self, pp: int, method: str) -> List[int]:
        return stage_bounds(self.config.replace(parallel__pipeline_model_parallel_size=pp,
                                                parallel__pipeline_partition_method=method))

    def stage_parameters(self, start: int, stop: int) -> List[Tuple[ParamInfo, bool]]:
        """(parameter, is a tied copy) of a stage in optimizer order: decay group, then no-decay group."""
        ordered: List[Tuple[ParamInfo, bool]] = []
        seen_keys = []
        for index in range(start, stop):
            key = self.tied_users.get(index)
            if key is not None and key not in seen_keys:
                seen_keys.append(key)
                owner = self.tied_spec[key]
                copy = not (start <= owner < stop)
                ordered += [(p, copy) for p in self.params[owner]]
        for index in range(start, stop):
            if index not in self.tied_users:
                ordered += [(p, False) for p in self.params[index]]
        return [x for x in ordered if x[0].decays] + [x for x in ordered if not x[0].decays]

