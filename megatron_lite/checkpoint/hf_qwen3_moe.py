"""Our Llama-family GPT with --qk-layernorm and experts <-> Hugging Face `Qwen3MoeForCausalLM`: Qwen3's attention
with its QK-norm and free head size (checkpoint/hf_qwen3.py), each MoE layer's MLP as Qwen3-MoE's sparse block
(checkpoint/hf_moe.py: mlp.gate, mlp.experts.e.gate_proj/up_proj/down_proj, or the fused spelling), the layers
in mlp_only_layers (or off decoder_sparse_step) dense with intermediate_size, as --moe-layer-freq's pattern.

Its router divides the top-k weights by their sum only with norm_topk_prob: without it, the softmax over all
experts is kept, our --moe-router-pre-softmax. No shared expert. Qwen3MoeConfig writes its expert count as
num_local_experts (its num_experts reads it); both are read.
"""
from __future__ import annotations

from typing import List

from megatron_lite.checkpoint import hf_llama, hf_moe, hf_qwen3
from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_fields import whole
from megatron_lite.checkpoint.hf_mapping import Mapped, StateDict
from megatron_lite.config import ModelConfig
from megatron_lite.model.moe_options import expert_ffn_hidden_size

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
FLAGS = hf_qwen3.FLAGS + ", --num-experts, --moe-ffn-hidden-size, --moe-layer-freq"
NAMES = hf_moe.ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
EXPERTS = True
SLIDING_WINDOW_SWITCH = True

hf_name, is_derived = hf_llama.hf_name, hf_llama.is_derived


def check_qwen3_moe(m: ModelConfig) -> None:
    hf_qwen3.check_qwen3(m)
    hf_moe.check_router(m, "Qwen3MoeForCausalLM")
    if m.moe_shared_expert_intermediate_size:
        raise CheckpointError("Qwen3MoeForCausalLM has no shared expert; this model was built with "
                              "--moe-shared-expert-intermediate-size")
    if m.add_qkv_bias:
        raise CheckpointError("Qwen3MoeForCausalLM has no attention biases; this model was built with --add-qkv-bias")


def mapping(m: ModelConfig, fused: bool = False) -> List[Mapped]:
    check_qwen3_moe(m)
    return hf_moe.with_experts(hf_qwen3.mapping(m), m, NAMES, fused)


def to_hf(dense: StateDict, m: ModelConfig) -> StateDict:
    return hf_moe.to_hf(dense, m, mapping, FLAGS)


def from_hf(hf: StateDict, m: ModelConfig) -> StateDict:
    return hf_moe.from_hf(hf, m, mapping, FLAGS)


def hf_config(m: ModelConfig) -> dict:
    check_qwen3_moe(m)
    return dict(hf_qwen3.hf_config(m), architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                num_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
                moe_intermediate_size=expert_ffn_hidden_size(m), norm_topk_prob=not m.moe_router_pre_softmax,
                decoder_sparse_step=1, mlp_only_layers=hf_moe.mlp_only_layers(m),
                router_aux_loss_coef=m.moe_aux_loss_coeff, output_router_logits=False)


def model_fields(c: dict, where: str) -> dict:
    fields = hf_qwen3.model_fields(c, where)
    experts = hf_moe.expert_count(c, where, ("num_experts", "num_local_experts"))
    pattern = hf_moe.qwen_pattern(c, where, fields["num_layers"])
    return dict(fields, **hf_moe.router_fields(c, where, experts),
                moe_ffn_hidden_size=whole(c, "moe_intermediate_size", where),
                moe_router_pre_softmax=not c.get("norm_topk_prob", False), moe_layer_freq=hf_moe.layer_freq(pattern))
