"""Export to a Hugging Face folder (config.json, model.safetensors, the tokenizer's files): a `GPT2LMHeadModel`
for GPT-2's block (mapping: checkpoint/hf_gpt2.py), a `LlamaForCausalLM` for the Llama-family block
(checkpoint/hf_llama.py), a `Qwen3ForCausalLM` for the Llama-family block with --qk-layernorm
(checkpoint/hf_qwen3.py); with experts, a `Qwen3MoeForCausalLM` under --qk-layernorm, a `Qwen2MoeForCausalLM`
with a gated shared expert or --add-qkv-bias, else a `MixtralForCausalLM` (hf_qwen3_moe.py, hf_qwen2_moe.py,
hf_mixtral.py), each expert written under save_pretrained's per-expert names; with Multi-head Latent Attention, a
`DeepseekV3ForCausalLM` (hf_deepseek_v3.py; --mtp-num-layers depths as its multi-token prediction layers,
hf_deepseek_v3_mtp.py); with DeepSeek-V3's experts (sigmoid router, selection bias, shared expert) and Llama's
attention (partial RoPE, QK-norm, q/k/v biases optional), a `Glm4MoeForCausalLM` (hf_glm4_moe.py); with attention
sinks or quick-GeGLU experts, a `GptOssForCausalLM` (hf_gpt_oss.py; its bf16 layout, not the release's MXFP4). The
TP and PP shards are merged first; the padded vocabulary rows are dropped (vocab_size = the tokenizer's). Tensors are
written in --dtype (float32 by default: the trained masters), but for those an architecture keeps in fp32 (its
KEPT_IN_FP32: DeepSeek-V3's and GLM-4.5's selection bias).
Writing needs `safetensors` (a dependency); reading it back, `transformers`.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch

from megatron_lite.checkpoint import (
    hf_deepseek_v3,
    hf_glm4_moe,
    hf_gpt2,
    hf_gpt_oss,
    hf_llama,
    hf_mixtral,
    hf_qwen2_moe,
    hf_qwen3,
    hf_qwen3_moe,
)
from megatron_lite.checkpoint.merge import dense_state_dict
from megatron_lite.checkpoint.preflight import refuse_filled_folder
from megatron_lite.checkpoint.reader import CheckpointReader
from megatron_lite.config import Config
from megatron_lite.atomic import WriteError, atomic_folder, describe
from megatron_lite.checkpoint.format import CheckpointError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def llama_block_flags(config: Config):
    """The Llama-family flags a model was built with (none: GPT-2's block)."""
    m = config.model
    return [flag for flag, on in (("--swiglu", m.swiglu), ("--normalization RMSNorm", m.normalization == "RMSNorm"),
                                  ("--group-query-attention", m.num_query_groups not in (None, m.num_attention_heads)),
                                  ("--disable-bias-linear", not m.add_bias_linear)) if on]


def architecture_of(config: Config):
    """The module (hf_qwen3, hf_llama or hf_gpt2) whose architecture holds the model; refused with the reason
    when none."""
    m = config.model
    if m.multi_latent_attention:  # with or without experts: DeepSeek-V3's router, or first_k_dense_replace = L
        hf_deepseek_v3.check_deepseek_v3(m)
        return hf_deepseek_v3
    if m.softmax_type != "vanilla" or m.quick_geglu:  # gpt-oss's sinks or experts: only it holds them
        hf_gpt_oss.check_gpt_oss(m)
        return hf_gpt_oss
    if m.num_experts is not None:  # each check refuses, naming the flag, what its architecture cannot hold
        if m.moe_router_score_function == "sigmoid" and m.moe_router_enable_expert_bias \
                and m.moe_shared_expert_intermediate_size:  # DeepSeek-V3's MoE block, with Llama's attention
            hf_glm4_moe.check_glm4_moe(m)
            return hf_glm4_moe
        if m.qk_layernorm:
            hf_qwen3_moe.check_qwen3_moe(m)
            return hf_qwen3_moe
        if m.moe_shared_expert_intermediate_size or m.add_qkv_bias:
            hf_qwen2_moe.check_qwen2_moe(m)
            return hf_qwen2_moe
        hf_mixtral.check_mixtral(m)
        return hf_mixtral
    if config.model.qk_layernorm:
        hf_qwen3.check_qwen3(config.model)  # QK-norm is Qwen3's: without the Llama-family block, refused
        return hf_qwen3
    if llama_block_flags(config):
        hf_llama.check_llama(config.model)  # a partly Llama-shaped block is refused, naming what is missing
        return hf_llama
    hf_gpt2.check_gpt2(config.model)
    return hf_gpt2


def _tokenizer(config: Config, fields: Optional[dict]):
    """(files to copy as [(path, name in the folder)], bos id, eos id) of the tokenizer `fields` name (the tool's
    flags, checked against the model by checkpoint/tokenizer.py), else of the one the run recorded, its files where
    the run had them; ([], None, None) for a NullTokenizer."""
    from megatron_lite.data.tokenizer import build_tokenizer, tokenizer_files

    d = config.data
    if fields is None:
        fields = {"tokenizer_type": d.tokenizer_type, "tokenizer_model": d.tokenizer_model,
                  "vocab_file": d.vocab_file, "merge_file": d.merge_file}
    kind = fields["tokenizer_type"]
    if kind in (None, "NullTokenizer"):
        return [], None, None
    model, vocab, merges = fields["tokenizer_model"], fields["vocab_file"], fields["merge_file"]
    try:
        tokenizer = build_tokenizer(kind, model, config.model.vocab_size, vocab, merges)
        files = tokenizer_files(kind, model, vocab, merges)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"export-hf: the run's tokenizer ({kind}) cannot be read: {e}; give its files with "
                              f"--tokenizer-model, or --vocab-file and --merge-file") from None
    return files, (tokenizer.bos if tokenizer.bos >= 0 else None), (tokenizer.eod if tokenizer.eod >= 0 else None)


def hf_tensors(config: Config, dense, dtype: torch.dtype):
    """(architecture module, Hugging Face state dict in dtype) of a dense model."""
    module = architecture_of(config)
    kept = getattr(module, "KEPT_IN_FP32", ())
    return module, {k: v.to(torch.float32 if k.endswith(kept) else dtype).contiguous()
                    for k, v in module.to_hf(dense, config.model).items()}


def export_hf(load_dir: str, output: str, iteration: Optional[int] = None, tokenizer: Optional[dict] = None,
              dtype: str = "float32", overwrite: bool = False) -> dict:
    """`tokenizer`: the tokenizer fields to copy the files of (checkpoint/tokenizer.py checkpoint_tokenizer's,
    default the run's); `overwrite`: replace an earlier export, once the new one is whole (never the checkpoint
    read)."""
    refuse_filled_folder(output, overwrite, load_dir)
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    reader = CheckpointReader(load_dir, iteration)
    config = reader.config
    architecture_of(config)  # refuse before reading any weights
    from safetensors.torch import save_file

    tokenizer_files, bos_id, eos_id = _tokenizer(config, tokenizer)
    _, dense = dense_state_dict(reader)
    module, tensors = hf_tensors(config, dense, DTYPES[dtype])
    hf_config = dict(module.hf_config(config.model), bos_token_id=bos_id, eos_token_id=eos_id, torch_dtype=dtype)
    parent = os.path.dirname(os.path.abspath(output))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise WriteError(output, describe(e)) from None
    with atomic_folder(output, replace=overwrite) as tmp:
        try:
            save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        except Exception as e:  # noqa: BLE001 - safetensors reports a full disk as its own error type
            raise WriteError(os.path.join(output, "model.safetensors"), describe(e)) from None
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=1)
        files = ["config.json", "model.safetensors"]
        for path, name in tokenizer_files:
            shutil.copy2(path, os.path.join(tmp, name))
            files.append(name)
        if not overwrite and os.path.isdir(output):
            os.rmdir(output)  # empty, checked above; atomic_folder renames into its place next (--overwrite: it swaps)
    return {"tag": reader.tag, "architecture": hf_config["architectures"][0],
            "vocab_size": hf_config["vocab_size"], "files": files,
            "parameters": sum(t.numel() for t in tensors.values())}
