"""Our Llama-family GPT with experts and a gated shared expert <-> Hugging Face `Qwen2MoeForCausalLM`: Llama's
attention (with q/k/v biases under qkv_bias: our --add-qkv-bias), norms and embeddings (checkpoint/hf_llama.py),
each MoE layer's MLP as Qwen2-MoE's sparse block (checkpoint/hf_moe.py): the routed experts, the shared expert
(shared_expert_intermediate_size, our --moe-shared-expert-intermediate-size) and its sigmoid gate
(mlp.shared_expert_gate, our --moe-shared-expert-gate), the layers in mlp_only_layers (or off
decoder_sparse_step) dense with intermediate_size, as --moe-layer-freq's pattern.

    attention.query_key_value.bias   [(a + 2g) hd]  -> self_attn.q_proj.bias [a hd]; k_proj.bias, v_proj.bias [g hd]

The router divides the top-k weights by their sum only with norm_topk_prob (without: --moe-router-pre-softmax).
Every Qwen2-MoE layer with experts has the gated shared expert: a model without one is refused.
"""
from __future__ import annotations

from typing import List

from megatron_lite.checkpoint import hf_llama, hf_moe
from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_fields import refusal, whole
from megatron_lite.checkpoint.hf_mapping import Mapped, StateDict
from megatron_lite.config import ModelConfig
from megatron_lite.model.moe_options import expert_ffn_hidden_size

ARCHITECTURES = ("Qwen2MoeForCausalLM",)
FLAGS = hf_llama.FLAGS + ", --num-experts, --moe-ffn-hidden-size, --moe-layer-freq, " \
                         "--moe-shared-expert-intermediate-size, --moe-shared-expert-gate, --add-qkv-bias"
NAMES = hf_moe.ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
EXPERTS = True
SLIDING_WINDOW_SWITCH = True

hf_name, is_derived = hf_llama.hf_name, hf_llama.is_derived


def check_qwen2_moe(m: ModelConfig) -> None:
    hf_llama.check_llama(m, "Qwen2MoeForCausalLM", qkv_bias=True)
    hf_moe.check_router(m, "Qwen2MoeForCausalLM")
    if m.qk_layernorm:
        raise CheckpointError("Qwen2MoeForCausalLM has no QK-norm (Qwen3MoeForCausalLM holds it); this model was "
                              "built with --qk-layernorm")
    if not (m.moe_shared_expert_intermediate_size and m.moe_shared_expert_gate):
        # Name what the model lacks: one with an ungated shared expert has the width and not the gate.
        parts = (("--moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size),
                 ("--moe-shared-expert-gate", m.moe_shared_expert_gate))
        missing = " and ".join(flag for flag, has in parts if not has)
        raise CheckpointError(f"Qwen2MoeForCausalLM has a shared expert with a sigmoid gate in every MoE layer; this "
                              f"model was built without {missing} (MixtralForCausalLM holds routed experts alone)")


def mapping(m: ModelConfig, fused: bool = False) -> List[Mapped]:
    check_qwen2_moe(m)
    table = hf_llama.with_qkv_biases(hf_llama.table(m)) if m.add_qkv_bias else hf_llama.table(m)
    return hf_moe.with_experts(table, m, NAMES, fused)


def to_hf(dense: StateDict, m: ModelConfig) -> StateDict:
    return hf_moe.to_hf(dense, m, mapping, FLAGS)


def from_hf(hf: StateDict, m: ModelConfig) -> StateDict:
    return hf_moe.from_hf(hf, m, mapping, FLAGS)


def hf_config(m: ModelConfig) -> dict:
    check_qwen2_moe(m)
    config = {k: v for k, v in hf_llama.hf_config(m, qkv_bias=True).items() if k not in ("pretraining_tp", "mlp_bias",
                                                                          "attention_bias")}
    return dict(config, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                qkv_bias=bool(m.add_qkv_bias), use_sliding_window=False, sliding_window=None,
                max_window_layers=m.num_layers, num_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
                moe_intermediate_size=expert_ffn_hidden_size(m),
                shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
                norm_topk_prob=not m.moe_router_pre_softmax, decoder_sparse_step=1,
                mlp_only_layers=hf_moe.mlp_only_layers(m), router_aux_loss_coef=m.moe_aux_loss_coeff,
                output_router_logits=False)


def model_fields(c: dict, where: str) -> dict:
    windowed = [t for t in c.get("layer_types") or [] if t != "full_attention"]
    if c.get("use_sliding_window") or windowed:
        raise CheckpointError(f"{where}: use_sliding_window / layer_types ask for sliding-window layers, which are not "
                              f"supported here for Qwen2-MoE: set use_sliding_window to false")
    fields = hf_llama.model_fields(dict(c, attention_bias=False), where)
    experts = hf_moe.expert_count(c, where, ("num_experts",))
    pattern = hf_moe.qwen_pattern(c, where, fields["num_layers"])
    shared = whole(c, "shared_expert_intermediate_size", where)
    qkv_bias = c.get("qkv_bias", True)
    if not isinstance(qkv_bias, bool):
        raise refusal(where, "qkv_bias", qkv_bias, "must be true or false")
    fields = dict(fields, **hf_moe.router_fields(c, where, experts),
                  moe_ffn_hidden_size=whole(c, "moe_intermediate_size", where),
                  moe_router_pre_softmax=not c.get("norm_topk_prob", False), moe_layer_freq=hf_moe.layer_freq(pattern),
                  moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    if qkv_bias:
        fields["add_qkv_bias"] = True
    return fields
