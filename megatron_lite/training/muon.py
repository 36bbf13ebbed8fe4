"""Muon on the transformer layers' matrices, AdamW on the rest: the dense model's update at any layout.

Per matrix W (m outputs x n inputs) with gradient G, as torch.optim.Muon steps it:

    B <- B + (1 - mu) (G - B)              the gradients' exponential average (torch's buffer)
    U <- G + mu (B - G)  (Nesterov)  or B
    O <- NS_k(U)                           k quintic Newton-Schulz iterations (torch's), in fp32 or bf16
    W <- W (1 - lr wd) - lr s(m, n) O      s: --muon-scale-mode x --muon-extra-scale-factor

"A matrix" is what the dense model multiplies with: the fused QKV weight is Q, K and V (its partition
sections), SwiGLU's fused weight is gate and up, an expert stack [E, out, in] is E matrices. Muon is not
elementwise, so the parallel layouts must hand NS the whole of each:

- The buffer B is elementwise, so it lives where AdamW's moments live (the parameter's TP shard, and under
  ZeRO 1/2 or DeepSpeed's bf16 optimizer this DP rank's fragment of the group's flat fp32 partition). It is
  stored as `exp_avg`, which it is (AdamW's first moment with beta1 = mu), so checkpoints, the layout-free
  form, reshard and merge carry it as they carry Adam's; Muon's matrices have no `exp_avg_sq`.
- DP: U is computed on this rank's fragments, then assembled over the partition's process group by one
  all-reduce per batch of consecutive parameters (each rank writes its fragments into zeros; fragments are
  disjoint, so the sum is every value once, exactly). Only the matrices with a fragment here (on any TP
  peer) are orthogonalised, and only those fragments updated: the NS work is shared by the DP ranks.
- TP (--muon-tp-mode duplicated): a split matrix's U is all-gathered over TP, its parts cut from the dense
  order (each TP rank holds [part_0 / tp; part_1 / tp; ...] along the partition dimension) and
  orthogonalised on every TP rank; each keeps its shard of O. blockwise orthogonalises each shard's parts on
  their own (Megatron-LM's mode: not the dense update).
- PP, EP: a stage's and an expert rank's matrices are whole there; nothing to assemble.
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_lite.checkpoint import slicing
from megatron_lite.cost.muon import assembly_batches
from megatron_lite.deepspeed_compat import optimizer_state
from megatron_lite.parallel.experts import is_expert_parameter
from megatron_lite.parallel.grad_norm import clip_to_global_norm
from megatron_lite.parallel.layers import equal_sections
from megatron_lite.parallel.tp import tp_group, tp_rank, tp_world_size

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)
NS_EPS = 1e-7


def newton_schulz(update: torch.Tensor, steps: int, precision: str = "highest") -> torch.Tensor:
    """The orthogonalised [m, n] matrix: torch.optim.Muon's iteration, operation for operation. precision
    (--muon-fp32-matmul-prec): highest in fp32; high in fp32 with torch's "high" float32 matmul precision
    (TF32 on CUDA); medium in bf16, as torch.optim.Muon, so that one step equals torch's."""
    if precision == "high":
        saved = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        try:
            return newton_schulz(update, steps, "highest")
        finally:
            torch.set_float32_matmul_precision(saved)
    a, b, c = NS_COEFFICIENTS
    x = update.to(torch.bfloat16 if precision == "medium" else torch.float32, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=NS_EPS))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def update_scale(rows: int, cols: int, mode: str, extra: float) -> float:
    """s(m, n) of an m x n matrix: spectral sqrt(max(m, n)), unit_rms_norm sqrt(m / n), shape_scaling
    sqrt(max(1, m / n)); times `extra`. spectral x 0.2 is torch's match_rms_adamw, shape_scaling its original."""
    if mode == "spectral":
        scale = math.sqrt(max(rows, cols))
    elif mode == "unit_rms_norm":
        scale = math.sqrt(rows / cols)
    elif mode == "shape_scaling":
        scale = math.sqrt(max(1, rows / cols))
    else:
        raise ValueError(f"--muon-scale-mode {mode!r}: spectral, unit_rms_norm or shape_scaling")
    return scale * extra


def _sections(param: torch.Tensor, length: int) -> Tuple[int, ...]:
    """The lengths of the parts of `param`'s partition dimension split over TP separately (full sizes), for a
    dimension of `length` values."""
    sections = getattr(param, "partition_sections", None)
    return tuple(sections) if sections else equal_sections(length, getattr(param, "partition_stride", 1))


def gather_dense(shard: torch.Tensor, param: torch.Tensor, tp: int) -> torch.Tensor:
    """This TP rank's shard -> the dense tensor, each partition section whole (over TP's process group), put
    together as a checkpoint merge puts TP slices together (checkpoint/slicing.py)."""
    pieces = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(pieces, shard.contiguous(), group=tp_group())
    dim = param.partition_dim
    return slicing.merge(pieces, dim, _sections(param, shard.shape[dim] * tp))


class Muon(torch.optim.AdamW):
    """AdamW on the groups without 'muon', Muon on the group(s) marked 'muon': True
    (checkpoint/optimizer_groups.parameter_groups). clip_grad > 0: the step first scales the gradients to a
    global norm of at most clip_grad (ZeRO 0, where DeepSpeed hands us the model's own gradients:
    training/optimizer.py says why). After deepspeed.initialize, `use_partitions` gets DeepSpeed's flat
    partitions (deepspeed_compat.optimizer_state.optimizer_partitions); before it, groups hold the parameters
    themselves."""

    def __init__(self, params, *, momentum: float, nesterov: bool, ns_steps: int, scale_mode: str,
                 extra_scale: float, split_qkv: bool, split_gate_up: bool, tp_mode: str, precision: str = "highest",
                 clip_grad: float = 0.0, **adamw):
        super().__init__(params, **adamw)
        update_scale(1, 1, scale_mode, extra_scale)  # an unknown mode fails here, not at the first step
        self.momentum, self.nesterov, self.ns_steps = momentum, nesterov, ns_steps
        self.scale_mode, self.extra_scale = scale_mode, extra_scale
        self.split = {"qkv": split_qkv, "gate_up": split_gate_up}
        self.tp_mode, self.precision, self.clip_grad = tp_mode, precision, clip_grad
        self.last_grad_norm = None
        self.partitions: Dict[int, Tuple[torch.Tensor, optimizer_state.FlatPartition]] = {}

    def use_partitions(self, partitions: Dict[int, optimizer_state.FlatPartition]) -> None:
        """partitions: group index -> view. Kept by the group's flat tensor: ZeRO 1/2 step this optimizer one
        group at a time, each shown as the only group (deepspeed_compat.optimizer_state.optimizer_partitions says
        so)."""
        self.partitions = {}
        for index, partition in partitions.items():
            flat = self.param_groups[index]["params"][0]
            self.partitions[id(flat)] = (flat, partition)

    @torch.no_grad()
    def step(self, closure=None):
        if self.clip_grad > 0:
            self.last_grad_norm = clip_to_global_norm(
                [p for group in self.param_groups for p in group["params"]], self.clip_grad)
        every = self.param_groups
        # AdamW.step walks self.param_groups: show it the AdamW groups only, for this call.
        self.param_groups = [g for g in every if not g.get("muon")]
        try:
            loss = super().step(closure)
        finally:
            self.param_groups = every
        for group in every:
            if group.get("muon"):
                self._muon_group(group)
        return loss

    def _muon_group(self, group: dict) -> None:
        lr, decay = group["lr"], group["weight_decay"]
        for tensor in group["params"]:
            if tensor.grad is None:
                continue
            update = self._look_ahead(tensor)
            flat, partition = self.partitions.get(id(tensor), (None, None))
            if flat is not tensor and self.partitions:
                # A buffer DeepSpeed made after use_partitions (none does in 0.19): its matrices are unknown here.
                raise RuntimeError("Muon was given DeepSpeed's flat partitions, but steps a tensor that is none of "
                                   "them: deepspeed_compat.optimizer_state.optimizer_partitions no longer matches "
                                   "this DeepSpeed")
            if flat is not tensor:  # the parameter itself, whole on this DP rank
                tensor.mul_(1 - lr * decay).add_(self._orthogonalised(update.view_as(tensor), tensor), alpha=-lr)
            else:
                self._partition_step(tensor, update, partition, lr, decay)

    def _look_ahead(self, tensor: torch.Tensor) -> torch.Tensor:
        """U of `tensor`'s values (elementwise: a parameter or a flat partition alike); advances the buffer."""
        state = self.state[tensor]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=tensor.device)
            state["exp_avg"] = torch.zeros_like(tensor, memory_format=torch.preserve_format)
        state["step"] += 1
        grad, buffer = tensor.grad, state["exp_avg"]
        buffer.lerp_(grad, 1 - self.momentum)
        return grad.lerp(buffer, self.momentum) if self.nesterov else buffer

    def _partition_step(self, flat: torch.Tensor, update: torch.Tensor, partition, lr: float, decay: float) -> None:
        spread = dist.get_world_size(group=partition.group) > 1
        for batch in _batches(partition.params):
            whole = torch.zeros(sum(p.numel() for p in batch), dtype=update.dtype, device=update.device)
            values = whole.split([p.numel() for p in batch])  # each parameter's, flattened
            here = []
            for p, value in zip(batch, values):
                fragment = partition.fragments.get(id(p))
                if fragment is not None:
                    start, count, at = fragment
                    value.narrow(0, start, count).copy_(update.narrow(0, at, count))
                here.append(fragment is not None)
            if spread:
                dist.all_reduce(whole, group=partition.group)
            needed = torch.tensor(here, dtype=torch.int32, device=update.device)
            if self.tp_mode == "duplicated" and tp_world_size() > 1:  # TP peers gather together or not at all
                dist.all_reduce(needed, op=dist.ReduceOp.MAX, group=tp_group())
            for p, value, need in zip(batch, values, needed.tolist()):
                if not need:
                    continue
                orthogonal = self._orthogonalised(value.view(p.shape), p)
                fragment = partition.fragments.get(id(p))
                if fragment is not None:
                    start, count, at = fragment
                    flat.narrow(0, at, count).mul_(1 - lr * decay).add_(
                        orthogonal.reshape(-1).narrow(0, start, count), alpha=-lr)

    def _orthogonalised(self, shard: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """s O of every matrix in this TP rank's `shard` of `param` (fp32, the shard's shape)."""
        sectioned = bool(getattr(param, "tensor_model_parallel", False)) and param.partition_dim >= 0
        tp = tp_world_size() if sectioned and self.tp_mode == "duplicated" else 1
        dense = gather_dense(shard, param, tp) if tp > 1 else shard
        out = torch.empty(dense.shape, dtype=torch.float32, device=dense.device)
        experts = is_expert_parameter(param)
        for e in range(dense.shape[0]) if experts else (None,):
            matrix, result = (dense, out) if e is None else (dense[e], out[e])
            for part, into in zip(self._parts(matrix, param, experts, sectioned),
                                  self._parts(result, param, experts, sectioned)):
                rows, cols = part.shape
                into.copy_(newton_schulz(part, self.ns_steps, self.precision)).mul_(
                    update_scale(rows, cols, self.scale_mode, self.extra_scale))
        if tp == 1:
            return out
        return slicing.piece(out, tp, tp_rank(), param.partition_dim, _sections(param, out.shape[param.partition_dim]))

    def _parts(self, matrix: torch.Tensor, param: torch.Tensor, experts: bool, sectioned: bool) -> List[torch.Tensor]:
        """The matrices Muon orthogonalises one by one in an [out, in] `matrix` of `param`: its partition
        sections where the fused kind is split (Q, K, V; gate, up), else the whole."""
        fused = getattr(param, "fused", None)
        if not (sectioned and fused and self.split.get(fused, False)):
            return [matrix]
        dim = param.partition_dim - 1 if experts else param.partition_dim
        tp = tp_world_size() if self.tp_mode == "blockwise" else 1  # blockwise: the shard's own sections
        return list(matrix.split([n // tp for n in _sections(param, matrix.shape[dim] * tp)], dim=dim))


def _batches(params: Sequence[torch.Tensor]) -> List[List[torch.Tensor]]:
    """Consecutive parameters assembled by one all-reduce (cost/muon.py `assembly_batches`)."""
    return [[params[i] for i in batch] for batch in assembly_batches([p.numel() for p in params])]
