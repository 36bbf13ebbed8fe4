"""Our Llama-family GPT with experts in every layer <-> Hugging Face `MixtralForCausalLM`: Llama's attention,
norms and embeddings (checkpoint/hf_llama.py), each layer's MLP as Mixtral's sparse block (checkpoint/hf_moe.py):
save_pretrained's block_sparse_moe.experts.e.w1 (gate), w3 (up), w2 (down) and block_sparse_moe.gate, or
transformers 5's fused mlp.experts.gate_up_proj / down_proj and mlp.gate on the way in.

Mixtral's router is the softmax over all experts, its top k, divided by their sum: our default router
(without --moe-router-pre-softmax). It has no shared expert and no dense layers; router_jitter_noise (noise
on the router's input in training) is not built here and refused unless 0. Its sliding_window, when set, is
Mistral's (checkpoint/hf_import.py). config.json's intermediate_size is the experts' width.
"""
from __future__ import annotations

from typing import List

from megatron_lite.checkpoint import hf_llama, hf_moe
from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_fields import real, refusal
from megatron_lite.checkpoint.hf_mapping import Mapped, StateDict
from megatron_lite.config import ModelConfig
from megatron_lite.model.moe_options import expert_ffn_hidden_size, moe_layer_pattern

ARCHITECTURES = ("MixtralForCausalLM",)
FLAGS = hf_llama.FLAGS + ", --num-experts, --moe-ffn-hidden-size"
NAMES = hf_moe.ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")
EXPERTS = True
"""The importer asks the files which spelling of the experts they hold (hf_moe.fused_names)."""

hf_name, is_derived = hf_llama.hf_name, hf_llama.is_derived


def check_mixtral(m: ModelConfig) -> None:
    hf_llama.check_llama(m, "MixtralForCausalLM")
    hf_moe.check_router(m, "MixtralForCausalLM", renormalised=True)
    for refused, flag, why in (
            (m.qk_layernorm, "--qk-layernorm", "has no QK-norm (Qwen3MoeForCausalLM holds it)"),
            (bool(m.moe_shared_expert_intermediate_size), "--moe-shared-expert-intermediate-size",
             "has no shared expert (Qwen2MoeForCausalLM holds one with its gate)"),
            (not all(moe_layer_pattern(m)), f"--moe-layer-freq {m.moe_layer_freq}",
             "has experts in every layer (Qwen2MoeForCausalLM and Qwen3MoeForCausalLM have dense layers too)"),
            (m.add_qkv_bias, "--add-qkv-bias", "has no attention biases")):
        if refused:
            raise CheckpointError(f"MixtralForCausalLM {why}; this model was built with {flag}")


def mapping(m: ModelConfig, fused: bool = False) -> List[Mapped]:
    """Llama's table with every layer's MLP as Mixtral's experts; `fused`: transformers 5's in-memory spelling."""
    check_mixtral(m)
    return hf_moe.with_experts(hf_llama.table(m), m, NAMES, fused)


def to_hf(dense: StateDict, m: ModelConfig) -> StateDict:
    return hf_moe.to_hf(dense, m, mapping, FLAGS)


def from_hf(hf: StateDict, m: ModelConfig) -> StateDict:
    return hf_moe.from_hf(hf, m, mapping, FLAGS)


def hf_config(m: ModelConfig) -> dict:
    """config.json of the MixtralForCausalLM that holds our model."""
    check_mixtral(m)
    llama = hf_llama.hf_config(m)
    config = {k: v for k, v in llama.items() if k not in ("pretraining_tp", "mlp_bias", "attention_bias")}
    return dict(config, architectures=["MixtralForCausalLM"], model_type="mixtral",
                sliding_window=llama.get("sliding_window"), intermediate_size=expert_ffn_hidden_size(m),
                num_local_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
                router_aux_loss_coef=m.moe_aux_loss_coeff, router_jitter_noise=0.0, output_router_logits=False)


def model_fields(c: dict, where: str) -> dict:
    """Our ModelConfig fields for a MixtralForCausalLM config.json; a field we cannot represent is refused by name."""
    if real(c, "router_jitter_noise", where, 0.0, minimum=0) != 0.0:
        raise refusal(where, "router_jitter_noise", c["router_jitter_noise"], "is not supported: the router here takes "
                      "its input as it is; set it to 0")
    fields = hf_llama.model_fields(c, where)
    experts = hf_moe.expert_count(c, where, ("num_local_experts",))
    return dict(fields, **hf_moe.router_fields(c, where, experts), moe_ffn_hidden_size=fields["ffn_hidden_size"],
                moe_layer_freq="1")
