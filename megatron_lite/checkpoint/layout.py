"""Where every parameter of the GPT lives in a checkpoint of a given TP x PP layout.

DeepSpeed's pipeline engine writes one file per layer spec and TP rank, named
by the spec's index in the whole model (so these files do not depend on the
stage split), and one model-states file per stage and TP rank holding that
rank's optimizer (ZeRO 0), LR schedule and step counters (file names:
checkpoint/format.py). The tied head
has no layer file (its weight is the embedding's, saved once as layer 00); the
last stage keeps a copy of the whole embedding module, with its own optimizer
state.

The optimizer's parameters are numbered in the stage module's order: the tied
embedding module first (DeepSpeed registers `tied_modules` before the numbered
layers), then the stage's layers; split into the groups of
checkpoint/optimizer_groups.py (Muon's matrices, weight decay, none); an MoE
model's expert parameters come last, in groups of their own
(training/optimizer.build_optimizer).

Under --pipeline-schedule dualpipev the specs are cut into 2 PP stages and pipeline rank r holds stages r and
2 PP - 1 - r (model/virtual_stages.py): its model-states and optimizer files hold both, in the module's order
(tied module first, then the layers by spec index); the tied embedding and head are one module on rank 0,
with no copy elsewhere. Layer files are named by spec index under either schedule. A save records its
schedule (`saved_schedule`); reshard and import-hf write 1F1B layouts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from deepspeed.pipe import TiedLayerSpec

from megatron_lite.checkpoint.optimizer_groups import GROUPS, group_of
from megatron_lite.config import Config
from megatron_lite.cost.stages import stage_bounds, transformer_layers_per_stage
from megatron_lite.model.gpt import TransformerLayerPipe, layer_specs
from megatron_lite.model.moe_options import is_moe_layer
from megatron_lite.model.virtual_stages import rank_ranges, stage_count
from megatron_lite.parallel.experts import is_expert_parameter
from megatron_lite.parallel.tp import as_single_rank

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
    partition_sections: Tuple[int, ...] = ()
    """Full lengths of the parts of partition_dim each split over TP separately (slicing.py): the fused
    QKV's (a hd, g hd, g hd), SwiGLU's (ffn, ffn); one part for a plain split; () when replicated."""
    experts: int = 0
    """For an MoE layer's expert parameter, the experts along dim 0 (every one: files store them all); else 0."""
    hidden_matrix: bool = False
    """One of the transformer layers' weight matrices (Muon's under --optimizer muon; parallel/layers.py)."""


def saved_schedule(metadata: dict) -> str:
    """The pipeline schedule whose stage placement a checkpoint's files follow: the one its run recorded; 1f1b
    for checkpoints from before --pipeline-schedule and for reshard and import-hf outputs."""
    return metadata.get("pipeline_schedule") or "1f1b"


def slice_shape(info: ParamInfo, tp: int) -> Tuple[int, ...]:
    """A parameter's shape on one of `tp` TP ranks."""
    shape = list(info.shape)
    if info.partition_dim >= 0:
        shape[info.partition_dim] //= tp
    return tuple(shape)


class ModelLayout:
    """The parameters of a config's GPT: per spec, per pipeline stage, and the optimizer order; and the
    tensors besides them that a layer file holds (`buffers`)."""

    def __init__(self, config: Config):
        self.config = config
        self.specs = layer_specs(config)
        self.params: Dict[int, List[ParamInfo]] = {}
        self.buffers: Dict[int, Dict[str, Tuple[int, ...]]] = {}
        """Per spec with a file, its saved buffers' names and shapes: state the optimizer does not hold (an MoE
        router's expert bias, model/router.py), whole on every TP and EP rank, so read from TP rank 0's file."""
        self.tied_spec: Dict[str, int] = {}  # tied key -> index of the spec whose file holds it
        self.tied_users: Dict[int, str] = {}  # spec index -> tied key, for every tied spec
        described: Dict[str, tuple] = {}  # layer kind -> _describe's (parameters, buffers)
        for index, spec in enumerate(self.specs):
            if isinstance(spec, TiedLayerSpec):
                self.tied_users[index] = spec.key
                if spec.key in self.tied_spec:
                    continue
                self.tied_spec[spec.key] = index
            # Every layer of one kind has the same parameters: build one of each kind.
            kind = spec.typename.__name__
            if spec.typename is TransformerLayerPipe:  # its MLP: dense or routed experts (model/moe_options.py)
                kind += "-moe" * is_moe_layer(config.model, spec.module_args[2])
            if kind not in described:
                described[kind] = self._describe(spec)
            params, self.buffers[index] = described[kind]
            self.params[index] = [ParamInfo(index, *entry) for entry in params]

    @staticmethod
    def _describe(spec) -> Tuple[List[Tuple[str, Tuple[int, ...], int, int, Tuple[int, ...], int, bool]],
                                 Dict[str, Tuple[int, ...]]]:
        # Built dense (TP = 1, whatever this process's place) only to read names, shapes and split attributes;
        # on the meta device, so a large model's layer costs no memory.
        with torch.random.fork_rng(devices=[]), as_single_rank(), torch.device("meta"):
            module = spec.build()
        names = {name for name, _ in module.named_parameters()}
        buffers = {name: tuple(t.shape) for name, t in module.state_dict().items() if name not in names}
        described = []
        for name, p in module.named_parameters():
            split = getattr(p, "tensor_model_parallel", False)
            dim, stride = (p.partition_dim, getattr(p, "partition_stride", 1)) if split else (-1, 1)
            sections = getattr(p, "partition_sections", None) if split else ()
            if sections is None:
                sections = (p.shape[dim] // stride,) * stride
            experts = p.num_experts if is_expert_parameter(p) else 0
            described.append((name, tuple(p.shape), dim, stride, tuple(sections), experts,
                              bool(getattr(p, "hidden_matrix", False))))
        return described, buffers

    def file_shapes(self, spec: int, tp: int) -> Dict[str, Tuple[int, ...]]:
        """Name -> shape of every tensor in a spec's layer file at TP = tp: its parameters' slices and buffers."""
        shapes = {p.name: slice_shape(p, tp) for p in self.params[spec]}
        shapes.update(self.buffers[spec])
        return shapes

    def layer_specs_with_files(self) -> List[int]:
        """Spec indices that have a layer file (every spec but the tied head)."""
        return sorted(self.params)

    def stage_bounds(self, pp: int, method: str, schedule: str = "1f1b") -> List[int]:
        """The bounds of the stage_count(pp, schedule) stages (2 PP under dualpipev)."""
        return stage_bounds(self.config.replace(parallel__pipeline_model_parallel_size=pp,
                                                parallel__pipeline_partition_method=method,
                                                parallel__pipeline_schedule=schedule))

    def layers_per_stage(self, bounds: List[int]) -> List[int]:
        return transformer_layers_per_stage(self.config, bounds)

    def saved_stage_bounds(self, metadata: dict) -> List[int]:
        """Where a saved checkpoint's stages were cut: its recorded layers per stage (a `profile` split is
        known only from them), else its partition method."""
        pp, schedule = int(metadata["layout"]["pipeline_model_parallel_size"]), saved_schedule(metadata)
        counts = metadata.get("layers_per_stage")
        if counts and len(counts) == stage_count(pp, schedule):
            return self.stage_bounds(pp, ",".join(map(str, counts)), schedule)
        return self.stage_bounds(pp, self.config.parallel.pipeline_partition_method, schedule)

    def rank_ranges(self, bounds: List[int], pp: int, schedule: str, rank: int) -> List[Tuple[int, int]]:
        """The spec ranges pipeline rank `rank` holds (one stage, or two under dualpipev)."""
        return rank_ranges(bounds, pp, schedule, rank)

    def stage_parameters(self, start: int, stop: int) -> List[Tuple[ParamInfo, bool]]:
        """(parameter, is a tied copy) of a stage in optimizer order: the groups of
        checkpoint/optimizer_groups.py (Muon's, decay, no decay), then the expert parameters' groups."""
        return self.rank_parameters([(start, stop)])

    def rank_parameters(self, ranges: List[Tuple[int, int]]) -> List[Tuple[ParamInfo, bool]]:
        """stage_parameters of a pipeline rank holding the spec `ranges` (two under dualpipev, in build order)."""
        indices = [index for start, stop in ranges for index in range(start, stop)]
        ordered: List[Tuple[ParamInfo, bool]] = []
        seen_keys = []
        for index in indices:
            key = self.tied_users.get(index)
            if key is not None and key not in seen_keys:
                seen_keys.append(key)
                owner = self.tied_spec[key]
                copy = owner not in indices
                ordered += [(p, copy) for p in self.params[owner]]
        for index in indices:
            if index not in self.tied_users:
                ordered += [(p, False) for p in self.params[index]]
        # optimizer_groups.GROUPS; an MoE model's expert parameters follow in groups of their own, in the same
        # order (deepspeed_compat.experts.expert_optimizer_groups). sorted() keeps the order inside each group.
        muon = self.config.optimizer.optimizer == "muon"
        return sorted(ordered, key=lambda x: (x[0].experts > 0, GROUPS.index(
            group_of(len(x[0].shape), x[0].hidden_matrix, muon))))

