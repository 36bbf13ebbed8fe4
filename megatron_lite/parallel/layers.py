"""Linear and embedding layers whose weights are split across tensor-parallel ranks.

A TP = N layer computes what the TP = 1 layer computes: every rank builds the
full-size master weight with the caller's RNG (so the same seed gives the same
master on every rank), keeps its slice, and the mappings put the collectives
where the math needs them.

    ColumnParallelLinear  weight [out/tp, in]   y_r = x A_r^T          (x replicated)
    ReplicatedLinear      weight [out, in]      y = x A^T on every rank (what a column-parallel layer reads)
    RowParallelLinear     weight [out, in/tp]   y = sum_r x_r A_r^T + b
    VocabParallelEmbedding weight [V/tp, h]     rows outside this rank's range give 0, then sum

Every parameter carries `tensor_model_parallel`, `partition_dim` and
`partition_stride`: the gradient norm counts split parameters on every rank
and replicated ones once (DeepSpeed reads the same `tensor_model_parallel`
flag), and checkpoint merging knows how to put slices back together.

With sequence_parallel=True (--sequence-parallel) the column-parallel layers take
[b, s/tp, in] sequence shards and all-gather them, and the row-parallel ones
reduce-scatter their output to [b, s/tp, out]. A replicated parameter that sees only
this rank's shard (LayerNorms, the row-parallel bias) then gets a partial gradient:
it carries `sequence_parallel = True`, and its gradient is summed over TP once per
step (parallel/sequence_parallel.py). So is that of a replicated parameter applied to
each of this rank's heads (--qk-layernorm's norms), tagged `shared_by_heads = True`.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_along_sequence,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_along_sequence,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_lite.parallel.tp import partition_range, split_size, tp_rank, tp_world_size

InitMethod = Callable[[torch.Tensor], None]


def default_init_method(weight: torch.Tensor) -> None:
    nn.init.normal_(weight, mean=0.0, std=0.02)


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int = -1,
                                         stride: int = 1, sections: Optional[Tuple[int, ...]] = None) -> None:
    """Tag a parameter; replicated ones (LayerNorm, row-parallel bias) get (False, -1, 1).

    sections: the full (TP = 1) lengths of the parts of partition_dim that are split separately (the fused
    QKV's Q, K and V); None means `stride` equal parts."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride
    param.partition_sections = tuple(sections) if sections is not None else None


def set_matrix_attributes(param: torch.Tensor, hidden: bool = True, fused: Optional[str] = None) -> None:
    """Tag a weight as one of the transformer layers' matrices (hidden: what Muon orthogonalises,
    training/muon.py; the output head is not one) and name the fused parts of its partition sections
    ('qkv': Q, K and V; 'gate_up': SwiGLU's halves), each a matrix of its own unless told otherwise."""
    param.hidden_matrix = hidden
    param.fused = fused


def set_sequence_parallel_attribute(param: torch.Tensor) -> None:
    """Tag a replicated parameter used on sequence shards: its gradient must be summed over TP."""
    param.sequence_parallel = True


def set_sequence_parallel_parameters(module: torch.nn.Module) -> None:
    """Tag every parameter of a replicated module that sees only this rank's sequence shard (a LayerNorm)."""
    for param in module.parameters():
        set_sequence_parallel_attribute(param)


def is_sequence_parallel_parameter(param: torch.Tensor) -> bool:
    return bool(getattr(param, "sequence_parallel", False))


def set_head_shared_parameters(module: torch.nn.Module) -> None:
    """Tag every parameter of a replicated module applied to each of this rank's heads (QK-norm): a TP rank's
    gradient covers its own heads only, so, like a sequence-parallel one, it must be summed over TP."""
    for param in module.parameters():
        param.shared_by_heads = True


def has_partial_gradient(param: torch.Tensor) -> bool:
    """A replicated parameter whose gradient on each TP rank is part of the whole: it saw only this rank's
    sequence shard or this rank's heads (summed over TP once per step: parallel/sequence_parallel.py)."""
    return (is_sequence_parallel_parameter(param) or bool(getattr(param, "shared_by_heads", False))
            or bool(getattr(param, "tp_partial_gradient", False)))


class _SequenceParallelLinear(torch.autograd.Function):
    """y = all_gather_sequence(x) A^T + b for a sequence shard x [b, s/tp, in].

    The all-gather (backward: reduce-scatter) fused with the matmul that consumes it, as in
    Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication: autograd keeps the shard
    [b, s/tp, in], not the gathered [b, s, in], and backward gathers it again for the weight
    gradient (Korthikanti et al. 2022, section 4.2.2: what makes the stored activations 1/tp).
    """

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.use_bias = bias is not None
        return F.linear(gather_along_sequence(x), weight, bias)  # [b, s/tp, in] -> [b, s, out/tp]

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        full = gather_along_sequence(x)  # [b, s, in] again
        grad_input = reduce_scatter_along_sequence(grad_output.matmul(weight))  # partial over TP -> [b, s/tp, in]
        grad_rows = grad_output.reshape(-1, grad_output.size(-1))  # [b s, out/tp]
        grad_weight = grad_rows.t().matmul(full.reshape(-1, full.size(-1)))
        grad_bias = grad_rows.sum(0) if ctx.use_bias else None
        return grad_input, grad_weight, grad_bias


def equal_sections(size: int, stride: int) -> Tuple[int, ...]:
    """`stride` equal parts of a dimension of `size`."""
    return (split_size(size, stride, f"dimension of size {size} in {stride} parts"),) * stride


def _master(full_shape, init_method: InitMethod) -> torch.Tensor:
    """A full-size fp32 CPU master weight filled by init_method (the same on every rank for the same RNG state)."""
    if torch.empty(0).is_meta:  # built on the meta device only for names and shapes (checkpoint/layout.py)
        return torch.empty(full_shape, dtype=torch.float32, device="meta")
    master = torch.empty(full_shape, dtype=torch.float32, device="cpu")
    init_method(master)
    return master


def _master_slice(full_shape, partition_dim: int, sections: Sequence[int], init_method: InitMethod) -> torch.Tensor:
    """This rank's slice of a full-size fp32 CPU master weight filled by init_method.

    The split dim is made of `sections` (their lengths), each cut into tp equal pieces; rank r takes
    piece r of every section: a fused [Q; K; V] weight gives each rank [Q_r; K_r; V_r].
    """
    master = _master(full_shape, init_method)
    world = tp_world_size()
    if world == 1:
        return master
    pieces = []
    for part in torch.split(master, list(sections), dim=partition_dim):
        size = split_size(part.shape[partition_dim], world, f"a part of dimension {partition_dim} of the weight")
        pieces.append(part.narrow(partition_dim, tp_rank() * size, size))
    return torch.cat(pieces, dim=partition_dim)


def _parameter(shape, dtype: torch.dtype, value: torch.Tensor, is_parallel: bool, dim: int = -1,
               stride: int = 1, sections: Optional[Tuple[int, ...]] = None) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype))
    with torch.no_grad():
        param.copy_(value)
    set_tensor_model_parallel_attributes(param, is_parallel, dim, stride, sections)
    return param


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split along its output rows: each rank computes out/tp features.

    sections (lengths adding up to output_size) splits each part of the output separately, for fused
    weights whose parts differ in size (grouped-query QKV); stride s means s equal sections."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False,
                 init_method: Optional[InitMethod] = None, stride: int = 1,
                 params_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                 sections: Optional[Sequence[int]] = None):
        super().__init__()
        world = tp_world_size()
        if sections is None:
            sections = equal_sections(output_size, stride)
        elif sum(sections) != output_size:
            raise ValueError(f"ColumnParallelLinear sections {tuple(sections)} do not add up to output_size "
                             f"{output_size}")
        stride = len(sections)
        if gather_output and sequence_parallel:
            raise ValueError("gather_output=True with sequence_parallel=True: a sequence-parallel input feeds "
                             "split layers; gather the output where it is needed")
        self.sequence_parallel = sequence_parallel and world > 1
        if gather_output and stride > 1 and world > 1:
            raise ValueError(f"gather_output=True with stride {stride} at TP {world} would return the output "
                             "in per-rank [q_r k_r v_r] order, not the dense order; keep gather_output=False")
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.stride = gather_output, stride
        self.sections = tuple(sections)
        self.local_sections = tuple(
            split_size(n, world, f"ColumnParallelLinear output section of {n} (TP {world})") for n in sections)
        self.output_size_per_partition = sum(self.local_sections)
        # Equal sections are recorded as a stride (checkpoints before grouped-query attention know only that).
        recorded = None if len(set(self.sections)) == 1 else self.sections

        weight = _master_slice((output_size, input_size), 0, self.sections, init_method or default_init_method)
        self.weight = _parameter((self.output_size_per_partition, input_size), params_dtype, weight,
                                 True, 0, stride, recorded)
        set_matrix_attributes(self.weight)
        self.bias = None
        if bias:
            self.bias = _parameter((self.output_size_per_partition,), params_dtype, torch.zeros(()),
                                   True, 0, stride, recorded)

    def local_weight_and_bias(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The weight and bias this rank multiplies with: its parameters (a subclass may assemble them)."""
        return self.weight, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.local_weight_and_bias()
        if self.sequence_parallel:
            return _SequenceParallelLinear.apply(x, weight, bias)  # [b, s/tp, in] -> [b, s, out/tp]
        x = copy_to_tensor_model_parallel_region(x)
        y = F.linear(x, weight, bias)  # [..., in] -> [..., out/tp]
        return gather_from_tensor_model_parallel_region(y) if self.gather_output else y


class ReplicatedLinear(nn.Module):
    """y = x A^T + b with the whole A on every TP rank (MLA's down projections: model/latent_attention.py).

    Every rank builds the same master with the caller's RNG. Its output feeds column-parallel layers, whose
    input mapping sums the gradient over TP, so without sequence parallelism each rank's weight gradient is
    already the whole one; with it (sequence_parallel=True) the layer sees this rank's [b, s/tp, in] shard
    only, and its parameters are tagged `sequence_parallel`, their gradients summed over TP once per step."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 init_method: Optional[InitMethod] = None, params_dtype: torch.dtype = torch.float32,
                 sequence_parallel: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        master = _master((output_size, input_size), init_method or default_init_method)
        self.weight = _parameter((output_size, input_size), params_dtype, master, False)
        set_matrix_attributes(self.weight)
        self.bias = _parameter((output_size,), params_dtype, torch.zeros(()), False) if bias else None
        if sequence_parallel:
            set_sequence_parallel_parameters(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split along its input columns: partial products summed over ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = True,
                 init_method: Optional[InitMethod] = None, params_dtype: torch.dtype = torch.float32,
                 sequence_parallel: bool = False):
        super().__init__()
        world = tp_world_size()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True (the input is split over TP)")
        self.sequence_parallel = sequence_parallel and world > 1
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        self.input_size_per_partition = split_size(input_size, world, f"RowParallelLinear input_size (TP {world})")

        weight = _master_slice((output_size, input_size), 1, (input_size,), init_method or default_init_method)
        self.weight = _parameter((output_size, self.input_size_per_partition), params_dtype, weight, True, 1)
        set_matrix_attributes(self.weight)
        # Replicated: added once after the reduce, so every rank holds the whole bias.
        self.bias = _parameter((output_size,), params_dtype, torch.zeros(()), False) if bias else None
        if self.bias is not None and self.sequence_parallel:
            set_sequence_parallel_attribute(self.bias)  # added to this rank's sequence shard only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x)  # [..., in] -> [..., in/tp]
        if tp_world_size() == 1:  # nothing to reduce: the bias goes into the matmul (one addmm)
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y)  # [b, s, out] partial -> [b, s/tp, out]
        else:
            y = reduce_from_tensor_model_parallel_region(y)  # [..., out]
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split into contiguous ranges, one per TP rank."""

    def __init__(self, num_embeddings: int, embedding_dim: int, init_method: Optional[InitMethod] = None,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        world = tp_world_size()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_partition = split_size(
            num_embeddings, world, f"VocabParallelEmbedding num_embeddings (TP {world}; pad the vocabulary)")
        self.vocab_start_index, self.vocab_end_index = partition_range(self.num_embeddings_per_partition, tp_rank())

        weight = _master_slice((num_embeddings, embedding_dim), 0, (num_embeddings,), init_method or default_init_method)
        self.weight = _parameter((self.num_embeddings_per_partition, embedding_dim), params_dtype, weight, True, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_world_size() == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        y = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # [..., h]
        return reduce_from_tensor_model_parallel_region(y)


def parallel_lm_logits(hidden: torch.Tensor, word_embedding_weight: torch.Tensor,
                       bias: Optional[torch.Tensor] = None, parallel_output: bool = True,
                       sequence_parallel: bool = False) -> torch.Tensor:
    """Output-head logits against a vocab-split weight (a tied head passes the embedding's weight).

    [..., h] x [V/tp, h] -> [..., V/tp]; parallel_output=False gathers [..., V] (for generation).
    sequence_parallel: hidden is a sequence shard [b, s/tp, h], gathered here (the logits of every
    position are what the vocab-parallel cross entropy needs).
    """
    if sequence_parallel and tp_world_size() > 1:
        logits = _SequenceParallelLinear.apply(hidden, word_embedding_weight, bias)  # [b, s, V/tp]
    else:
        logits = F.linear(copy_to_tensor_model_parallel_region(hidden), word_embedding_weight, bias)
    return logits if parallel_output else gather_from_tensor_model_parallel_region(logits)
