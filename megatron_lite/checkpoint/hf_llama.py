"""Our dense Llama-family GPT <-> Hugging Face `LlamaForCausalLM`: the parameter mapping and the config.

With --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope our GPT is
Llama's architecture (grouped-query attention and Llama 3.1 RoPE scaling optional), and every weight
maps one-to-one, or one-to-several where we fuse what Llama keeps apart (layer i is our module 1+i):

    layers.0.word_embeddings             [Vp, h]          -> model.embed_tokens [V, h]
    input_layernorm / post_attention_layernorm            -> model.layers.i.input_layernorm / ...
    attention.query_key_value            [(a + 2g) hd, h] -> self_attn.q_proj [a hd, h]; k_proj, v_proj [g hd, h]
    attention.dense                      [h, h]           -> self_attn.o_proj
    mlp.dense_h_to_4h                    [2 ffn, h]       -> mlp.gate_proj [ffn, h]; mlp.up_proj [ffn, h]
    mlp.dense_4h_to_h                    [h, ffn]         -> mlp.down_proj
    layers.{L+1} (final RMSNorm)                          -> model.norm
    layers.{L+2}.output (untied head)    [Vp, h]          -> lm_head [V, h]   (absent when tied)

Both sides store linear weights as [out, in] and order query heads alike: query head j uses key/value
group j // (a/g) (transformers' repeat_kv), and both rotate halves of each head (not interleaved pairs),
so nothing is permuted. The Vp - V rows that pad the vocabulary for TP are dropped on the way out and
come back as zeros. Only weights are mapped: dtypes are kept, and tokenizer ids are the caller's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.config import ModelConfig
from megatron_lite.model.transformer import (
    LLAMA3_HIGH_FREQ_FACTOR,
    LLAMA3_LOW_FREQ_FACTOR,
    LLAMA3_ORIGINAL_MAX_POSITIONS,
)

StateDict = Dict[str, torch.Tensor]

# Derived from rope_theta, not weights; older Llama checkpoints (pytorch_model.bin) still carry them.
DERIVED_SUFFIX = "rotary_emb.inv_freq"


@dataclass(frozen=True)
class Mapped:
    """One of our dense parameters and the Hugging Face tensors it holds, stacked along dim 0 in order."""

    ours: str
    shape: Tuple[int, ...]
    """Our tensor's shape."""
    theirs: Tuple[str, ...]
    rows: Tuple[int, ...]
    """dim 0 of each of theirs (the other dims are ours); rows of ours past their sum are vocabulary padding."""

    def their_shape(self, index: int) -> Tuple[int, ...]:
        return (self.rows[index],) + self.shape[1:]


def vocab_size(m: ModelConfig) -> int:
    """The tokenizer's vocabulary: the rows Hugging Face holds (ours has padded_vocab_size)."""
    return m.vocab_size or m.padded_vocab_size


def check_llama(m: ModelConfig) -> None:
    """LlamaForCausalLM holds our model only with the Llama-family block; say which flags are missing."""
    missing = [flag for flag, ok in (("--swiglu", m.swiglu),
                                     ("--normalization RMSNorm", m.normalization == "RMSNorm"),
                                     ("--disable-bias-linear", not m.add_bias_linear),
                                     ("--position-embedding-type rope", m.position_embedding_type == "rope"))
               if not ok]
    if missing:
        raise CheckpointError(f"LlamaForCausalLM needs the Llama-family block; this model was built without "
                              f"{', '.join(missing)} (GPT-2-shaped models export as GPT2LMHeadModel instead)")
    if m.padded_vocab_size is None:
        raise CheckpointError("the model config has no vocabulary size; give --vocab-size N or a --tokenizer-model")


def mapping(m: ModelConfig) -> List[Mapped]:
    """Every dense parameter of our Llama-shaped GPT with the Hugging Face tensors it holds, in model order."""
    check_llama(m)
    h, a, layers = m.hidden_size, m.num_attention_heads, m.num_layers
    g, hd, ffn = m.num_query_groups or a, h // a, m.ffn_hidden_size
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


def _some(names: List[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _check_names(have, want, what: str) -> None:
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        problems = [f"lacks {_some(missing)}"] if missing else []
        problems += [f"has unexpected {_some(extra)}"] if extra else []
        raise CheckpointError(f"{what} {' and '.join(problems)}: it is not the Llama model the config describes "
                              f"(--num-layers, --untie-embeddings-and-output-weights)")


def _check_shape(name: str, tensor: torch.Tensor, shape: Tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise CheckpointError(f"{name} is {list(tensor.shape)}, the config needs {list(shape)}: the model flags "
                              f"(--hidden-size, --num-attention-heads, --num-query-groups, --ffn-hidden-size, "
                              f"--vocab-size) must describe the same model")


def to_hf(dense: StateDict, m: ModelConfig) -> StateDict:
    """Our dense (TP = PP = 1) state dict -> LlamaForCausalLM's: fused weights split, vocabulary padding dropped.

    A split weight's pieces are copies (safetensors refuses tensors that share memory); the rest are views."""
    table = mapping(m)
    _check_names(dense, [e.ours for e in table], "the dense state dict")
    out = {}
    for e in table:
        tensor = dense[e.ours]
        _check_shape(e.ours, tensor, e.shape)
        pieces = tensor[:sum(e.rows)].split(e.rows)
        for name, piece in zip(e.theirs, pieces):
            out[name] = piece.clone() if len(pieces) > 1 else piece
    return out


def from_hf(hf: StateDict, m: ModelConfig) -> StateDict:
    """LlamaForCausalLM's state dict -> our dense one: q/k/v and gate/up fused, the vocabulary padded with zeros
    to padded_vocab_size. A tied model's lm_head.weight (in state_dict(), not in save_pretrained's files) must
    be the embedding itself."""
    table = mapping(m)
    hf = {k: t for k, t in hf.items() if not k.endswith(DERIVED_SUFFIX)}
    if not m.untie_embeddings_and_output_weights and "lm_head.weight" in hf:
        head = hf.pop("lm_head.weight")
        embedding = hf.get("model.embed_tokens.weight")
        if embedding is None or not (head is embedding or torch.equal(head, embedding)):
            raise CheckpointError("the Hugging Face model has its own lm_head.weight but the config ties the output "
                                  "head to the embedding; add --untie-embeddings-and-output-weights")
    _check_names(hf, [n for e in table for n in e.theirs], "the Hugging Face state dict")
    out = {}
    for e in table:
        pieces = []
        for index, name in enumerate(e.theirs):
            _check_shape(name, hf[name], e.their_shape(index))
            pieces.append(hf[name])
        padding = e.shape[0] - sum(e.rows)
        if padding:
            pieces.append(pieces[0].new_zeros((padding,) + e.shape[1:]))
        out[e.ours] = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return out


def rope_scaling(m: ModelConfig) -> Optional[dict]:
    """transformers' rope_scaling for Llama 3.1's frequency scaling (None without --use-rope-scaling)."""
    if not m.use_rope_scaling:
        return None
    return {"rope_type": "llama3", "factor": float(m.rope_scaling_factor),
            "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR, "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": LLAMA3_ORIGINAL_MAX_POSITIONS}


def hf_config(m: ModelConfig) -> dict:
    """config.json of the LlamaForCausalLM that holds our model (the keys Llama 3.1's own config.json uses,
    which transformers 4.x and 5.x both read). bos/eos token ids are left None: the tokenizer's, not the model's."""
    check_llama(m)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size(m), "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups or m.num_attention_heads,
        "head_dim": m.hidden_size // m.num_attention_heads, "hidden_act": "silu",
        "max_position_embeddings": m.max_position_embeddings, "initializer_range": m.init_method_std,
        "rms_norm_eps": m.norm_epsilon, "rope_theta": float(m.rotary_base), "rope_scaling": rope_scaling(m),
        "attention_bias": False, "attention_dropout": m.attention_dropout, "mlp_bias": False,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "pretraining_tp": 1, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None,
    }
