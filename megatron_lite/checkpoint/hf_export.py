"""Export to a Hugging Face folder (config.json, model.safetensors, tokenizer.model): a `GPT2LMHeadModel`
for GPT-2's block, a `LlamaForCausalLM` for the Llama-family block (its mapping: checkpoint/hf_llama.py).

Our GPT is GPT-2's architecture: learned absolute positions, pre-LayerNorm
blocks, exact (erf) GeLU, a head tied to the word embedding, biases
everywhere. The mapping is one-to-one once the TP shards are merged:

    word_embeddings / position_embeddings      -> transformer.wte / transformer.wpe
    input_layernorm / post_attention_layernorm -> h.i.ln_1 / h.i.ln_2
    attention.query_key_value  [3h, h]         -> h.i.attn.c_attn  (Conv1D: weight [h, 3h])
    attention.dense            [h, h]          -> h.i.attn.c_proj
    mlp.dense_h_to_4h / mlp.dense_4h_to_h      -> h.i.mlp.c_fc / h.i.mlp.c_proj
    final LayerNorm                            -> transformer.ln_f

GPT-2's Conv1D computes x W + b, so every linear weight is transposed. The
fused QKV is stored per TP rank as [Q_r; K_r; V_r] (whole heads, stride 3);
merging puts it back to [Q; K; V] with heads contiguous inside each, which is
exactly how GPT-2 splits c_attn's output into q, k, v and then into heads.
The padded vocabulary rows are dropped (vocab_size = the tokenizer's).

Not representable as GPT-2, refused with the reason: rotary position embeddings
(GPT-2 has learned positions only; exporting them as GPT-NeoX is not
implemented) and an untied output head (GPT2LMHeadModel ties it).
Only `safetensors` is needed to write the folder; `transformers` to read it.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Optional

import torch

from megatron_lite.checkpoint import hf_llama
from megatron_lite.checkpoint.merge import dense_state_dict
from megatron_lite.checkpoint.reader import CheckpointReader
from megatron_lite.config import Config
from megatron_lite.atomic import WriteError, atomic_folder, describe
from megatron_lite.checkpoint.format import CheckpointError


def llama_block_flags(config: Config):
    """The Llama-family flags a model was built with (none: GPT-2's block)."""
    m = config.model
    return [flag for flag, on in (("--swiglu", m.swiglu), ("--normalization RMSNorm", m.normalization == "RMSNorm"),
                                  ("--group-query-attention", m.num_query_groups not in (None, m.num_attention_heads)),
                                  ("--disable-bias-linear", not m.add_bias_linear)) if on]


def check_representable(config: Config) -> None:
    """Refuse, with the reason, a GPT-2-block model GPT2LMHeadModel cannot hold."""
    m = config.model
    if m.position_embedding_type != "learned_absolute":
        raise CheckpointError(f"export-hf: the model uses --position-embedding-type {m.position_embedding_type} "
                              f"(rotary); GPT2LMHeadModel has learned absolute positions only, and a GPT-NeoX "
                              f"export is not implemented. Only learned_absolute models can be exported")
    if m.untie_embeddings_and_output_weights:
        raise CheckpointError("export-hf: the model was trained with --untie-embeddings-and-output-weights; "
                              "GPT2LMHeadModel ties its output head to the word embedding, so it cannot hold a "
                              "separate head")


def gpt2_config(config: Config, vocab_size: int, eos_id: Optional[int], bos_id: Optional[int]) -> dict:
    m = config.model
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": vocab_size, "n_positions": m.max_position_embeddings, "n_embd": m.hidden_size,
        "n_layer": m.num_layers, "n_head": m.num_attention_heads, "n_inner": m.ffn_hidden_size,
        "activation_function": "gelu", "layer_norm_epsilon": m.norm_epsilon,
        "resid_pdrop": m.hidden_dropout, "embd_pdrop": m.hidden_dropout, "attn_pdrop": m.attention_dropout,
        "initializer_range": m.init_method_std, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": "float32",
    }


def gpt2_state_dict(config: Config, dense: Dict[str, torch.Tensor], vocab_size: int) -> Dict[str, torch.Tensor]:
    n = config.model.num_layers
    out = {"transformer.wte.weight": dense["layers.0.word_embeddings.weight"][:vocab_size],
           "transformer.wpe.weight": dense["layers.0.position_embeddings.weight"],
           "transformer.ln_f.weight": dense[f"layers.{n + 1}.weight"],
           "transformer.ln_f.bias": dense[f"layers.{n + 1}.bias"]}
    for i in range(n):
        ours, theirs = f"layers.{i + 1}.", f"transformer.h.{i}."
        for a, b in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")):
            out[theirs + b + ".weight"] = dense[ours + a + ".weight"]
            out[theirs + b + ".bias"] = dense[ours + a + ".bias"]
        for a, b in (("attention.query_key_value", "attn.c_attn"), ("attention.dense", "attn.c_proj"),
                     ("mlp.dense_h_to_4h", "mlp.c_fc"), ("mlp.dense_4h_to_h", "mlp.c_proj")):
            out[theirs + b + ".weight"] = dense[ours + a + ".weight"].t()  # Conv1D: [in, out]
            out[theirs + b + ".bias"] = dense[ours + a + ".bias"]
    return {k: v.float().contiguous() for k, v in out.items()}


def export_hf(load_dir: str, output: str, iteration: Optional[int] = None,
              tokenizer_model: Optional[str] = None) -> dict:
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise CheckpointError(f"--output {output} already exists and is not an empty folder; give a new folder")
    reader = CheckpointReader(load_dir, iteration)
    config = reader.config
    llama = bool(llama_block_flags(config))
    if llama:
        hf_llama.check_llama(config.model)  # a partly Llama-shaped block is refused, naming what is missing
    else:
        check_representable(config)
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError("export-hf needs the safetensors package: pip install 'megatron_lite[hf]'") from None

    tokenizer_model = tokenizer_model or config.data.tokenizer_model
    eos_id = bos_id = None
    if config.data.tokenizer_type == "SentencePieceTokenizer":
        if not tokenizer_model or not os.path.isfile(tokenizer_model):
            raise CheckpointError(f"export-hf: the SentencePiece model {tokenizer_model} the run used is not there; "
                                  f"give --tokenizer-model PATH.model")
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
        eos_id = sp.eos_id() if sp.eos_id() >= 0 else None
        bos_id = sp.bos_id() if sp.bos_id() >= 0 else None
    vocab = config.model.vocab_size or config.model.padded_vocab_size

    _, dense = dense_state_dict(reader)
    if llama:
        architecture = "LlamaForCausalLM"
        tensors = {k: v.float().contiguous() for k, v in hf_llama.to_hf(dense, config.model).items()}
        hf_config = dict(hf_llama.hf_config(config.model), bos_token_id=bos_id, eos_token_id=eos_id,
                         torch_dtype="float32")
    else:
        architecture = "GPT2LMHeadModel"
        tensors = gpt2_state_dict(config, dense, vocab)
        hf_config = gpt2_config(config, vocab, eos_id, bos_id)
    parent = os.path.dirname(os.path.abspath(output))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise WriteError(output, describe(e)) from None
    with atomic_folder(output) as tmp:
        try:
            save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        except Exception as e:  # noqa: BLE001 - safetensors reports a full disk as its own error type
            raise WriteError(os.path.join(output, "model.safetensors"), describe(e)) from None
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=1)
        files = ["config.json", "model.safetensors"]
        if config.data.tokenizer_type == "SentencePieceTokenizer":
            shutil.copy2(tokenizer_model, os.path.join(tmp, "tokenizer.model"))
            files.append("tokenizer.model")
        if os.path.isdir(output):
            os.rmdir(output)  # empty, checked above; atomic_folder renames into its place next
    return {"tag": reader.tag, "architecture": architecture, "vocab_size": vocab, "files": files,
            "parameters": sum(t.numel() for k, t in tensors.items())}
