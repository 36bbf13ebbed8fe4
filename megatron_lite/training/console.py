"""The first screen of a run: library log levels, DeepSpeed's start-up lines, our layout summary.

By default (`--log-level warning`) torch's, DeepSpeed's and our loggers show warnings and
errors only, DeepSpeed's print()ed start-up lines are hidden (deepspeed_compat.startup.quiet_prints),
and rank 0 prints one line saying how the job is laid out. `--log-level info` shows everything.
"""
from __future__ import annotations

import logging
import os

from megatron_lite.config import Config
from megatron_lite.cost.arithmetic import active_parameters, total_parameters
from megatron_lite.deepspeed_config import deepspeed_optimizer


def select_accelerator() -> None:
    """Tell DeepSpeed the accelerator it would detect (CUDA if torch sees a GPU, else CPU) unless
    DS_ACCELERATOR is set already. Why: detecting CPU makes DeepSpeed warn, on every rank, that it
    found no GPU. Must run before DeepSpeed is first imported."""
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")


def configure_logging(level: str) -> None:
    """Python logging (ours, torch's) and DeepSpeed's logger at `level` (a --log-level choice)."""
    from megatron_lite.deepspeed_compat import startup

    logging.basicConfig(level=level.upper(), format="[%(levelname)s] %(name)s: %(message)s", force=True)
    startup.set_log_level(level)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def layout_summary(config: Config, backend: str, device: str) -> str:
    """One line: processes and their TP (x CP) x PP x DP grid, ZeRO, precision, batch, model size."""
    p, b, m = config.parallel, config.batch, config.model
    cp = f" x CP {p.context_parallel_size}" if p.context_parallel_size > 1 else ""
    return (f"megatron_lite: {p.world_size} processes = TP {p.tensor_model_parallel_size}{cp} x PP "
            f"{p.pipeline_model_parallel_size} x DP {p.data_parallel_size} ({backend}, {device}) | ZeRO {p.zero_stage}"
            f"{' + CPU offload' if p.cpu_offload else ''} | {config.precision.dtype_name}{_gradients(config)} | "
            f"optimizer {_optimizer(config)} | global batch "
            f"{b.global_batch_size} = micro {b.micro_batch_size} x {b.gradient_accumulation_steps} accumulation "
            f"x DP {p.data_parallel_size} | GPT {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} "
            f"heads{_block(m)}, seq {m.seq_length}, vocabulary {m.padded_vocab_size}, "
            f"{_count(total_parameters(config))} parameters{_active(config)}")


def _optimizer(config: Config) -> str:
    """The optimizer DeepSpeed steps: ours (AdamW, or Muon with AdamW on the rest), or its wrapper around ours."""
    wrapper = deepspeed_optimizer(config)  # "AdamW" where DeepSpeed steps our optimizer unwrapped
    if config.optimizer.optimizer != "muon":
        return wrapper
    return "Muon" if wrapper == "AdamW" else f"Muon in {wrapper}"


def _active(config: Config) -> str:
    """An MoE model's parameters a token passes through (its experts' top-k), beside the total."""
    return f" ({_count(active_parameters(config))} active)" if config.model.num_experts is not None else ""


def _gradients(config: Config) -> str:
    """bf16's gradient accumulation dtype (--accumulate-allreduce-grads-in-fp32); others have one choice."""
    if not config.precision.bf16:
        return ""
    return ", fp32 gradients" if config.precision.accumulate_allreduce_grads_in_fp32 else ", bf16 gradients"


def _gated_unit(m) -> str:
    """SwiGLU or quick-GeGLU with its clamp and offset (gpt-oss's: 'quick-GeGLU clamped at 7 with up + 1'); ''."""
    if not m.gated_linear_unit:
        return ""
    clamp, offset = m.activation_func_clamp_value, m.glu_linear_offset
    return ("SwiGLU" if m.swiglu else "quick-GeGLU") + (f" clamped at {clamp:g}" if clamp is not None else "") \
        + (f" with up + {offset:g}" if offset else "")


def _block(m) -> str:
    """The block's departures from GPT-2's, as the flags name them ('' for GPT-2's block)."""
    groups = m.num_query_groups or m.num_attention_heads
    mla = m.multi_latent_attention
    latents = f"q latent {m.q_lora_rank}, " if m.q_lora_rank else ""
    parts = [f"MLA: {latents}kv latent {m.kv_lora_rank}{', normed' if m.qk_layernorm else ''}, heads of "
             f"{m.qk_head_dim} + {m.qk_pos_emb_head_dim} rotary, values {m.v_head_dim}" if mla else "",
             f"{groups} query group{'s' if groups > 1 else ''}" if groups != m.num_attention_heads else "",
             f"heads of {m.kv_channels}" if m.kv_channels is not None else "",
             "QK-norm" if m.qk_layernorm and not mla else "",
             _gated_unit(m), "RMSNorm" if m.normalization == "RMSNorm" else "",
             "" if m.add_bias_linear else "QKV biases only" if m.add_qkv_bias else "no biases",
             f"RoPE scaling x{m.rope_scaling_factor:g}" if m.use_rope_scaling else "",
             f"YaRN x{m.rotary_scaling_factor:g}" if m.rope_type == "yarn" else "",
             f"RoPE on {m.rotary_dim} of {m.head_dim} dims" if m.position_embedding_type == "rope"
             and m.rotary_dim != m.head_dim and not mla else ""]
    named = [p for p in parts if p]
    return f" ({', '.join(named)})" if named else ""
