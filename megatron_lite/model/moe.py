"""A Mixture-of-Experts MLP: a router, E routed experts (each the block's MLP, GeLU or gated, --moe-ffn-hidden-size
wide) and optionally a shared expert every token passes through (gated by sigmoid(x . w) with
--moe-shared-expert-gate).

    x [b, s, h] (sequence parallel: [b, s/tp, h])
    routing = router(x)                                  this rank's tokens, [T, k] weights and experts
    tokens, weights: gathered over TP under sequence parallelism, else replicated
    rows = dispatch(tokens)                              to the experts' EP ranks (parallel/experts.py)
    y = sum_k weights_k expert_k(x)                      expert outputs partial over TP (column/row split);
                                                         expert_k(x) includes its down-projection bias
    out = reduce over TP (sequence parallel: reduce-scatter) + shared expert

Each expert is split over TP as the dense MLP is: its [2F, h] (gated: [gate; up]) weight by rows, its
[h, F] weight by columns, so their product is a partial sum the TP reduction completes; the weights an
expert gets come from a generator seeded by its global index, so any EP and TP layout builds the same model.
The routing weights pass through TP's copy (or gather) on their way in because their gradient, like the
expert outputs, is partial over TP.

Host syncs and torch.compile: at EP 1 the layer reads nothing from the device, forward or backward (counts by
scatter-add, a static number of dispatched rows, the experts' grouped GEMM on device offsets), so it traces
into one graph. At EP > 1 the all-to-all's split sizes are read once per layer, in parallel/experts.py's
`_dispatch_over_ep`, which with `_return_over_ep` runs outside torch.compile. The per-expert loop (CUDA without
--moe-grouped-gemm, or what torch's grouped GEMM does not take: model/grouped_linear.py) reads the row counts,
once per layer, and runs eagerly. The metrics (router.local_load, step_sums) are device buffers added to in place;
training/expert_balance.py reads them once per step.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.model.activation import mlp_activation
from megatron_lite.model.grouped_linear import grouped_linear, grouped_mm_linear, grouped_mm_takes
from megatron_lite.model.mlp import ParallelMLP
from megatron_lite.model.moe_options import expert_ffn_hidden_size
from megatron_lite.model.router import TopKRouter, capacity, within_capacity
from megatron_lite.parallel.experts import (
    DispatchPlan,
    combine,
    dispatch,
    local_experts,
    mark_expert_parameter,
    token_shards,
)
from megatron_lite.parallel.layers import (
    _master_slice,
    equal_sections,
    set_matrix_attributes,
    set_sequence_parallel_attribute,
    set_tensor_model_parallel_attributes,
)
from megatron_lite.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_along_sequence,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron_lite.parallel.tp import tp_rank, tp_world_size


def _stacked_parameter(masters: List[torch.Tensor]) -> nn.Parameter:
    stacked = torch.stack(masters)
    param = nn.Parameter(torch.empty(stacked.shape, dtype=stacked.dtype))
    with torch.no_grad():
        param.copy_(stacked)
    return param


class GroupedExperts(nn.Module):
    """This rank's E/EP experts as stacked weights: weight1 [E/EP, F/tp (gated: 2F/tp), h], weight2
    [E/EP, h, F/tp] (nn.Linear's [out, in] per expert); biases when the block has them."""

    def __init__(self, config: ModelConfig, grouped_gemm: bool):
        super().__init__()
        h, ffn = config.hidden_size, expert_ffn_hidden_size(config)
        gated, self.activation = config.gated_linear_unit, mlp_activation(config)
        self.grouped_gemm = grouped_gemm
        experts, tp = config.num_experts, tp_world_size()
        out1 = 2 * ffn if gated else ffn
        std = config.init_method_std
        # One draw from the layer's seeded stream, the same on every rank; each expert's generator is seeded
        # from it and the expert's global index, so its weights do not depend on the layout.
        base = int(torch.randint(0, 2 ** 62, (1,), device="cpu").item())

        def expert_init(index: int, scale: float):
            gen = torch.Generator().manual_seed(base + 2 * index + (scale != std))
            return lambda w: nn.init.normal_(w, mean=0.0, std=scale, generator=gen)

        out_std = std / (2.0 * config.num_layers) ** 0.5
        self.num_experts, self.local_range = experts, local_experts(experts)
        w1 = [_master_slice((out1, h), 0, equal_sections(out1, 2 if gated else 1), expert_init(e, std))
              for e in self.local_range]
        w2 = [_master_slice((h, ffn), 1, (ffn,), expert_init(e, out_std)) for e in self.local_range]
        # Made where the dense layers make theirs (the default device, parallel/layers.py's _parameter), filled
        # from the CPU masters: a parameter of the CPU stack stayed on the CPU in a model built on the GPU, and
        # the GPU check's MoE tests failed in the first expert GEMM.
        self.weight1 = _stacked_parameter(w1)
        self.weight2 = _stacked_parameter(w2)
        set_tensor_model_parallel_attributes(self.weight1, True, 1, 2 if gated else 1)
        set_tensor_model_parallel_attributes(self.weight2, True, 2, 1)
        # Every expert's [out, in] slice is a matrix of its own (training/muon.py).
        set_matrix_attributes(self.weight1, fused="gate_up" if gated else None)
        set_matrix_attributes(self.weight2)
        self.bias1 = self.bias2 = None
        if config.add_bias_linear:
            self.bias1 = nn.Parameter(torch.zeros(len(w1), out1 // tp))
            set_tensor_model_parallel_attributes(self.bias1, True, 1, 2 if gated else 1)
            # Added on TP rank 0 only (the outputs are partial sums over TP): its gradient is summed over TP.
            self.bias2 = nn.Parameter(torch.zeros(len(w1), h))
            set_tensor_model_parallel_attributes(self.bias2, False)
            self.bias2.tp_partial_gradient = True
        for param in self.parameters():
            mark_expert_parameter(param, experts)
        self.whole = None
        """{name: [E, ...]} every expert's tensor while a checkpoint is written (training/engine.py gathers them),
        which the layer's state dict then holds: files store experts by global index, whatever the EP."""
        self._register_state_dict_hook(GroupedExperts._whole_experts)
        self._register_load_state_dict_pre_hook(GroupedExperts._this_ranks_experts, with_module=True)

    @staticmethod
    def _whole_experts(module, state_dict, prefix, local_metadata):
        for name, tensor in (module.whole or {}).items():
            state_dict[prefix + name] = tensor
        return state_dict

    @staticmethod
    def _this_ranks_experts(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        # A saved [E, ...] tensor (every expert) loads as this EP rank's experts.
        for name, _ in module.named_parameters(recurse=False):
            saved = state_dict.get(prefix + name)
            if saved is not None and saved.shape[0] == module.num_experts != len(module.local_range):
                state_dict[prefix + name] = saved.narrow(0, module.local_range.start, len(module.local_range))

    def forward(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """rows [N, h] grouped by local expert (dispatch's, ending at plan.offsets) -> [N, h], partial over TP."""
        # One grouped GEMM per projection, where each expert's rows end a device tensor: on the CPU always (its
        # _grouped_mm is one GEMM per expert, the loop's numbers), on CUDA with --moe-grouped-gemm.
        if grouped_mm_takes(rows, self.weight1, self.weight2) and (self.grouped_gemm or not rows.is_cuda):
            return self._mlp(rows, lambda x, w, bias: grouped_mm_linear(x, w, plan.offsets, bias, plan.padded))
        return self._looped(rows, plan)

    def _mlp(self, rows: torch.Tensor, linear) -> torch.Tensor:
        inner = linear(rows, self.weight1, self.bias1)
        # bias2 is inside each expert's output, so the routing weight scales it too: y = sum_k w_k (W2_k a + b2_k)
        return linear(self.activation(inner), self.weight2, None if self.bias2 is None else self._output_bias())

    @torch.compiler.disable
    def _looped(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """One GEMM per expert, a loop over experts, never over tokens. Its sizes are host numbers: at EP > 1 those
        the all-to-all read anyway, at EP 1 one copy of the offsets (this path's one host sync per layer)."""
        counts = plan.tokens_per_local_expert
        if counts is None:
            counts = _host_counts(plan.offsets, rows.shape[0])
        return self._mlp(rows, lambda x, w, bias: grouped_linear(x, w, counts, bias))

    def _output_bias(self) -> torch.Tensor:
        """bias2 on TP rank 0, zeros elsewhere: the outputs are partial sums over TP, the bias counts once. Zero
        times the bias, not nothing, so every TP rank has a gradient for the TP sum (parallel/sequence_parallel.py)
        to add up: a rank without one would send a shorter buffer and the all-reduce would never match."""
        return self.bias2 if tp_rank() == 0 else self.bias2 * 0.0


def _host_counts(offsets: torch.Tensor, rows: int) -> List[int]:
    """Rows per expert from the offsets (the per-expert loop's one device-to-host copy at EP 1), and the
    padding rows after the last expert's, if any."""
    ends = offsets.tolist()
    counts = [end - start for start, end in zip([0] + ends, ends)]
    return counts + [rows - ends[-1]] if rows > ends[-1] else counts


class MoELayer(nn.Module):
    def __init__(self, config: ModelConfig, sequence_parallel: bool = False, layer_number: int = 0):
        super().__init__()
        self.sequence_parallel = sequence_parallel and tp_world_size() > 1
        self.layer_number = layer_number
        self.num_experts = config.num_experts
        self.capacity_factor, self.drop_policy = config.moe_expert_capacity_factor, config.moe_token_drop_policy
        self.router = TopKRouter(config, self.sequence_parallel)
        self.experts = GroupedExperts(config, config.moe_grouped_gemm)
        self.shared_expert: Optional[nn.Module] = None
        self.shared_expert_gate: Optional[nn.Parameter] = None
        if config.moe_shared_expert_intermediate_size is not None:
            shared = dataclasses.replace(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size)
            self.shared_expert = ParallelMLP(shared, sequence_parallel)
            if config.moe_shared_expert_gate:
                self.shared_expert_gate = nn.Parameter(torch.empty(1, config.hidden_size))
                nn.init.normal_(self.shared_expert_gate, mean=0.0, std=config.init_method_std)
                set_tensor_model_parallel_attributes(self.shared_expert_gate, False)
                if self.sequence_parallel:
                    set_sequence_parallel_attribute(self.shared_expert_gate)
        # This rank's sums over the step's micro-batches: its shares of the aux loss and z-loss, of the dropped
        # fraction and of the micro-batch count (1 / the ranks sharing a micro-batch's tokens each), which
        # training/expert_balance.py sums over the batch once per step into `last_step`: no collective and no
        # wait for the device per micro-batch for the metrics.
        self.register_buffer("step_sums", torch.zeros(4), persistent=False)
        self.last_step = {}
        """The last global batch's load per expert and mean router losses and dropped fraction, for the metrics."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        routing = self.router(x.reshape(-1, h), b)
        weights, indices = routing.weights.view(b, s, -1), routing.indices.view(b, s, -1)
        if self.sequence_parallel:  # every TP rank takes all tokens of the TP group, for its part of each expert
            tokens = gather_from_sequence_parallel_region(x)
            weights = gather_from_sequence_parallel_region(weights)
            indices = gather_along_sequence(indices)
        else:
            tokens = copy_to_tensor_model_parallel_region(x)
        k = indices.shape[-1]
        tokens, weights, indices = tokens.reshape(-1, h), weights.reshape(-1, k), indices.reshape(-1, k)
        keep = within_capacity(indices, weights, self.num_experts, self.capacity_factor, self.drop_policy)
        limit = None if keep is None else capacity(tokens.shape[0], k, self.num_experts, self.capacity_factor)
        rows, plan = dispatch(tokens, indices, self.num_experts, keep, limit)
        outputs = combine(self.experts(rows, plan), plan)  # [T, k, h] partial over TP
        if not self.sequence_parallel:
            # After combine, not before dispatch: at EP > 1 both run eagerly (model/compile.py), and the copy's
            # output (its input itself, forward) would cross that graph break without the copy's backward.
            weights = copy_to_tensor_model_parallel_region(weights)
        # [T, k, h] x [T, k] summed over k: elementwise (einsum would run it as T tiny bmm products)
        y = (outputs * weights.unsqueeze(-1)).sum(1).view(b, -1, h)  # [b, s, h] (SP: whole s), partial over TP
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y)
        else:
            y = reduce_from_tensor_model_parallel_region(y)
        if self.training:
            zero, share = self.step_sums.new_zeros(()), 1.0 / token_shards(self.sequence_parallel)
            aux = zero if routing.aux_loss is None else routing.aux_loss
            z = zero if routing.z_loss is None else routing.z_loss
            dropped = zero if keep is None else 1.0 - keep.float().mean()
            self.step_sums += torch.stack([aux, z, dropped * share, zero + share])  # in place on the device
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(F.linear(x, self.shared_expert_gate))
            y = y + shared
        return y
