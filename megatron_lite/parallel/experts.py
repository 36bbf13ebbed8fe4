"""Expert parallelism (--expert-model-parallel-size EP): where a routed token's expert lives, the all-to-all
that takes it there and back, and the sums over the ranks that hold one micro-batch's tokens.

Experts are split in contiguous blocks: EP rank r holds experts r E/EP .. (r+1) E/EP - 1, whole (each split
over TP like the dense MLP). A rank sends each routed copy of a token to its expert's rank in one
all-to-all with per-rank sizes (exchanged first, so ranks never have to agree on a capacity), the experts
run, and the mirror all-to-all brings the outputs back. A rank that sends or receives nothing still joins
both collectives, with empty parts, so no rank waits for another.

    dispatch  [T, h] tokens, [T, k] expert indices -> [N, h] grouped by local expert, + a plan to return
    combine   [N, h] expert outputs, the plan        -> [T, k, h] in the tokens' order (dropped copies 0)

Without `parallel.state.initialize()`, or at EP = 1, everything stays on this rank.

Host syncs. At EP = 1 nothing is read from the device: the rows are a static number (T k, or with a capacity
at most C per expert, min(T k, E C), the dropped copies among them padding), sorted by expert, and where each
expert's rows end stays a device tensor (DispatchPlan.offsets) that the experts' grouped GEMM takes
(model/grouped_linear.py). So the whole MoE layer traces into one torch.compile graph. At EP > 1 the
all-to-alls need their split sizes on the host: `_dispatch_over_ep` copies every count the layer needs to the
host at once, right after the counts' own all-to-all (one device-to-host copy per layer and micro-batch; the
mirror all-to-all in combine and both backward all-to-alls reuse those numbers). It and `_return_over_ep` run
outside torch.compile (torch.compiler.disable); the rest of the layer compiles.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron_lite.parallel import state
from megatron_lite.parallel.context_parallel import cp_group, cp_world_size
from megatron_lite.parallel.tp import _parallel, tp_group, tp_world_size

_seconds = 0.0


def mark_expert_parameter(param: torch.Tensor, num_experts: int) -> None:
    """Tag a parameter holding this rank's experts along dim 0: reduced over expert-DP, not DP x CP
    (deepspeed_compat.experts.mark_expert_parameters tells DeepSpeed), counted over EP in the gradient norm, and
    stored by global expert index in checkpoints."""
    param.expert_parallel = True
    param.num_experts = num_experts


def is_expert_parameter(param: torch.Tensor) -> bool:
    return bool(getattr(param, "expert_parallel", False))


def ep_world_size() -> int:
    """EP size; 1 without parallel state or inside tp.as_single_rank() (a layer built for its dense shapes)."""
    return state.get_expert_model_parallel_world_size() if _parallel() else 1


def ep_rank() -> int:
    return state.get_expert_model_parallel_rank() if _parallel() else 0


def ep_group():
    return state.get_expert_model_parallel_group() if _parallel() else None


@torch.no_grad()
def gather_experts(t: torch.Tensor) -> torch.Tensor:
    """[E/EP, ...] this rank's experts -> [E, ...] every expert in global order (checkpoints store them so)."""
    if ep_world_size() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(ep_world_size())]
    dist.all_gather(parts, t.contiguous(), group=ep_group())
    return torch.cat(parts)


def seconds() -> float:
    """Seconds spent in expert-parallel all-to-alls by this process so far (forward and backward): the
    timing breakdown's ep-a2a column."""
    return _seconds


def local_experts(num_experts: int) -> range:
    """The global indices of the experts this EP rank holds."""
    per_rank = num_experts // ep_world_size()
    return range(ep_rank() * per_rank, (ep_rank() + 1) * per_rank)


@torch.no_grad()
def sum_over_token_shards(t: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """t summed over the ranks that hold parts of this micro-batch's tokens: its CP ranks, and under
    sequence parallelism its TP ranks (without it every TP rank holds the same tokens). No gradient: token
    counts and totals for the load-balancing losses."""
    t = t.clone()
    if cp_world_size() > 1:
        dist.all_reduce(t, group=cp_group())
    if sequence_parallel and tp_world_size() > 1:
        dist.all_reduce(t, group=tp_group())
    return t


def token_shards(sequence_parallel: bool) -> int:
    """How many ranks split one micro-batch's tokens (the factor sum_over_token_shards sums over)."""
    return cp_world_size() * (tp_world_size() if sequence_parallel else 1)


@torch.no_grad()
def sum_over_batch(t: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """t summed over every rank that holds part of the global batch's tokens: DP x CP, and TP under
    sequence parallelism (the expert-bias update's load, summed over the whole batch)."""
    t = t.clone()
    if state.is_initialized() and state.get_data_parallel_world_size(with_context_parallel=True) > 1:
        dist.all_reduce(t, group=state.get_data_parallel_group(with_context_parallel=True))
    if sequence_parallel and tp_world_size() > 1:
        dist.all_reduce(t, group=tp_group())
    return t


def _all_to_all(x: torch.Tensor, out_rows: List[int], in_rows: List[int]) -> torch.Tensor:
    global _seconds
    start = time.perf_counter()
    x = x.contiguous()
    out = x.new_empty((sum(out_rows),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, out_rows, in_rows, group=ep_group())
    _seconds += time.perf_counter() - start
    return out


class _AllToAll(torch.autograd.Function):
    """Rows in_rows[j] of x go to EP rank j; out_rows[j] rows come from rank j. Backward: the mirror."""

    @staticmethod
    def forward(ctx, x, out_rows, in_rows):
        ctx.rows = (out_rows, in_rows)
        return _all_to_all(x, out_rows, in_rows)

    @staticmethod
    def backward(ctx, grad_output):
        out_rows, in_rows = ctx.rows
        return _all_to_all(grad_output, in_rows, out_rows), None, None


@dataclass
class DispatchPlan:
    """What the experts and combine need: where each expert's rows end, and how to bring the outputs back."""
    shape: tuple
    """(T, k): tokens and routed copies per token."""
    order: torch.Tensor
    """Positions (in the flattened [T k] copies) of the rows sent, sorted by expert."""
    offsets: torch.Tensor
    """[E/EP] int32, on the rows' device: local expert e's rows end at offsets[e]."""
    padded: bool
    """Rows may follow offsets[-1] (EP 1 with a capacity: the dropped copies among the static bound); their
    outputs are zeros."""
    tokens_per_local_expert: Optional[List[int]] = None
    """The rows per local expert on the host where the all-to-all needed them anyway (EP > 1), else None."""
    sent_rows: Optional[List[int]] = None
    received_rows: Optional[List[int]] = None
    local_order: Optional[torch.Tensor] = None
    """Received rows sorted by local expert (EP > 1), else None."""


def expert_counts(experts: torch.Tensor, bins: int) -> torch.Tensor:
    """[bins] int64: how many of `experts` (ids < bins) name each; what torch.bincount gives without its
    data-dependent length (which reads the largest id to the host)."""
    flat = experts.reshape(-1)
    return torch.zeros(bins, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def dispatch(tokens: torch.Tensor, indices: torch.Tensor, num_experts: int, keep: Optional[torch.Tensor] = None,
             capacity: Optional[int] = None):
    """tokens [T, h], indices [T, k] (global expert ids), keep [T, k] bool (within `capacity` copies per expert;
    None: keep all) -> (rows [N, h] grouped by this rank's experts in order, the plan for the experts and
    combine)."""
    T, k = indices.shape
    experts = indices.reshape(-1)
    if keep is not None:
        experts = torch.where(keep.reshape(-1), experts, num_experts)  # dropped copies sort last: never sent
    order = torch.sort(experts, stable=True).indices
    counts = expert_counts(experts, num_experts + 1)[:num_experts]
    if ep_world_size() == 1:
        # A static number of rows: every copy, or with a capacity at most `capacity` per expert, so that the
        # count of kept copies never has to reach the host; the dropped copies after them are padding.
        rows = T * k if capacity is None else min(T * k, num_experts * capacity)
        order = order[:rows]
        offsets = counts.cumsum(0).to(torch.int32)
        plan = DispatchPlan((T, k), order, offsets, padded=keep is not None)
        return tokens.index_select(0, order // k), plan
    return _dispatch_over_ep(tokens, order, counts, (T, k), num_experts)


@torch.compiler.disable
def _dispatch_over_ep(tokens, order, counts, shape, num_experts):
    """The copies to their experts' EP ranks. The split sizes of the all-to-alls, and the per-expert row counts,
    are host numbers: this is the layer's one read from the device, one copy of every count it needs."""
    T, k = shape
    ep = ep_world_size()
    local = num_experts // ep
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=ep_group())  # received[j local + e]: rank j's copies for my e
    host = torch.cat([counts, received]).tolist()  # the one device-to-host copy
    sent, got = host[:num_experts], host[num_experts:]
    sent_rows = [sum(sent[j * local:(j + 1) * local]) for j in range(ep)]
    received_rows = [sum(got[j * local:(j + 1) * local]) for j in range(ep)]
    per_expert = [sum(got[e::local]) for e in range(local)]
    order = order[:sum(sent_rows)]
    rows = _AllToAll.apply(tokens.index_select(0, order // k), received_rows, sent_rows)  # by source, then expert
    expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(
        received, output_size=rows.shape[0])
    local_order = torch.argsort(expert_of_row, stable=True)
    offsets = received.view(ep, local).sum(0).cumsum(0).to(torch.int32)
    plan = DispatchPlan((T, k), order, offsets, False, per_expert, sent_rows, received_rows, local_order)
    return rows.index_select(0, local_order), plan


def combine(outputs: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """outputs [N, h] (dispatch's rows, through the experts) -> [T, k, h]; a dropped copy's row is 0."""
    if plan.local_order is not None:
        outputs = _return_over_ep(outputs, plan)
    T, k = plan.shape
    whole = outputs.new_zeros((T * k, outputs.shape[-1]))
    return whole.index_copy(0, plan.order, outputs).view(T, k, -1)


@torch.compiler.disable
def _return_over_ep(outputs: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """The experts' outputs back to the ranks that sent the copies, in the order they were sent."""
    back = torch.empty_like(plan.local_order)
    back[plan.local_order] = torch.arange(len(plan.local_order), device=back.device)
    return _AllToAll.apply(outputs.index_select(0, back), plan.sent_rows, plan.received_rows)
