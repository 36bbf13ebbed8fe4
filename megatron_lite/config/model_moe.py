"""ModelConfig's Mixture-of-Experts section: experts, router, balancing, shared expert, capacity, dispatch.
`model.py` assembles it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_lite.config.flag_values import parse_moe_layer_freq
from megatron_lite.config.option import Needs, differs_from, given, option

MOE = Needs("model.num_experts", given, "configure Mixture-of-Experts layers, which need --num-experts",
            "--num-experts (e.g. --num-experts 8)", code="moe_without_experts")
"""What every flag of an MoE layer needs: without --num-experts every layer has the dense MLP."""
CAPACITY = Needs("model.moe_expert_capacity_factor", given,
                 "chooses the tokens a full expert drops, and without a capacity (dropless) none is dropped",
                 "--moe-expert-capacity-factor (e.g. 1.0)")
EXPERT_BIAS = Needs("model.moe_router_enable_expert_bias", bool, "moves the expert bias, which is off",
                    "--moe-router-enable-expert-bias")
BALANCING = Needs("model.moe_router_load_balancing_type", differs_from("none"),
                  "weighs the load-balancing loss, which --moe-router-load-balancing-type none turns off",
                  "--moe-router-load-balancing-type aux_loss (or seq_aux_loss)")
SHARED_EXPERT = Needs("model.moe_shared_expert_intermediate_size", given, "gates the shared expert",
                      "--moe-shared-expert-intermediate-size (e.g. the --ffn-hidden-size)")


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts (Mixture of Experts); none when --num-experts is not given."""
    num_experts: Optional[int] = option(None, "--num-experts", minimum=1)
    """Routed experts per MoE layer (Mixture of Experts); when not given, every layer has the dense MLP."""
    moe_ffn_hidden_size: Optional[int] = option(None, "--moe-ffn-hidden-size", minimum=1, needs=(MOE,))
    """Inner width of each routed expert (gated width with --swiglu); when not given, --ffn-hidden-size."""
    moe_router_topk: int = option(2, "--moe-router-topk", minimum=1, needs=(MOE,))
    """Experts each token is routed to."""
    moe_layer_freq: str = option("1", "--moe-layer-freq", parse=lambda text: parse_moe_layer_freq(text)[0],
                                 metavar="N|PATTERN", needs=(MOE,))
    """Which layers are MoE: N = every N-th layer from the first (layer numbers 1, 1+N, ...), or a pattern
    with one 0 (dense) or 1 (MoE) per layer, written as Megatron-LM writes it: ([0]*1+[1]*5) or [0,1,1,1]."""
    moe_router_score_function: str = option("softmax", "--moe-router-score-function",
                                            choices=("softmax", "sigmoid"), needs=(MOE,))
    """Router scores: softmax over the experts (Mixtral, Qwen) or an independent sigmoid per expert
    (DeepSeek-V3)."""
    moe_router_pre_softmax: bool = option(False, "--moe-router-pre-softmax", needs=(MOE,))
    """softmax scoring: softmax over all experts, then top-k, weights not renormalised (Qwen2-MoE without
    norm_topk_prob); default: top-k of the logits, then softmax over the k (Mixtral: renormalised)."""
    moe_router_topk_scaling_factor: Optional[float] = option(None, "--moe-router-topk-scaling-factor", above=0,
                                                             maximum=1e6, needs=(MOE,))
    """Multiply the chosen experts' weights by this (DeepSeek-V3's routed_scaling_factor, 2.5)."""
    moe_router_num_groups: Optional[int] = option(None, "--moe-router-num-groups", minimum=1, needs=(MOE,))
    """Group-limited routing: the experts form this many groups; a token first keeps
    --moe-router-group-topk groups (each scored by the sum of its two best experts), then takes its top-k
    inside them (DeepSeek-V3's n_group)."""
    moe_router_group_topk: Optional[int] = option(None, "--moe-router-group-topk", minimum=1, needs=(MOE,))
    """Groups each token may route into, with --moe-router-num-groups (DeepSeek-V3's topk_group)."""
    moe_router_load_balancing_type: str = option("aux_loss", "--moe-router-load-balancing-type",
                                                 choices=("aux_loss", "seq_aux_loss", "none"), needs=(MOE,))
    """Load-balancing loss: aux_loss (Switch/GShard, over each micro-batch's tokens), seq_aux_loss (per
    sequence, DeepSeek-V3) or none; its weight is --moe-aux-loss-coeff."""
    moe_aux_loss_coeff: float = option(0.0, "--moe-aux-loss-coeff", minimum=0, maximum=1e6, needs=(MOE, BALANCING))
    """Weight of the load-balancing loss (0: off)."""
    moe_z_loss_coeff: Optional[float] = option(None, "--moe-z-loss-coeff", minimum=0, maximum=1e6, needs=(MOE,))
    """Weight of the router z-loss (mean squared log-sum-exp of the router logits; ST-MoE); off when not given."""
    moe_router_enable_expert_bias: bool = option(False, "--moe-router-enable-expert-bias", needs=(MOE,))
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores to choose experts (never
    to weight them), moved after each global batch by --moe-router-bias-update-rate towards equal load."""
    moe_router_bias_update_rate: float = option(1e-3, "--moe-router-bias-update-rate", minimum=0, maximum=1e6,
                                               needs=(MOE, EXPERT_BIAS))
    """Step of the expert-bias update: bias += rate x sign(mean load - expert load), once per global batch."""
    moe_shared_expert_intermediate_size: Optional[int] = option(None, "--moe-shared-expert-intermediate-size",
                                                                minimum=1, needs=(MOE,))
    """Inner width of an MLP every token passes through beside its routed experts (DeepSeek, Qwen2-MoE's
    shared expert); none when not given."""
    moe_shared_expert_gate: bool = option(False, "--moe-shared-expert-gate", needs=(MOE, SHARED_EXPERT))
    """Scale the shared expert's output by sigmoid(x . w), a learned per-token gate (Qwen2-MoE)."""
    moe_expert_capacity_factor: Optional[float] = option(None, "--moe-expert-capacity-factor", above=0,
                                                         maximum=1e6, needs=(MOE,))
    """Each expert takes at most ceil(tokens x top-k / experts x this) of a rank's tokens per micro-batch,
    the rest are dropped (their expert output is 0); when not given, dropless."""
    moe_token_drop_policy: str = option("probs", "--moe-token-drop-policy", choices=("probs", "position"),
                                       needs=(MOE, CAPACITY))
    """With a capacity: an expert keeps its highest-weighted tokens (probs) or its first ones (position)."""
    moe_token_dispatcher_type: str = option("alltoall", "--moe-token-dispatcher-type", choices=("alltoall",))
    """How tokens reach their experts' ranks: alltoall (one all-to-all over the expert-parallel group there
    and one back; the only dispatcher built)."""
    moe_grouped_gemm: bool = option(False, "--moe-grouped-gemm", needs=(MOE,))
    """Run a rank's experts as one grouped GEMM (torch._grouped_mm, CUDA) instead of one GEMM per expert; on
    CPU torch's grouped GEMM has no backward, so the per-expert loop runs there either way."""
