"""The MoE router: which experts each token goes to and with what weight, and the load-balancing losses.

    logits = x W_r^T + b_r (fp32; b_r with --add-bias-linear)     [T, E]
    softmax, default       top-k of the logits, softmax over those k      (Mixtral: renormalised top-k)
    softmax, pre-softmax   softmax over all E, then top-k, no renormalising (Qwen2-MoE, norm_topk_prob off)
    sigmoid                sigmoid per expert, top-k, the k renormalised  (DeepSeek-V3)
    then x --moe-router-topk-scaling-factor.

The expert bias (--moe-router-enable-expert-bias) is added to the scores only to choose the k experts; the
weights come from the scores without it. Group-limited routing keeps, per token, the groups whose two best
(biased) scores sum highest, and chooses inside them.

Load-balancing losses are over one micro-batch's tokens, wherever they are: the token counts and totals are
summed over the ranks holding its parts (CP, and TP under sequence parallelism; parallel/experts.py), while
each rank differentiates its own tokens' probabilities. Their gradient is added in backward by
aux_loss.attach, so nothing crosses pipeline stages.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.model.aux_loss import attach
from megatron_lite.parallel.experts import expert_counts, sum_over_token_shards, token_shards
from megatron_lite.parallel.layers import set_sequence_parallel_attribute, set_tensor_model_parallel_attributes


class Routing(NamedTuple):
    weights: torch.Tensor
    """[T, k] each chosen expert's weight (the input's dtype)."""
    indices: torch.Tensor
    """[T, k] global expert ids (int64)."""
    aux_loss: Optional[torch.Tensor] = None
    """This rank's share of the load-balancing loss (detached, for the metrics), in training, else None."""
    z_loss: Optional[torch.Tensor] = None
    """This rank's share of the z-loss, likewise."""


class TopKRouter(nn.Module):
    def __init__(self, config: ModelConfig, sequence_parallel: bool = False):
        super().__init__()
        m = config
        self.num_experts, self.topk = m.num_experts, m.moe_router_topk
        self.score_function, self.pre_softmax = m.moe_router_score_function, m.moe_router_pre_softmax
        self.scaling_factor = m.moe_router_topk_scaling_factor
        self.num_groups, self.group_topk = m.moe_router_num_groups, m.moe_router_group_topk
        self.balancing, self.aux_coeff = m.moe_router_load_balancing_type, m.moe_aux_loss_coeff
        self.z_coeff = m.moe_z_loss_coeff
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(m.num_experts, m.hidden_size))
        nn.init.normal_(self.weight, mean=0.0, std=m.init_method_std)
        # Megatron-LM's router has a bias with every linear's (--add-bias-linear, gpt-oss's mlp.router.bias)
        self.bias = nn.Parameter(torch.zeros(m.num_experts)) if m.add_bias_linear else None
        for param in (self.weight, self.bias):
            if param is not None:
                set_tensor_model_parallel_attributes(param, False)
                if sequence_parallel:  # each TP rank routes its own part of the sequence: a partial gradient
                    set_sequence_parallel_attribute(param)
        self._register_load_state_dict_pre_hook(TopKRouter._zero_bias_if_missing, with_module=True)
        # Selection bias (aux-loss-free balancing): saved with the layer, moved by update_expert_bias.
        self.register_buffer("expert_bias", torch.zeros(m.num_experts) if m.moe_router_enable_expert_bias else None)
        self.bias_update_rate = m.moe_router_bias_update_rate
        # This rank's routed copies per expert since the last bias update (its own tokens only).
        self.register_buffer("local_load", torch.zeros(m.num_experts), persistent=False)
        self.last_load = None
        """Routed copies per expert over the last global batch (update_expert_bias), for the metrics."""

    def forward(self, x: torch.Tensor, samples: int) -> Routing:
        """x [T, h] this rank's tokens (T = samples x its part of the sequence)."""
        bias = None if self.bias is None else self.bias.float()
        logits = F.linear(x.float(), self.weight.float(), bias)  # [T, E], fp32 whatever the model's dtype
        if self.score_function == "sigmoid":
            scores = torch.sigmoid(logits)
        elif self.pre_softmax:
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = logits
        indices = self._choose(scores.detach())
        chosen = scores.gather(1, indices)
        if self.score_function == "softmax" and not self.pre_softmax:
            weights = torch.softmax(chosen, dim=-1)
        elif self.score_function == "sigmoid" and self.topk > 1:
            weights = chosen / (chosen.sum(-1, keepdim=True) + 1e-20)
        else:
            weights = chosen
        if self.scaling_factor is not None:
            weights = weights * self.scaling_factor
        local = expert_counts(indices, self.num_experts).float()
        if self.training:
            self.local_load += local  # a device tensor, added to in place: no host read, nothing for compile to guard
        weights, aux, z = self._attach_losses(weights, logits, indices, local, samples)
        return Routing(weights.to(x.dtype), indices, aux, z)

    @staticmethod
    def _zero_bias_if_missing(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        # Checkpoints of MoE models with biases written before the router had one: a zero bias is that model.
        if module.bias is not None and prefix + "weight" in state_dict and prefix + "bias" not in state_dict:
            state_dict[prefix + "bias"] = torch.zeros_like(module.bias)

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        """[T, E] scores (no gradient) -> [T, k] chosen experts, by the biased scores, within the kept groups."""
        if self.expert_bias is not None:
            scores = scores + self.expert_bias
        if self.num_groups is not None:
            T = scores.shape[0]
            grouped = scores.view(T, self.num_groups, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            kept = group_scores.topk(self.group_topk, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            scores = grouped.masked_fill(~mask[..., None], float("-inf")).view(T, -1)
        return scores.topk(self.topk, dim=-1).indices

    def _attach_losses(self, weights, logits, indices, local_load, samples):
        """Make backward add the gradients of the aux and z losses; (weights, this rank's shares of the aux
        and z losses, detached, or None where there is none)."""
        aux = z = None
        if self.training and self.balancing != "none" and self.aux_coeff > 0:
            aux = self._balancing_loss(logits, indices, local_load, samples)
            weights = attach(weights, aux)
            aux = aux.detach()
        if self.training and self.z_coeff:
            total = logits.shape[0] * token_shards(self.sequence_parallel)
            z = self.z_coeff * torch.logsumexp(logits, dim=-1).square().sum() / total
            weights = attach(weights, z)
            z = z.detach()
        return weights, aux, z

    def _balancing_loss(self, logits, indices, local_load, samples) -> torch.Tensor:
        """This rank's share of coeff x E / k x sum_e f_e P_e (f: routed fraction, P: mean probability),
        f and the token totals over the whole micro-batch, P's sum over this rank's tokens."""
        E, k = self.num_experts, self.topk
        if self.score_function == "sigmoid":
            s = torch.sigmoid(logits)
            probs = s / (s.sum(-1, keepdim=True) + 1e-20)
        else:
            probs = torch.softmax(logits, dim=-1)
        shards = token_shards(self.sequence_parallel)
        if self.balancing == "seq_aux_loss":  # per sequence, then the mean over the micro-batch's sequences
            T = logits.shape[0]
            per_sample = probs.view(samples, T // samples, E)
            counts = torch.zeros(samples, E, device=logits.device)
            counts.scatter_add_(1, indices.view(samples, -1), torch.ones_like(indices.view(samples, -1), dtype=counts.dtype))
            counts = sum_over_token_shards(counts, self.sequence_parallel)
            seq = T // samples * shards
            aux = (per_sample.sum(1) * counts).sum() * (E * self.aux_coeff / (k * seq * seq * samples))
        else:  # f from the copies per expert over every rank holding the micro-batch's tokens
            total = logits.shape[0] * shards
            tokens_per_expert = sum_over_token_shards(local_load, self.sequence_parallel)
            aux = (probs.sum(0) * tokens_per_expert).sum() * (E * self.aux_coeff / (k * total * total))
        return aux

    @torch.no_grad()
    def update_expert_bias(self, load: torch.Tensor) -> None:
        """bias += rate x sign(mean load - load), load = routed copies per expert over the whole global batch
        (DeepSeek-V3's aux-loss-free balancing); then the local count starts again."""
        self.last_load = load.clone()
        if self.expert_bias is not None:
            self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.local_load.zero_()


def capacity(tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Copies an expert takes from one rank's micro-batch with --moe-expert-capacity-factor (as DeepSpeed and
    Megatron-LM: ceil(tokens x k / E x factor))."""
    return math.ceil(tokens * topk / num_experts * factor)


def within_capacity(indices: torch.Tensor, weights: torch.Tensor, num_experts: int, factor: Optional[float],
                    policy: str) -> Optional[torch.Tensor]:
    """[T, k] bool: the copies each expert keeps (its `capacity` highest-weighted, or first), or None when
    dropless."""
    if factor is None:
        return None
    T, k = indices.shape
    limit = capacity(T, k, num_experts, factor)
    experts = indices.reshape(-1)
    if policy == "probs":
        by_weight = torch.argsort(weights.detach().reshape(-1).float(), descending=True, stable=True)
        order = by_weight[torch.argsort(experts[by_weight], stable=True)]
    else:
        order = torch.argsort(experts, stable=True)
    counts = expert_counts(experts, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(T * k, device=indices.device) - starts[experts[order]]
    keep = torch.empty(T * k, dtype=torch.bool, device=indices.device).scatter_(0, order, rank_in_expert < limit)
    return keep.view(T, k)
