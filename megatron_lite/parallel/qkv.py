"""The fused query/key/value projection of grouped-query attention, split over TP ranks.

The dense (TP = 1) weight is [Q; K; V]: Q has a heads of hd rows each (a query heads), K and V have g
heads of hd rows each (g = --num-query-groups key/value heads), heads ordered by group: query head i uses
group i // (a / g), as in transformers' Llama. hd is --kv-channels (h / a when not given). With g = a and
hd = h / a this is GPT-2's fused [Q; K; V].

Each of Q, K and V is cut into TP equal contiguous pieces, and rank r keeps [Q_r; K_r; V_r]
(parallel/layers.py's sections). Rank r's a/TP query heads all belong to
groups it needs:

    g >= TP (g a multiple of TP): K_r and V_r are the g/TP whole groups of those heads; nothing more.
    g <  TP (TP a multiple of g): TP/g ranks share one group. Each keeps a distinct 1/(TP/g) piece of
        every group's K and V rows (so a checkpoint, ZeRO and the gradient norm see every weight once);
        forward all-gathers the K/V rows over TP and takes its own group's, backward reduce-scatters
        their gradient, which sums each group's gradient over exactly the ranks that used it (the
        others add zeros). The gather moves 2 g hd x h weights per layer and micro-batch, not
        activations.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron_lite.parallel.layers import ColumnParallelLinear, InitMethod, set_matrix_attributes
from megatron_lite.parallel.mappings import gather_rows_from_tensor_model_parallel_region
from megatron_lite.parallel.tp import tp_rank, tp_world_size


def local_query_groups(num_query_groups: int, tp: int) -> int:
    """Key/value groups one TP rank attends with: g / TP whole groups, or its one (shared) group."""
    return max(num_query_groups // tp, 1)


class QKVParallelLinear(ColumnParallelLinear):
    """[b, s, h] -> [b, s, (a/tp + 2 g_local) hd]: this rank's queries, then its groups' keys and values."""

    def __init__(self, hidden_size: int, num_heads: int, num_query_groups: int, head_dim: int, bias: bool,
                 init_method: InitMethod, sequence_parallel: bool = False):
        self.head_dim, self.num_query_groups = head_dim, num_query_groups
        q, kv = num_heads * head_dim, num_query_groups * head_dim
        super().__init__(hidden_size, q + 2 * kv, bias=bias, init_method=init_method,
                         sequence_parallel=sequence_parallel, sections=(q, kv, kv))
        set_matrix_attributes(self.weight, fused="qkv")
        tp = tp_world_size()
        self.shared_groups = num_query_groups < tp
        self.local_groups = local_query_groups(num_query_groups, tp)

    def local_weight_and_bias(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if not self.shared_groups:
            return self.weight, self.bias
        return (self._with_own_group(self.weight),
                None if self.bias is None else self._with_own_group(self.bias))

    def _with_own_group(self, local: torch.Tensor) -> torch.Tensor:
        """[Q_r; K pieces; V pieces] -> [Q_r; K_g; V_g] for this rank's group g."""
        q_rows, kv_rows = self.local_sections[0], self.local_sections[1]
        query, key_value = local.split((q_rows, 2 * kv_rows), dim=0)
        tp = tp_world_size()
        # [tp * 2 kv_rows, ...] -> [tp, 2, kv_rows, ...] -> K and V of every group, [g hd, ...] each
        gathered = gather_rows_from_tensor_model_parallel_region(key_value)
        both = gathered.unflatten(0, (tp, 2, kv_rows)).transpose(0, 1).flatten(1, 2)
        group = tp_rank() // (tp // self.num_query_groups)
        rows = slice(group * self.head_dim, (group + 1) * self.head_dim)
        return torch.cat([query, both[0, rows], both[1, rows]], dim=0)
