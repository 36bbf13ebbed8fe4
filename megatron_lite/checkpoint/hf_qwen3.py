"""Our Llama-family GPT with --qk-layernorm <-> Hugging Face `Qwen3ForCausalLM`: Llama's mapping
(checkpoint/hf_llama.py) plus each layer's QK-norm, and Qwen3's config.

    attention.q_layernorm.weight         [hd]             -> model.layers.i.self_attn.q_norm.weight
    attention.k_layernorm.weight         [hd]             -> model.layers.i.self_attn.k_norm.weight

Qwen3 normalises every query and key head (RMSNorm over head_dim, one weight shared by the heads) after
the q/k projections and before RoPE, as --qk-layernorm does with --normalization RMSNorm; the other
weights, grouped-query attention, RoPE and the head (tied or not) are Llama's. Its head_dim is free
(--kv-channels), and 128 when config.json leaves it out (Qwen3Config's default, not hidden / heads).
Qwen3 has no biases (attention_bias false). Sliding-window layers (use_sliding_window, layer_types with
"sliding_attention") are refused: attention here is full causal.
"""
from __future__ import annotations

from typing import List

from megatron_lite.checkpoint import hf_llama, hf_mapping
from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_fields import as_json, refusal, whole
from megatron_lite.checkpoint.hf_mapping import Mapped, StateDict
from megatron_lite.config import ModelConfig

ARCHITECTURES = ("Qwen3ForCausalLM",)
FLAGS = hf_llama.FLAGS + ", --qk-layernorm"
DEFAULT_HEAD_DIM = 128
"""Qwen3Config's head_dim when config.json does not give one."""
SLIDING_WINDOW_SWITCH = True
"""sliding_window applies only under use_sliding_window (absent: off), as Qwen3Config reads them."""

hf_name, is_derived = hf_llama.hf_name, hf_llama.is_derived


def check_qwen3(m: ModelConfig) -> None:
    """Qwen3ForCausalLM holds the Llama-family block with QK-norm; say what is missing."""
    hf_llama.check_llama(m, "Qwen3ForCausalLM")
    if not m.qk_layernorm:
        raise CheckpointError("Qwen3ForCausalLM normalises query and key heads, but this model was built without "
                              "--qk-layernorm (it exports as LlamaForCausalLM)")


def mapping(m: ModelConfig) -> List[Mapped]:
    """Llama's table with each layer's q_norm and k_norm after its q/k/v projection (model order)."""
    check_qwen3(m)
    return with_qk_norms(hf_llama.table(m), m)


def with_qk_norms(table: List[Mapped], m: ModelConfig) -> List[Mapped]:
    """A Llama-shaped table with each layer's q_norm and k_norm after its q/k/v projection (GLM-4.5's use_qk_norm
    too: checkpoint/hf_glm4_moe.py)."""
    hd, out = m.head_dim, []
    for entry in table:
        out.append(entry)
        if entry.ours.endswith(".attention.query_key_value.weight"):
            ours = entry.ours[:-len("query_key_value.weight")]
            theirs = entry.theirs[0][:-len("q_proj.weight")]
            out += [Mapped(ours + "q_layernorm.weight", (hd,), (theirs + "q_norm.weight",), (hd,)),
                    Mapped(ours + "k_layernorm.weight", (hd,), (theirs + "k_norm.weight",), (hd,))]
    return out


def to_hf(dense: StateDict, m: ModelConfig) -> StateDict:
    """Our dense (TP = PP = 1) state dict -> Qwen3ForCausalLM's."""
    return hf_mapping.to_hf(dense, mapping(m), FLAGS)


def from_hf(hf: StateDict, m: ModelConfig) -> StateDict:
    """Qwen3ForCausalLM's state dict -> our dense one (a tied head as hf_llama.from_hf takes it)."""
    return hf_mapping.from_hf(hf_llama.weights_of(hf, m), mapping(m), FLAGS)


def hf_config(m: ModelConfig) -> dict:
    """config.json of the Qwen3ForCausalLM that holds our model: Llama's keys Qwen3 shares, its window switched
    off (bos/eos ids left to the tokenizer, as for Llama)."""
    check_qwen3(m)
    config = {k: v for k, v in hf_llama.hf_config(m).items() if k not in ("pretraining_tp", "mlp_bias")}
    return dict(config, architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=False,
                sliding_window=None, max_window_layers=m.num_layers)


def model_fields(c: dict, where: str) -> dict:
    """Our ModelConfig fields for a Qwen3ForCausalLM config.json; a field we cannot represent is refused by name."""
    if c.get("use_sliding_window"):
        raise refusal(where, "use_sliding_window", c["use_sliding_window"], "is not supported: attention here is full "
                      "causal; set it to false")
    windowed = [t for t in c.get("layer_types") or [] if t != "full_attention"]
    if windowed:
        raise CheckpointError(f"{where}: layer_types has {as_json(windowed[0])} layers, which are not supported: "
                              f"attention here is full causal (every layer \"full_attention\")")
    head_dim = whole(c, "head_dim", where, DEFAULT_HEAD_DIM)
    return dict(hf_llama.model_fields(dict(c, head_dim=head_dim), where), qk_layernorm=True)
