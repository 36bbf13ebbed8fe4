"""Our dense Llama-family GPT <-> Hugging Face `LlamaForCausalLM`: the parameter mapping and the config.

With --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope our GPT is
Llama's architecture (grouped-query attention and Llama 3.1 RoPE scaling optional), and every weight
maps one-to-one, or one-to-several where we fuse what Llama keeps apart (layer i is our module 1+i):

    layers.0.word_embeddings             [Vp, h]          -> model.embed_tokens [V, h]
    input_layernorm / post_attention_layernorm            -> model.layers.i.input_layernorm / ...
    attention.query_key_value            [(a + 2g) hd, h] -> self_attn.q_proj [a hd, h]; k_proj, v_proj [g hd, h]
    attention.dense                      [h, a hd]        -> self_attn.o_proj
    mlp.dense_h_to_4h                    [2 ffn, h]       -> mlp.gate_proj [ffn, h]; mlp.up_proj [ffn, h]
    mlp.dense_4h_to_h                    [h, ffn]         -> mlp.down_proj
    layers.{L+1} (final RMSNorm)                          -> model.norm
    layers.{L+2}.output (untied head)    [Vp, h]          -> lm_head [V, h]   (absent when tied)

Both sides store linear weights as [out, in] and order query heads alike: query head j uses key/value
group j // (a/g) (transformers' repeat_kv), and both rotate halves of each head (not interleaved pairs),
so nothing is permuted. The head width hd is config.json's head_dim (--kv-channels when it is not
hidden / heads). The Vp - V rows that pad the vocabulary for TP are dropped on the way out and
come back as zeros. Only weights are mapped: dtypes are kept, and tokenizer ids are the caller's.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from megatron_lite.checkpoint import hf_mapping
from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_fields import real, refusal, refuse_gpt_oss_parts, whole
from megatron_lite.checkpoint.hf_mapping import Mapped, StateDict
from megatron_lite.config import ModelConfig
from megatron_lite.model.rotary import (
    LLAMA3_HIGH_FREQ_FACTOR,
    LLAMA3_LOW_FREQ_FACTOR,
    LLAMA3_ORIGINAL_MAX_POSITIONS,
    yarn_attention_factor,
    yarn_original_context,
)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
# Derived from rope_theta, not weights; older Llama checkpoints (pytorch_model.bin) still carry them.
DERIVED_SUFFIX = "rotary_emb.inv_freq"
FLAGS = "--num-layers, --hidden-size, --num-attention-heads, --num-query-groups, --kv-channels, --ffn-hidden-size, " \
        "--vocab-size, --untie-embeddings-and-output-weights"


def vocab_size(m: ModelConfig) -> int:
    """The tokenizer's vocabulary: the rows Hugging Face holds (ours has padded_vocab_size)."""
    return m.vocab_size or m.padded_vocab_size


def check_llama(m: ModelConfig, architecture: str = "LlamaForCausalLM", qkv_bias: bool = False,
                partial_rotary: bool = False) -> None:
    """`architecture` (Llama's, or one built on it) holds our model only with the Llama-family block; say which
    flags are missing. `qkv_bias`: the architecture has q/k/v biases alone (Qwen2-MoE's qkv_bias, GLM-4.5's
    attention_bias); `partial_rotary`: it turns part of each head (GLM-4.5's partial_rotary_factor)."""
    missing = [flag for flag, ok in (("--swiglu", m.swiglu),
                                     ("--normalization RMSNorm", m.normalization == "RMSNorm"),
                                     ("--disable-bias-linear", not m.add_bias_linear),
                                     ("--position-embedding-type rope", m.position_embedding_type == "rope"),
                                     ("--rotary-percent 1 (RoPE over whole heads)",
                                      partial_rotary or m.rotary_percent == 1.0))
               if not ok]
    refuse_gpt_oss_parts(m, architecture)
    if missing:
        raise CheckpointError(f"{architecture} needs the Llama-family block; this model was built without "
                              f"{', '.join(missing)} (GPT-2-shaped models export as GPT2LMHeadModel instead)")
    if m.add_qkv_bias and not qkv_bias:
        raise CheckpointError(f"{architecture} has no bias on q_proj, k_proj and v_proj alone (its attention_bias "
                              f"adds one to o_proj too), but this model was built with --add-qkv-bias: Qwen2's "
                              f"attention, which only Qwen2MoeForCausalLM and Glm4MoeForCausalLM (models with "
                              f"experts) map here")
    if m.padded_vocab_size is None:
        raise CheckpointError("the model config has no vocabulary size; give --vocab-size N or a --tokenizer-model")
    if m.window_size is not None and m.window_attn_skip_freq is not None:
        raise CheckpointError(f"--window-attn-skip-freq {m.window_attn_skip_freq}: neither LlamaForCausalLM nor "
                              f"MistralForCausalLM has layers that alternate windowed and global attention (Mistral "
                              f"windows every layer); this model has no Hugging Face architecture here")


def _architecture(m: ModelConfig) -> dict:
    """Llama, or Mistral when every layer attends through a window (sliding_window = L + 1: transformers
    counts the token itself)."""
    if m.window_size is None:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": m.window_size[0] + 1}


def mapping(m: ModelConfig) -> List[Mapped]:
    """Every dense parameter of our Llama-shaped GPT with the Hugging Face tensors it holds, in model order."""
    check_llama(m)
    if m.qk_layernorm:
        raise CheckpointError("LlamaForCausalLM has no QK-norm, but this model was built with --qk-layernorm; "
                              "Qwen3ForCausalLM holds it")
    return table(m)


def table(m: ModelConfig) -> List[Mapped]:
    """The Llama table, unchecked (checkpoint/hf_qwen3.py adds Qwen3's QK-norm to it)."""
    h, a, layers = m.hidden_size, m.num_attention_heads, m.num_layers
    g, hd, ffn = m.num_query_groups or a, m.head_dim, m.ffn_hidden_size
    vp, v = m.padded_vocab_size, vocab_size(m)
    table = [Mapped("layers.0.word_embeddings.weight", (vp, h), ("model.embed_tokens.weight",), (v,))]
    for i in range(layers):
        ours, theirs = f"layers.{i + 1}.", f"model.layers.{i}."
        table += [
            Mapped(ours + "input_layernorm.weight", (h,), (theirs + "input_layernorm.weight",), (h,)),
            Mapped(ours + "attention.query_key_value.weight", ((a + 2 * g) * hd, h),
                   tuple(theirs + f"self_attn.{p}_proj.weight" for p in "qkv"), (a * hd, g * hd, g * hd)),
            Mapped(ours + "attention.dense.weight", (h, a * hd), (theirs + "self_attn.o_proj.weight",), (h,)),
            Mapped(ours + "post_attention_layernorm.weight", (h,), (theirs + "post_attention_layernorm.weight",), (h,)),
            Mapped(ours + "mlp.dense_h_to_4h.weight", (2 * ffn, h),
                   (theirs + "mlp.gate_proj.weight", theirs + "mlp.up_proj.weight"), (ffn, ffn)),
            Mapped(ours + "mlp.dense_4h_to_h.weight", (h, ffn), (theirs + "mlp.down_proj.weight",), (h,)),
        ]
    table.append(Mapped(f"layers.{layers + 1}.weight", (h,), ("model.norm.weight",), (h,)))
    if m.untie_embeddings_and_output_weights:
        table.append(Mapped(f"layers.{layers + 2}.output.weight", (vp, h), ("lm_head.weight",), (v,)))
    return table


def with_qkv_biases(table: List[Mapped]) -> List[Mapped]:
    """The table with each layer's fused QKV bias (--add-qkv-bias) after its weight, cut into q_proj, k_proj and
    v_proj biases as the weight's rows are (Qwen2's attention: checkpoint/hf_qwen2_moe.py)."""
    out = []
    for entry in table:
        out.append(entry)
        if entry.ours.endswith(".attention.query_key_value.weight"):
            out.append(Mapped(entry.ours[:-len("weight")] + "bias", entry.shape[:1],
                              tuple(name[:-len("weight")] + "bias" for name in entry.theirs), entry.rows))
    return out


def hf_name(name: str) -> str:
    return name


def is_derived(name: str) -> bool:
    return name.endswith(DERIVED_SUFFIX)


def to_hf(dense: StateDict, m: ModelConfig) -> StateDict:
    """Our dense (TP = PP = 1) state dict -> LlamaForCausalLM's: fused weights split, vocabulary padding dropped."""
    return hf_mapping.to_hf(dense, mapping(m), FLAGS)


def from_hf(hf: StateDict, m: ModelConfig) -> StateDict:
    """LlamaForCausalLM's state dict -> our dense one: q/k/v and gate/up fused, the vocabulary padded with zeros
    to padded_vocab_size. A tied model's lm_head.weight (in state_dict(), not in save_pretrained's files) must
    be the embedding itself."""
    return hf_mapping.from_hf(weights_of(hf, m), mapping(m), FLAGS)


def weights_of(hf: StateDict, m: ModelConfig) -> StateDict:
    """The tensors a table maps: derived buffers dropped, and a tied model's lm_head.weight, which must be
    the embedding."""
    hf = {k: t for k, t in hf.items() if not is_derived(k)}
    if not m.untie_embeddings_and_output_weights and "lm_head.weight" in hf:
        head = hf.pop("lm_head.weight")
        embedding = hf.get("model.embed_tokens.weight")
        if embedding is None or not (head is embedding or torch.equal(head, embedding)):
            raise CheckpointError("the Hugging Face model has its own lm_head.weight but the config ties the output "
                                  "head to the embedding; add --untie-embeddings-and-output-weights")
    return hf


def rope_scaling(m: ModelConfig) -> Optional[dict]:
    """transformers' rope_scaling for Llama 3.1's frequency scaling or YaRN's (None for plain RoPE)."""
    if m.rope_type == "yarn":
        return {"rope_type": "yarn", "factor": float(m.rotary_scaling_factor),
                "original_max_position_embeddings": yarn_original_context(m),
                "beta_fast": float(m.yarn_beta_fast), "beta_slow": float(m.yarn_beta_slow),
                "mscale": float(m.mscale), "mscale_all_dim": float(m.mscale_all_dim),
                "truncate": bool(m.yarn_correction_range_round_to_int)}
    if not m.use_rope_scaling:
        return None
    return {"rope_type": "llama3", "factor": float(m.rope_scaling_factor),
            "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR, "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POSITIONS}


def hf_config(m: ModelConfig, qkv_bias: bool = False, partial_rotary: bool = False) -> dict:
    """config.json of the LlamaForCausalLM that holds our model (the keys Llama 3.1's own config.json uses,
    which transformers 4.x and 5.x both read). bos/eos token ids are left None: the tokenizer's, not the model's.
    `qkv_bias`, `partial_rotary`: as check_llama's, for the architectures built on these keys."""
    check_llama(m, qkv_bias=qkv_bias, partial_rotary=partial_rotary)
    return {
        **_architecture(m),
        "vocab_size": vocab_size(m), "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups or m.num_attention_heads,
        "head_dim": m.head_dim, "hidden_act": "silu",
        "max_position_embeddings": m.max_position_embeddings, "initializer_range": m.init_method_std,
        "rms_norm_eps": m.norm_epsilon, "rope_theta": float(m.rotary_base), "rope_scaling": rope_scaling(m),
        "attention_bias": False, "attention_dropout": m.attention_dropout, "mlp_bias": False,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "pretraining_tp": 1, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None,
    }


def _rope(c: dict, where: str) -> dict:
    """Our rope fields from transformers' rope keys: `rope_parameters` (transformers 5) or `rope_theta` with
    `rope_scaling` (the keys Llama 3.1's own config.json and transformers 4 use)."""
    parameters = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or parameters
    theta = real(parameters if "rope_theta" in parameters else c, "rope_theta", where, 10000.0, above=0)
    if not theta.is_integer():
        raise refusal(where, "rope_theta", theta, "is not a whole number, which --rotary-base needs")
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return {"rotary_base": int(theta), "use_rope_scaling": False}
    if kind == "yarn":
        return {"rotary_base": int(theta), "use_rope_scaling": False, **_yarn(c, scaling, where)}
    if kind != "llama3":
        raise refusal(where, "rope_scaling.rope_type", kind, "is not supported: only the default rotary "
                      "frequencies, Llama 3.1's (llama3) and YaRN's (yarn) are")
    for key, ours in (("low_freq_factor", LLAMA3_LOW_FREQ_FACTOR), ("high_freq_factor", LLAMA3_HIGH_FREQ_FACTOR),
                      ("original_max_position_embeddings", LLAMA3_ORIGINAL_MAX_POSITIONS)):
        if real(scaling, key, where, ours) != float(ours):
            raise refusal(where, f"rope_scaling.{key}", scaling[key], f"is not supported: --use-rope-scaling "
                          f"has Llama 3.1's {ours}")
    return {"rotary_base": int(theta), "use_rope_scaling": True,
            "rope_scaling_factor": real(scaling, "factor", where, minimum=1)}


def _yarn(c: dict, scaling: dict, where: str) -> dict:
    """Our YaRN fields from transformers' yarn rope parameters (`_compute_yarn_parameters`' reading of them)."""
    original = whole(scaling, "original_max_position_embeddings", where)
    factor = (real(scaling, "factor", where, minimum=1) if scaling.get("factor") is not None
              else whole(c, "max_position_embeddings", where) / original)  # transformers' rule without a factor
    fields = {"rope_type": "yarn", "rotary_scaling_factor": factor, "yarn_original_max_position_embeddings": original,
              "yarn_beta_fast": real(scaling, "beta_fast", where, 32.0, above=0),
              "yarn_beta_slow": real(scaling, "beta_slow", where, 1.0, above=0),
              "yarn_correction_range_round_to_int": bool(scaling.get("truncate", True)),
              "mscale": real(scaling, "mscale", where, 1.0, minimum=0) if scaling.get("mscale") else 1.0,
              "mscale_all_dim": real(scaling, "mscale_all_dim", where, 0.0, minimum=0)
              if scaling.get("mscale_all_dim") else 0.0}
    given = scaling.get("attention_factor")
    derived = yarn_attention_factor(factor, fields["mscale"], fields["mscale_all_dim"])
    if given is not None and abs(float(given) - derived) > 1e-12 * derived:
        raise refusal(where, "rope_scaling.attention_factor", given, f"is not supported: YaRN's factor here is "
                      f"derived from factor, mscale and mscale_all_dim ({derived:g})")
    return fields


def model_fields(c: dict, where: str) -> dict:
    """Our ModelConfig fields for a LlamaForCausalLM / MistralForCausalLM config.json; a field we cannot
    represent is refused by name. Mistral's sliding window is the caller's (checkpoint/hf_import.py)."""
    heads, hidden = whole(c, "num_attention_heads", where), whole(c, "hidden_size", where)
    groups = whole(c, "num_key_value_heads", where, heads)
    head_dim = whole(c, "head_dim", where) if c.get("head_dim") is not None else None
    # A head width other than hidden / heads is --kv-channels; the same one is left implied.
    kv_channels = head_dim if head_dim is not None and (hidden % heads or head_dim != hidden // heads) else None
    if c.get("hidden_act", "silu") != "silu":
        raise refusal(where, "hidden_act", c.get("hidden_act"), "is not supported: --swiglu gates with silu")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise refusal(where, key, c[key], "is not supported: the Llama-family block here has no biases "
                          "(--disable-bias-linear)")
    if real(c, "partial_rotary_factor", where, 1.0) != 1.0:
        raise refusal(where, "partial_rotary_factor", c["partial_rotary_factor"], "is not supported: rotary "
                      "embeddings cover the whole head here")
    fields = dict(
        num_layers=whole(c, "num_hidden_layers", where), hidden_size=hidden, num_attention_heads=heads,
        kv_channels=kv_channels, ffn_hidden_size=whole(c, "intermediate_size", where),
        max_position_embeddings=whole(c, "max_position_embeddings", where), vocab_size=whole(c, "vocab_size", where),
        norm_epsilon=real(c, "rms_norm_eps", where, 1e-6, above=0), normalization="RMSNorm",
        swiglu=True, group_query_attention=groups != heads, num_query_groups=groups if groups != heads else None,
        add_bias_linear=False, position_embedding_type="rope",
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
        init_method_std=real(c, "initializer_range", where, 0.02, above=0), hidden_dropout=0.0,
        attention_dropout=real(c, "attention_dropout", where, 0.0, minimum=0, below=1))
    fields.update(_rope(c, where))
    return fields
