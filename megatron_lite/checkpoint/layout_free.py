"""A checkpoint in a form that belongs to no layout, so it loads at any TP, PP, DP, ZeRO 0/1 and precision.

Per parameter, by its dense name (the layer spec and the name inside the layer): the full fp32 master
weight, Adam's `exp_avg` and `exp_avg_sq` (TP = 1 shapes, the vocabulary padded as saved), and the step;
per saved buffer (an MoE router's expert bias: `read_buffers`), the tensor; plus the run's state: iteration,
consumed samples, the LR schedule, DeepSpeed's step counters and the fp16 loss scaler. `LayoutFreeReader`
reads it from

- any checkpoint the trainer saves: the fp32 masters and moments come from DeepSpeed's DP-partitioned
  optimizer files where there are any (ZeRO 1, bf16, fp16: fragments found through their slice mappings,
  deepspeed_compat.optimizer_state.partition_fragments), else from the layer files and the plain AdamW state
  (fp32 ZeRO 0);
  TP slices are put together as parallel/layers.py cut them (slicing.py);
- or a folder written by `convert_checkpoint.py universal` (`write_universal`): one file per layer spec.

It reads only the layer specs asked for, one source file at a time, so a rank resuming under a new layout
holds the states of its own layers and one file besides. Every file goes through format.load_file.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch

from megatron_lite.atomic import torch_save
from megatron_lite.checkpoint import sliced
from megatron_lite.checkpoint.format import (
    UNIVERSAL_FORMAT,
    data_ranks,
    expert_ranks,
    CheckpointError,
    layer_file,
    load_file,
    model_states_file,
    write_metadata,
    zero_optimizer_files,
)
from megatron_lite.checkpoint.layout import ModelLayout, saved_schedule, slice_shape
from megatron_lite.checkpoint.reader import check_layer_state, check_model_states, check_zero_state
from megatron_lite.checkpoint.vocab import is_vocab_parameter
from megatron_lite.config import Config
from megatron_lite.deepspeed_compat import checkpoint_files, optimizer_state

Key = Tuple[int, str]  # (layer spec index, name inside the layer)
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class ParamState:
    fp32: torch.Tensor
    exp_avg: Optional[torch.Tensor] = None
    exp_avg_sq: Optional[torch.Tensor] = None
    step: Optional[float] = None


@dataclass
class RunState:
    iteration: int
    consumed_samples: int
    lr_scheduler: Optional[dict] = None
    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0
    loss_scaler: Optional[dict] = None
    extra: dict = field(default_factory=dict)


def storage_of(metadata: dict) -> Tuple[int, str]:
    """(ZeRO stage, precision) of the files on disk: what DeepSpeed's own loader would need the run to use.
    A resharded checkpoint says so itself; a saved one was written by its run's engine."""
    storage = metadata.get("storage")
    if storage:
        return int(storage["zero_stage"]), str(storage["precision"])
    config = Config.from_dict(metadata["config"])
    return config.parallel.zero_stage, config.precision.dtype_name


def universal_file(spec: int) -> str:
    return f"universal_layer_{spec:02d}.pt"


class LayoutFreeReader:
    def __init__(self, folder: str, metadata: dict):
        self.folder = folder
        self.metadata = metadata
        self.config = Config.from_dict(metadata["config"])
        self.universal = metadata.get("format") == UNIVERSAL_FORMAT
        layout = metadata["layout"]
        self.tp = int(layout["tensor_model_parallel_size"])
        self.pp = int(layout["pipeline_model_parallel_size"])
        self.dp = data_ranks(layout)  # ZeRO partitions: DP x CP
        self.ep = expert_ranks(layout)
        self.layout = ModelLayout(self.config)
        self.schedule = saved_schedule(metadata)  # under dualpipev a pipeline rank's files hold two stages
        self.bounds = None if self.universal else self.layout.saved_stage_bounds(metadata)
        self.zero_stage, self.precision = storage_of(metadata)
        if self.zero_stage >= 2:
            raise CheckpointError(f"{folder} was written with --zero-stage {self.zero_stage} (DeepSpeed's non-"
                                  f"pipeline engine, whose files cannot be taken apart by parameter); it resumes "
                                  f"only under its own layout, ZeRO stage and precision")

    def info(self, key: Key):
        return next(p for p in self.layout.params[key[0]] if p.name == key[1])

    # The run's state.

    def run_state(self) -> RunState:
        m = self.metadata
        if self.universal:
            saved = dict(m["run_state"])
            return RunState(**{k: saved[k] for k in saved if k in RunState.__dataclass_fields__})
        path = os.path.join(self.folder, model_states_file(0, 0, self.tp))
        engine_state = load_file(path)
        check_model_states(path, engine_state)
        scaler = None
        zero = zero_optimizer_files(self.folder, 0, 0, self.tp, self.dp, self.precision == "bf16")
        if zero and self.precision == "fp16":
            scaler = self._partition(zero[0]).loss_scaler
        return RunState(iteration=int(m["iteration"]), consumed_samples=int(m["consumed_samples"]),
                        lr_scheduler=engine_state.get("lr_scheduler"),
                        global_steps=int(engine_state.get("global_steps", m["iteration"])),
                        global_samples=int(engine_state.get("global_samples", m["consumed_samples"])),
                        skipped_steps=int(engine_state.get("skipped_steps", 0)), loss_scaler=scaler)

    # Parameters.

    def read(self, specs: Optional[Iterable[int]] = None, optimizer: bool = True, tp: int = 1, rank: int = 0,
             rows: Optional[int] = None) -> Dict[Key, ParamState]:
        """Every parameter of the given layer specs (default: all), as TP rank `rank` of `tp` holds it (default:
        the full tensors), with the vocabulary padded to `rows` rows (default: as saved); without `optimizer`,
        weights only. Reads only those slices' bytes, one stage's files at a time (sliced.py)."""
        wanted: Set[int] = set(self.layout.params) if specs is None else set(specs) & set(self.layout.params)
        rows = None if rows in (None, self.config.model.padded_vocab_size) else rows
        states: Dict[Key, ParamState] = {}
        if self.universal:
            for spec in sorted(wanted):
                self._assemble(self._universal_sources(spec, optimizer), tp, rank, rows, states)
        else:
            for stage in range(self.pp):  # a pipeline rank's files
                owned = {s for start, stop in self.layout.rank_ranges(self.bounds, self.pp, self.schedule, stage)
                         for s in range(start, stop)}
                stage_specs = {self.layout.tied_spec.get(self.layout.tied_users.get(s), s) for s in owned}
                needed = stage_specs & wanted - {k[0] for k in states}
                if needed:
                    sources = [self._stage_sources(stage, r, needed, optimizer) for r in range(self.tp)]
                    self._assemble(self._by_key(sources), tp, rank, rows, states)
        missing = [k for s in wanted for k in ((s, p.name) for p in self.layout.params[s]) if k not in states]
        if missing:
            raise CheckpointError(f"{self.folder}: no state for {missing[0][1]} of layer {missing[0][0]:02d}: the "
                                  f"checkpoint is incomplete")
        return states

    def _by_key(self, per_rank: List[Dict[Key, "Source"]]) -> Dict[Key, List["Source"]]:
        """{key: its source on every source TP rank}, for the keys every rank's files hold."""
        out = {}
        for key in per_rank[0]:
            if any(key not in r for r in per_rank):
                raise CheckpointError(f"{self.folder}: {key[1]} of layer {key[0]:02d} is missing from some TP ranks' "
                                      f"files: the checkpoint is incomplete")
            out[key] = [r[key] for r in per_rank]
        return out

    def _assemble(self, sources: Dict[Key, List["Source"]], tp: int, rank: int, rows: Optional[int],
                  states: Dict[Key, ParamState]) -> None:
        for key, per_rank in sources.items():
            info = self.info(key)
            target_rows = rows if is_vocab_parameter(info.name) else None

            def cut(name):
                flats = [source.flats.get(name) for source in per_rank]
                if any(f is None for f in flats):
                    return None
                return sliced.rank_slice(info.shape, info.partition_dim, info.partition_sections, flats, tp, rank,
                                         target_rows).float()
            states[key] = ParamState(cut("fp32"), cut("exp_avg"), cut("exp_avg_sq"), per_rank[0].step)

    def read_buffers(self, specs: Optional[Iterable[int]] = None) -> Dict[Key, torch.Tensor]:
        """Every saved buffer (layout.buffers: an MoE router's expert bias) of the given layer specs (default: all),
        whole: from TP rank 0's layer file (every rank's holds it), or the universal file."""
        wanted = set(self.layout.buffers) if specs is None else set(specs) & set(self.layout.buffers)
        out: Dict[Key, torch.Tensor] = {}
        for spec in sorted(s for s in wanted if self.layout.buffers[s]):
            if self.universal:
                path = os.path.join(self.folder, universal_file(spec))
                saved = self._universal_file(path, spec)
                tensors = {name: saved[name].get("buffer") for name in self.layout.buffers[spec]}
            else:
                path = os.path.join(self.folder, layer_file(spec, 0))
                tensors = load_file(path, mmap=True)
                check_layer_state(path, tensors, self.layout.file_shapes(spec, self.tp), self.tp)
            for name, shape in self.layout.buffers[spec].items():
                tensor = tensors[name]
                if not torch.is_tensor(tensor) or tuple(tensor.shape) != shape:
                    raise CheckpointError(f"{path}: {name} is not a tensor of shape {shape}, as the config gives: "
                                          f"the file belongs to another model")
                out[(spec, name)] = tensor.clone()
        return out

    def _universal_file(self, path: str, spec: int) -> dict:
        saved = load_file(path, mmap=True)
        names = [p.name for p in self.layout.params[spec]] + list(self.layout.buffers[spec])
        if not isinstance(saved, dict) or sorted(saved) != sorted(names):
            raise CheckpointError(f"{path}: holds {sorted(saved) if isinstance(saved, dict) else saved!r}, "
                                  f"the config expects {names}: the file belongs to another model")
        return saved

    def _universal_sources(self, spec: int, optimizer: bool) -> Dict[Key, List["Source"]]:
        path = os.path.join(self.folder, universal_file(spec))
        saved = self._universal_file(path, spec)
        out = {}
        for info in self.layout.params[spec]:
            name, entry = info.name, saved[info.name]
            if tuple(entry["fp32"].shape) != info.shape:
                raise CheckpointError(f"{path}: {name} has shape {tuple(entry['fp32'].shape)}, the config "
                                      f"gives {info.shape}: the file belongs to another model")
            tensors = {k: entry.get(k) for k in (("fp32",) + MOMENTS if optimizer else ("fp32",))}
            out[(spec, name)] = [Source.of(tensors, entry.get("step") if optimizer else None)]
        return out

    def _partition(self, path: str) -> optimizer_state.PartitionFragments:
        state = load_file(path, mmap=True)
        check_zero_state(path, state)
        try:
            return optimizer_state.partition_fragments(state)
        except (KeyError, TypeError, AttributeError, IndexError) as e:
            raise CheckpointError(f"{path}: not a DeepSpeed optimizer partition this version can read ({e!r})") \
                from None

    def _owner(self, pipeline_name: str) -> Key:
        owner, name = checkpoint_files.pipeline_parameter_owner(pipeline_name)
        return (self.layout.tied_spec[owner] if isinstance(owner, str) else owner), name

    def _stage_sources(self, stage: int, tp_rank: int, specs: Set[int], optimizer: bool) -> Dict[Key, "Source"]:
        """One (stage, TP rank)'s pieces of the parameters of `specs`, memory-mapped."""
        partitions = zero_optimizer_files(self.folder, stage, tp_rank, self.tp, self.dp, self.precision == "bf16")
        if partitions:
            return self._partition_sources(partitions, specs, optimizer)
        return self._plain_sources(stage, tp_rank, specs, optimizer)

    def _partition_sources(self, paths: List[str], specs: Set[int], optimizer: bool) -> Dict[Key, "Source"]:
        """ZeRO 1 / bf16 / fp16: each DP rank's file holds a contiguous fragment of each parameter's flat
        fp32 master and moments; the fragments in DP-rank order are the whole (TP-sliced) parameter."""
        pieces: Dict[Key, Dict[str, list]] = {}
        steps: Dict[Key, Optional[float]] = {}
        names = ("fp32",) + MOMENTS if optimizer else ("fp32",)
        # An expert parameter is partitioned over expert-DP within each EP block (DP x CP place d held block
        # d % EP): its fragments in (block, place) order are every expert in global order.
        expert_order = sorted(range(len(paths)), key=lambda d: (d % self.ep, d // self.ep))
        expert_position = {d: i for i, d in enumerate(expert_order)}
        for rank, path in enumerate(paths):
            partition = self._partition(path)
            for pipeline_name, fragment in partition.fragments.items():
                key = self._owner(pipeline_name)
                if key[0] not in specs:
                    continue
                entry = pieces.setdefault(key, {name: [None] * len(paths) for name in names})
                at = expert_position[rank] if self.info(key).experts else rank
                for name in names:
                    entry[name][at] = fragment[name]
                steps[key] = partition.steps[pipeline_name] if optimizer else None
        out = {}
        for key, entry in pieces.items():
            numel = math.prod(slice_shape(self.info(key), self.tp))
            got = sum(p.numel() for p in entry["fp32"] if p is not None)
            if got != numel:
                raise CheckpointError(f"{paths[0]}: the fragments of {key[1]} (layer {key[0]:02d}) add up to {got} "
                                      f"values, not {numel}: a DP rank's file is missing or belongs to another run")
            out[key] = Source({name: sliced.Flat([p for p in parts if p is not None], mapped=True)
                               for name, parts in entry.items()
                               if any(p is not None for p in parts)}, steps[key])
        return out

    def _plain_sources(self, stage: int, tp_rank: int, specs: Set[int], optimizer: bool) -> Dict[Key, "Source"]:
        """fp32 ZeRO 0: the layer files are the masters; the engine's file holds torch AdamW's state, numbered
        in the stage's optimizer order (layout.stage_parameters)."""
        tensors: Dict[Key, Dict[str, torch.Tensor]] = {}
        steps: Dict[Key, Optional[float]] = {}
        for spec in sorted(specs):
            path = os.path.join(self.folder, layer_file(spec, tp_rank))
            state = load_file(path, mmap=True)
            check_layer_state(path, state, self.layout.file_shapes(spec, self.tp), self.tp)
            for info in self.layout.params[spec]:  # the buffers besides them: read_buffers
                tensors[(spec, info.name)] = {"fp32": state[info.name]}
        if optimizer and self.metadata.get("optimizer_states", True):
            path = os.path.join(self.folder, model_states_file(stage, tp_rank, self.tp))
            engine_state = load_file(path, mmap=True)
            check_model_states(path, engine_state)
            saved = engine_state.get("optimizer")
            if not (isinstance(saved, dict) and "state" in saved and "param_groups" in saved):
                raise CheckpointError(f"{path}: no optimizer state of a plain AdamW (fp32, ZeRO 0) and no optimizer "
                                      f"partition files beside it: the checkpoint is incomplete")
            params = self.layout.rank_parameters(self.layout.rank_ranges(self.bounds, self.pp, self.schedule, stage))
            count = sum(len(g["params"]) for g in saved["param_groups"])
            if count != len(params):
                raise CheckpointError(f"{path}: the optimizer holds {count} parameters, but stage {stage} of the saved "
                                      f"config has {len(params)}: the file belongs to another model or stage split")
            for index, (info, copy) in enumerate(params):
                entry = saved["state"].get(index)
                key = (info.spec, info.name)
                if key not in tensors or entry is None or copy:
                    continue
                if tuple(entry["exp_avg"].shape) != tuple(tensors[key]["fp32"].shape):
                    raise CheckpointError(f"{path}: the optimizer's parameter {index} has shape "
                                          f"{tuple(entry['exp_avg'].shape)}, but {info.name} of layer {info.spec:02d}, "
                                          f"its place in stage {stage}'s optimizer order, is "
                                          f"{tuple(tensors[key]['fp32'].shape)}: the file belongs to another model")
                # Muon's matrices have no exp_avg_sq (training/muon.py)
                tensors[key].update(exp_avg=entry["exp_avg"], exp_avg_sq=entry.get("exp_avg_sq"))
                steps[key] = float(entry["step"])
        return {key: Source.of(t, steps.get(key)) for key, t in tensors.items()}


@dataclass
class Source:
    """One source TP rank's pieces of a parameter: its fp32 master and moments (sliced.Flat), and its step."""
    flats: Dict[str, sliced.Flat]
    step: Optional[float]

    @staticmethod
    def of(tensors: Dict[str, Optional[torch.Tensor]], step: Optional[float]) -> "Source":
        """From whole, memory-mapped tensors."""
        return Source({k: sliced.Flat([t], mapped=True) for k, t in tensors.items() if t is not None}, step)


def write_universal(reader: LayoutFreeReader, folder: str) -> dict:
    """The layout-free form into `folder` (a tag folder being written): one file per layer spec and the
    metadata; returns the metadata."""
    for spec in reader.layout.layer_specs_with_files():
        states = reader.read([spec])
        entries = {name: {"fp32": state.fp32, "exp_avg": state.exp_avg, "exp_avg_sq": state.exp_avg_sq,
                          "step": state.step} for (_, name), state in states.items()}
        entries.update({name: {"buffer": tensor} for (_, name), tensor in reader.read_buffers([spec]).items()})
        torch_save(entries, os.path.join(folder, universal_file(spec)))
    metadata = {k: v for k, v in reader.metadata.items() if k not in ("storage", "optimizer_states")}
    metadata.update(format=UNIVERSAL_FORMAT, run_state=asdict(reader.run_state()),
                    converted_from={"path": os.path.abspath(reader.folder), "layout": reader.metadata["layout"],
                                    "storage": list(storage_of(reader.metadata))})
    write_metadata(folder, metadata)
    return metadata
