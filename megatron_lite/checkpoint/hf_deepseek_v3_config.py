"""DeepseekV3ForCausalLM's config.json <-> our model flags (the weights: checkpoint/hf_deepseek_v3.py).

The router, shared expert and dense layers are DeepSeek-V3's MoE block (checkpoint/hf_deepseek_moe.py, shared with
Glm4MoeForCausalLM); export writes scoring_func and topk_method too, for the readers that take them (vLLM, SGLang).

The latents' norms (q_a_layernorm, kv_a_layernorm) are DeepseekV3RMSNorm with its default eps 1e-6 whatever
rms_norm_eps says, ours use --norm-epsilon like every norm: only rms_norm_eps 1e-6 maps exactly. The softmax
scale is YaRN's m(factor, mscale_all_dim)^2 / sqrt(d_n + d_r) on both sides (transformers' yarn_apply_mscale,
model/rotary.py mla_softmax_mscale); YaRN's fields are Llama's (hf_llama.rope_scaling, hf_llama._yarn).
"""
from __future__ import annotations

from megatron_lite.checkpoint import hf_deepseek_moe, hf_llama
from megatron_lite.checkpoint.hf_fields import real, whole
from megatron_lite.config import ModelConfig

ARCHITECTURE = "DeepseekV3ForCausalLM"
LATENT_NORM_EPSILON = 1e-6
"""transformers' DeepseekV3RMSNorm default, which its q_a_layernorm and kv_a_layernorm keep."""
DEFAULTS = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                first_k_dense_replace=3, n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True)
"""DeepseekV3Config's defaults, what transformers builds when config.json leaves a field out."""


def check_deepseek_v3(m: ModelConfig) -> None:
    """DeepseekV3ForCausalLM holds our model only with MLA, its latent norms and DeepSeek-V3's router; say why not."""
    hf_llama.check_llama(m, ARCHITECTURE)
    hf_deepseek_moe.refuse_first(ARCHITECTURE, [
        (not m.multi_latent_attention, "has Multi-head Latent Attention", "without --multi-latent-attention",
         "add it"),
        (not m.qk_layernorm, "normalises the query and key/value latents (q_a_layernorm, kv_a_layernorm)",
         "without --qk-layernorm", "add it"),
        (m.norm_epsilon != LATENT_NORM_EPSILON, "normalises the latents with eps 1e-6 whatever its rms_norm_eps says",
         f"with --norm-epsilon {m.norm_epsilon:g}", "use --norm-epsilon 1e-6"),
        (m.window_size is not None, "attends over the whole causal context",
         f"with --window-size {m.window_size and ','.join(map(str, m.window_size))}", "drop it"),
        # transformers' MtpModel builds its layers with experts (first_k_dense_replace 0); our depth is the last
        # layer's kind: dense without --num-experts.
        (bool(m.mtp_num_layers) and m.num_experts is None, "has experts in its multi-token prediction layers",
         f"with --mtp-num-layers {m.mtp_num_layers} and no --num-experts (a dense depth)",
         "only a model with experts exports its depths"),
        *hf_deepseek_moe.refusals(m)])


def hf_config(m: ModelConfig) -> dict:
    """config.json of the DeepseekV3ForCausalLM that holds our model: Llama's shared keys, MLA's widths, the
    router's fields, rope_interleave (the weights are written interleaved) and the MTP layers (--mtp-num-layers)."""
    check_deepseek_v3(m)
    drop = ("pretraining_tp", "mlp_bias", "architectures", "model_type", "sliding_window")
    config = {k: v for k, v in hf_llama.hf_config(m).items() if k not in drop}
    config.update(architectures=[ARCHITECTURE], model_type="deepseek_v3", num_key_value_heads=m.num_attention_heads,
                  head_dim=m.qk_pos_emb_head_dim, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                  qk_nope_head_dim=m.qk_head_dim, qk_rope_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
                  rope_interleave=True, attention_bias=False, num_nextn_predict_layers=m.mtp_num_layers or 0)
    moe = hf_deepseek_moe.hf_config(m)
    return dict(config, **moe, **({} if m.num_experts is None else {"scoring_func": "sigmoid",
                                                                    "topk_method": "noaux_tc"}))


_field = hf_deepseek_moe.field_error


def model_fields(c: dict, where: str) -> dict:
    """Our ModelConfig fields for a DeepseekV3ForCausalLM config.json; a field we cannot represent is refused by
    name (Llama's shared fields: hf_llama.model_fields)."""
    c = {**DEFAULTS, **{k: v for k, v in c.items() if v is not None or k == "q_lora_rank"}}
    heads = whole(c, "num_attention_heads", where)
    # quantization_config: fp8 block scales read dequantized by the importer (hf_fp8.py), anything else refused there
    if c.get("moe_layer_freq", 1) != 1:  # DeepSeek's own modeling_deepseek.py reads it; transformers does not
        raise _field(where, "moe_layer_freq", c["moe_layer_freq"], "experts are in every layer from "
                     "first_k_dense_replace on here, as in transformers' DeepseekV3; set it to 1")
    # Whether its layers import as --mtp-num-layers, the folder's weights decide (hf_deepseek_v3_mtp.import_fields).
    whole(c, "num_nextn_predict_layers", where, 0, minimum=0)
    if c.get("attention_bias"):
        raise _field(where, "attention_bias", c["attention_bias"], "its biases (q_a_proj, kv_a_proj_with_mqa, o_proj) "
                     "have no flag here: --add-bias-linear would put biases on the MLPs too; set it to false")
    if whole(c, "num_key_value_heads", where, heads) != heads:
        raise _field(where, "num_key_value_heads", c["num_key_value_heads"], "Multi-head Latent Attention gives "
                     f"every head its own key and value: set it to num_attention_heads ({heads})")
    epsilon = real(c, "rms_norm_eps", where, LATENT_NORM_EPSILON, above=0)
    if epsilon != LATENT_NORM_EPSILON:
        raise _field(where, "rms_norm_eps", epsilon, "transformers normalises the latents (q_a_layernorm, "
                     "kv_a_layernorm) with eps 1e-6 whatever it says, ours with --norm-epsilon as every other norm; "
                     "only rms_norm_eps 1e-6 (--norm-epsilon 1e-6) maps exactly")
    # head_dim in config.json is qk_rope_head_dim (the rotary table's width), not --kv-channels.
    fields = hf_llama.model_fields(dict(c, head_dim=None, num_key_value_heads=None), where)
    layers = fields["num_layers"]
    fields.update(multi_latent_attention=True, qk_layernorm=True, group_query_attention=False,
                  q_lora_rank=None if c["q_lora_rank"] is None else whole(c, "q_lora_rank", where),
                  kv_lora_rank=whole(c, "kv_lora_rank", where), qk_head_dim=whole(c, "qk_nope_head_dim", where),
                  qk_pos_emb_head_dim=whole(c, "qk_rope_head_dim", where, minimum=2),
                  v_head_dim=whole(c, "v_head_dim", where),
                  **hf_deepseek_moe.model_fields(c, where, layers, ARCHITECTURE))
    return fields
