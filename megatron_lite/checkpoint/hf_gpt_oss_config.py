"""GptOssForCausalLM's config.json <-> our model flags (the weights: checkpoint/hf_gpt_oss.py).

    hidden_size, num_hidden_layers, num_attention_heads        --hidden-size, --num-layers, --num-attention-heads
    num_key_value_heads, head_dim (free: 64 at hidden 2880)    --group-query-attention --num-query-groups, --kv-channels
    attention_bias true (q, k, v, o biases)                    biases on (no --disable-bias-linear): every linear's
    sinks                                                      --softmax-type learnable
    sliding_window W, layer_types                              --window-size W-1,0 --window-attn-skip-freq N
    swiglu_alpha 1.702, swiglu_limit c                         --quick-geglu --glu-linear-offset 1
                                                               --activation-func-clamp-value c
    num_local_experts, num_experts_per_tok, intermediate_size  --num-experts, --moe-router-topk, --moe-ffn-hidden-size
    router: top k of x W^T + b, softmax over the k            --moe-router-score-function softmax (our default)
    router_aux_loss_coef                                       --moe-aux-loss-coeff
    rope_parameters / rope_scaling yarn (truncate false)       --position-embedding-type yarn and its flags
    rms_norm_eps, tie_word_embeddings false                    --norm-epsilon, --untie-embeddings-and-output-weights

Windows: transformers' window of W keys counts the query itself (--window-size W-1,0), and layer_types[i] says which
layers (0-based) slide; gpt-oss's default, "sliding_attention" where (i + 1) is odd, is our --window-attn-skip-freq
2, which makes layers 2, 4, .. (counted from 1) global (model/attention_options.py layer_window). Any pattern "global
every N-th layer" (N >= 2), all sliding (no skip flag) or all full (no window) is read; another is refused by name.

The experts' activation is gate' sigmoid(swiglu_alpha gate') (up' + 1) with gate' = min(gate, c) and
up' = clamp(up, -c, c): our quick-GeGLU's alpha is 1.702, so another swiglu_alpha is refused. The MoE output scales
each expert's down bias by its routing weight, as ours does. hidden_act is not read by transformers' gpt-oss.
"""
from __future__ import annotations

from typing import List

from megatron_lite.checkpoint import hf_llama, hf_moe
from megatron_lite.checkpoint.hf_deepseek_moe import field_error, refuse_first
from megatron_lite.checkpoint.hf_fields import as_json, real, whole
from megatron_lite.config import ModelConfig
from megatron_lite.model.activation import QUICK_GELU_ALPHA  # --quick-geglu's sigmoid gain: swiglu_alpha's default
from megatron_lite.model.attention_options import layer_window
from megatron_lite.model.moe_options import expert_ffn_hidden_size, moe_layer_pattern

ARCHITECTURE = "GptOssForCausalLM"
GLU_LINEAR_OFFSET = 1.0
"""gpt-oss adds 1 to the up half: (up + 1) * glu."""
SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULTS = dict(num_hidden_layers=36, num_local_experts=128, vocab_size=201088, hidden_size=2880,
                intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8, sliding_window=128,
                tie_word_embeddings=False, initializer_range=0.02, max_position_embeddings=131072, rms_norm_eps=1e-5,
                num_experts_per_tok=4, swiglu_alpha=QUICK_GELU_ALPHA, swiglu_limit=7.0, router_aux_loss_coef=0.001,
                attention_bias=True, attention_dropout=0.0, rope_theta=150000.0)
"""GptOssConfig's defaults (gpt-oss-120b's shape), what transformers builds when config.json leaves a field out."""
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
"""GptOssConfig's rope_parameters without rope_scaling or rope_parameters in config.json (rope_theta beside it)."""


def check_gpt_oss(m: ModelConfig) -> None:
    """GptOssForCausalLM holds our model only with its block, sinks, experts and router; say the first thing missing."""
    pattern = moe_layer_pattern(m)
    window = m.window_size
    refuse_first(ARCHITECTURE, [
        (m.multi_latent_attention, "has grouped-query attention", "with --multi-latent-attention",
         "DeepseekV3ForCausalLM holds it"),
        (m.normalization != "RMSNorm", "normalises with RMSNorm", f"with --normalization {m.normalization}",
         "use --normalization RMSNorm"),
        (not m.add_bias_linear, "has biases on every linear (attention_bias: q, k, v and o; the experts' and the "
         "router's)", "with --disable-bias-linear", "drop it"),
        (m.softmax_type != "learnable", "has a learned attention sink per head (sinks)",
         f"with --softmax-type {m.softmax_type}", "use --softmax-type learnable"),
        (not m.quick_geglu or m.swiglu, "gates its experts with quick-GeLU (swiglu_alpha 1.702)",
         "with --swiglu" if m.swiglu else "without --quick-geglu", "use --quick-geglu"),
        (m.glu_linear_offset != GLU_LINEAR_OFFSET, "adds 1 to the experts' up half",
         f"with --glu-linear-offset {m.glu_linear_offset:g}", "use --glu-linear-offset 1"),
        (m.activation_func_clamp_value is None, "clamps the experts' halves (swiglu_limit)",
         "without --activation-func-clamp-value", "give it (gpt-oss: 7)"),
        (m.qk_layernorm, "has no QK-norm", "with --qk-layernorm", "drop it"),
        (m.position_embedding_type != "rope", "has rotary positions",
         f"with --position-embedding-type {m.position_embedding_type}", "use yarn or rope"),
        (m.rotary_percent != 1.0, "turns whole heads", f"with --rotary-percent {m.rotary_percent:g}", "drop it"),
        (window is not None and window[1] != 0, "attends to no key after the query",
         f"with --window-size {window and ','.join(map(str, window))}", "use --window-size W,0"),
        (m.num_experts is None, "has experts in every layer", "without --num-experts", "add --num-experts"),
        (not all(pattern), "has experts in every layer", f"with --moe-layer-freq {m.moe_layer_freq}",
         "use --moe-layer-freq 1"),
        (bool(m.moe_shared_expert_intermediate_size), "has no shared expert",
         "with --moe-shared-expert-intermediate-size", "drop it"),
        (m.moe_router_pre_softmax, "takes the softmax over the top-k logits",
         "with --moe-router-pre-softmax", "drop it (our default router is gpt-oss's)")])
    hf_moe.check_router(m, ARCHITECTURE)


def layer_types(m: ModelConfig) -> List[str]:
    return [FULL if layer_window(m, i + 1) is None else SLIDING for i in range(m.num_layers)]


def rope_scaling(m: ModelConfig) -> dict:
    """config.json's rope_scaling: Llama's (hf_llama.rope_scaling), YaRN's mscales only where they are not the
    defaults gpt-oss leaves out; plain RoPE said as "default" (left out, GptOssConfig would take YaRN)."""
    scaling = hf_llama.rope_scaling(m) or {"rope_type": "default"}
    if scaling["rope_type"] == "yarn":
        for key, default in (("mscale", 1.0), ("mscale_all_dim", 0.0)):
            if scaling[key] == default:
                del scaling[key]
    return scaling


def hf_config(m: ModelConfig) -> dict:
    """config.json of the GptOssForCausalLM that holds our model, in the keys of gpt-oss's own config.json
    (rope_theta with rope_scaling, which transformers 4.55 and 5 both read); bos/eos ids left to the tokenizer."""
    check_gpt_oss(m)
    window = m.window_size
    return {
        "architectures": [ARCHITECTURE], "model_type": "gpt_oss",
        "vocab_size": hf_llama.vocab_size(m), "hidden_size": m.hidden_size,
        "intermediate_size": expert_ffn_hidden_size(m), "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups or m.num_attention_heads, "head_dim": m.head_dim,
        "num_local_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk,
        "sliding_window": None if window is None else window[0] + 1, "layer_types": layer_types(m),
        "swiglu_alpha": QUICK_GELU_ALPHA, "swiglu_limit": float(m.activation_func_clamp_value),
        "max_position_embeddings": m.max_position_embeddings, "initializer_range": m.init_method_std,
        "rms_norm_eps": m.norm_epsilon, "rope_theta": float(m.rotary_base), "rope_scaling": rope_scaling(m),
        "attention_bias": True, "attention_dropout": m.attention_dropout, "hidden_act": "silu",
        "router_aux_loss_coef": m.moe_aux_loss_coeff, "output_router_logits": False,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None,
    }


def _windows(c: dict, where: str, layers: int) -> dict:
    """--window-size and --window-attn-skip-freq for sliding_window and layer_types (module docstring)."""
    types = c.get("layer_types")
    if types is None:  # GptOssConfig's default
        types = [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in (SLIDING, FULL) for t in types):
        raise field_error(where, "layer_types", types, f"it must list {layers} entries (num_hidden_layers), each "
                          f"{as_json(SLIDING)} or {as_json(FULL)}")
    sliding = [t == SLIDING for t in types]
    if c.get("sliding_window") is None or not any(sliding):  # transformers: no window, full attention everywhere
        return {}
    window = whole(c, "sliding_window", where, minimum=2)
    fields = {"window_size": (window - 1, 0)}
    if all(sliding):
        return fields
    every = next((n for n in range(2, layers + 1) if sliding == [(i + 1) % n != 0 for i in range(layers)]), None)
    if every is None:
        raise field_error(where, "layer_types", types, "windowed and global layers alternate here as "
                          "--window-attn-skip-freq N makes them, global every N-th layer counted from 1 (gpt-oss: "
                          "sliding, full, sliding, full, ..: N = 2)")
    return dict(fields, window_attn_skip_freq=every)


def model_fields(c: dict, where: str) -> dict:
    """Our ModelConfig fields for a GptOssForCausalLM config.json (GptOssConfig's defaults filled in); a field we
    cannot represent is refused by name. quantization_config (the release's mxfp4) is the importer's
    (checkpoint/hf_mxfp4.py)."""
    if c.get("rope_parameters") is None and c.get("rope_scaling") is None:
        c = dict(c, rope_scaling=DEFAULT_ROPE)
    c = {**DEFAULTS, **{k: v for k, v in c.items() if v is not None or k == "sliding_window"}}
    if c.get("attention_bias") is not True:
        raise field_error(where, "attention_bias", c["attention_bias"], "gpt-oss's linears all have biases here "
                          "(the experts' and the router's too: no --disable-bias-linear); set it to true")
    alpha = real(c, "swiglu_alpha", where, above=0)
    if alpha != QUICK_GELU_ALPHA:
        raise field_error(where, "swiglu_alpha", alpha, f"--quick-geglu gates with sigmoid({QUICK_GELU_ALPHA} x); "
                          f"set it to {QUICK_GELU_ALPHA}")
    limit = real(c, "swiglu_limit", where, above=0, maximum=1e6)
    # Llama's fields without the ones gpt-oss reads otherwise (no attention_bias refusal); head_dim as given, or
    # GptOssConfig's 64 whatever hidden / heads.
    llama = {k: v for k, v in c.items() if k not in ("attention_bias", "mlp_bias", "hidden_act", "layer_types")}
    fields = hf_llama.model_fields(llama, where)
    experts = hf_moe.expert_count(c, where, ("num_local_experts", "num_experts"))
    fields.update(
        swiglu=False, quick_geglu=True, glu_linear_offset=GLU_LINEAR_OFFSET, activation_func_clamp_value=limit,
        add_bias_linear=True, softmax_type="learnable",
        **hf_moe.router_fields(c, where, experts), moe_ffn_hidden_size=fields["ffn_hidden_size"], moe_layer_freq="1",
        moe_router_score_function="softmax", moe_router_pre_softmax=False,
        **_windows(c, where, fields["num_layers"]))
    return fields

