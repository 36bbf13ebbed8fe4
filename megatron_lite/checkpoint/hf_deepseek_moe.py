"""DeepSeek-V3's mixture of experts in a Hugging Face config.json <-> our MoE flags, for the two architectures that
have it: DeepseekV3ForCausalLM (checkpoint/hf_deepseek_v3_config.py) and Glm4MoeForCausalLM (hf_glm4_moe.py), whose
routers, MoE blocks and decoder layers are one code in transformers (Glm4MoeTopkRouter is DeepseekV3TopkRouter).

transformers' router, against ours (model/router.py, --moe-router-score-function sigmoid):
  scores = sigmoid(x W_r^T) in fp32; the expert choice adds e_score_correction_bias (our expert bias) to them,
  keeps the topk_group groups (of n_group) whose two best biased scores sum highest and takes the top k there;
  the weights are the unbiased scores of the k, divided by their sum under norm_topk_prob, x routed_scaling_factor.
Ours divides by the sum whenever k > 1 (Megatron-LM's rule), so norm_topk_prob must be k > 1; one group (Kimi
K2's and GLM-4.5's n_group 1) is our routing without groups; transformers' router always has the bias, so ours
needs --moe-router-enable-expert-bias. The shared expert is n_shared_experts x moe_intermediate_size wide,
ungated. The first first_k_dense_replace layers are dense (intermediate_size), every later one has experts.
Neither scoring_func (sigmoid) nor topk_method (noaux_tc) is read by transformers, which implements only those:
other values are refused.
"""
from __future__ import annotations

from typing import Iterable, Tuple

from megatron_lite.checkpoint import hf_moe
from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_fields import real, refusal, whole
from megatron_lite.config import ModelConfig
from megatron_lite.model.moe_options import expert_ffn_hidden_size, moe_layer_pattern

Refusal = Tuple[bool, str, str, str]
"""(refused, what the architecture has, how the model was built, what would work)."""


def refuse_first(architecture: str, refusals: Iterable[Refusal]) -> None:
    """Raise the first refusal that holds: '{architecture} {what}; this model was built {flag}: {fix}'."""
    for refused, what, flag, fix in refusals:
        if refused:
            raise CheckpointError(f"{architecture} {what}; this model was built {flag}: {fix}")


def refusals(m: ModelConfig) -> list:
    """What a model with experts must have for DeepSeek-V3's MoE block to hold it (none without experts)."""
    if m.num_experts is None:
        return []
    ffn, shared, pattern = expert_ffn_hidden_size(m), m.moe_shared_expert_intermediate_size, moe_layer_pattern(m)
    first = pattern.index(True) if any(pattern) else len(pattern)
    return [
        (m.moe_router_score_function != "sigmoid", "scores experts by sigmoid",
         f"with --moe-router-score-function {m.moe_router_score_function}", "use --moe-router-score-function sigmoid"),
        (not m.moe_router_enable_expert_bias, "always chooses experts with its router's e_score_correction_bias",
         "without --moe-router-enable-expert-bias", "add it"),
        (not shared, "has a shared expert in every MoE layer (n_shared_experts x moe_intermediate_size)",
         "without --moe-shared-expert-intermediate-size", f"add it, a multiple of {ffn}"),
        (bool(shared) and shared % ffn != 0, "has n_shared_experts x moe_intermediate_size wide shared experts",
         f"with --moe-shared-expert-intermediate-size {shared}", f"use a multiple of {ffn}"),
        (m.moe_shared_expert_gate, "has no gate on its shared expert (Qwen2MoeForCausalLM's has)",
         "with --moe-shared-expert-gate", "drop it"),
        (not all(pattern[first:]) or first == len(pattern),
         "has first_k_dense_replace dense layers, then experts in every layer",
         f"with --moe-layer-freq {m.moe_layer_freq}", f"use one like ([0]*{min(first, m.num_layers - 1)}+[1]*"
         f"{m.num_layers - min(first, m.num_layers - 1)})")]


def hf_config(m: ModelConfig) -> dict:
    """config.json's MoE keys (first_k_dense_replace = L alone for a model without experts)."""
    if m.num_experts is None:  # every layer dense: transformers builds no MoE block and reads no router field
        return {"first_k_dense_replace": m.num_layers}
    ffn, k, groups = expert_ffn_hidden_size(m), m.moe_router_topk, m.moe_router_num_groups
    return dict(first_k_dense_replace=moe_layer_pattern(m).index(True), n_routed_experts=m.num_experts,
                num_experts_per_tok=k, moe_intermediate_size=ffn,
                n_shared_experts=m.moe_shared_expert_intermediate_size // ffn, n_group=groups or 1,
                topk_group=m.moe_router_group_topk or 1,
                routed_scaling_factor=float(m.moe_router_topk_scaling_factor or 1.0), norm_topk_prob=k > 1,
                router_aux_loss_coef=m.moe_aux_loss_coeff)


def field_error(where: str, key: str, value, why: str) -> CheckpointError:
    return refusal(where, key, value, f"is not supported: {why}")


def model_fields(c: dict, where: str, layers: int, architecture: str) -> dict:
    """Our MoE fields for config.json `c` (the architecture's defaults filled in); none when first_k_dense_replace
    leaves every layer dense."""
    dense = whole(c, "first_k_dense_replace", where, minimum=0)
    if dense >= layers:
        return {}
    experts = whole(c, "n_routed_experts", where)
    fields = dict(hf_moe.router_fields(c, where, experts), moe_ffn_hidden_size=whole(c, "moe_intermediate_size", where),
                  moe_layer_freq=f"([0]*{dense}+[1]*{layers - dense})" if dense else "1",
                  moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_shared_expert_intermediate_size=whole(c, "n_shared_experts", where)
                  * whole(c, "moe_intermediate_size", where))
    for key, ours in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if c.get(key, ours) != ours:
            raise field_error(where, key, c[key], f"transformers' {architecture} (and our router) implement {ours} "
                                                  f"alone")
    k, renormalised = fields["moe_router_topk"], c.get("norm_topk_prob")
    if renormalised is not (k > 1):
        raise field_error(where, "norm_topk_prob", renormalised, f"the sigmoid router here divides the top-k weights "
                          f"by their sum exactly when num_experts_per_tok > 1 (here {k}); set it to "
                          f"{str(k > 1).lower()}")
    groups, group_topk = whole(c, "n_group", where), whole(c, "topk_group", where)
    if group_topk > groups:
        raise field_error(where, "topk_group", group_topk, f"it is more than n_group {groups}")
    if groups > 1:  # one group keeps every expert: routing without groups
        fields.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    scaling = real(c, "routed_scaling_factor", where, above=0)
    if scaling != 1.0:
        fields["moe_router_topk_scaling_factor"] = scaling
    return fields
