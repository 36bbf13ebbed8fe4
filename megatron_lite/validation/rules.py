"""Rules over the config's own fields, one function per section; no file is read here.

Each rule takes the whole `Config` (cross-section rules need it), returns it
with its section completed (derived fields filled) and appends warnings to
`notes`. The first broken rule of a section raises `ConfigError` with the
flag, the bad value and a value that would work.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Sequence, Tuple

from megatron_lite import batching
from megatron_lite.config import LOG_LEVELS, NORMALIZATIONS, Config, ConfigError, flag_for, format_split
from megatron_lite.model.partition import check_partition_method, layers_per_stage_uniform
from megatron_lite.validation.activation import check_activation
from megatron_lite.validation.attention import check_attention_mask, check_qk_layernorm, query_groups
from megatron_lite.validation.latent_attention import check_latent_attention
from megatron_lite.validation.mtp import check_mtp
from megatron_lite.validation.moe import check_moe
from megatron_lite.validation.positions import check_positions


def flag(name: str) -> str:
    """Field name -> its command-line flag: micro_batch_size -> --micro-batch-size."""
    return flag_for(name)


def parallel_rules(config: Config, notes: List[str]) -> Config:
    p = config.parallel
    world, tp, pp = p.world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    cp = p.context_parallel_size
    if world < 1:
        raise ConfigError(f"world size {world} (WORLD_SIZE / SLURM_NTASKS) must be at least 1")
    if p.cp_comm_type != "a2a":
        raise ConfigError(f"--cp-comm-type {p.cp_comm_type}: ring attention (p2p) is not built here; use "
                          f"--cp-comm-type a2a (all-to-all over heads, DeepSpeed-Ulysses style)", code="cp_comm_type")
    if world % (tp * pp):
        fits = [f"{t}x{q}" for t in (1, 2, 4, 8) for q in (1, 2, 4, 8) if world % (t * q) == 0 and t * q > 1][:4]
        raise ConfigError(
            f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp}; the data-parallel size must be a whole number. "
            f"Launch a multiple of {tp * pp} processes, or use TP x PP that divides {world}"
            + (f" (e.g. {', '.join(fits)})" if fits else ""), code="world_not_divisible"
        )
    if world % (tp * pp * cp):
        raise ConfigError(
            f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--context-parallel-size {cp} x --pipeline-model-parallel-size {pp} = {tp * cp * pp}; the "
            f"data-parallel size must be a whole number. Launch a multiple of {tp * cp * pp} processes, or use "
            f"sizes whose product divides {world}", code="world_not_divisible"
        )
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--zero-stage {p.zero_stage} is not a ZeRO stage; use 0, 1, 2 or 3")
    if p.zero_stage >= 2 and pp > 1:
        raise ConfigError(
            f"--zero-stage {p.zero_stage} with --pipeline-model-parallel-size {pp}: pipeline parallelism "
            f"needs each stage's full gradients for gradient accumulation; use --zero-stage 1, or "
            f"--pipeline-model-parallel-size 1 for ZeRO 2/3", code="zero_with_pipeline"
        )
    if p.cpu_offload and (pp > 1 or p.zero_stage == 0):
        raise ConfigError(
            f"--cpu-offload needs ZeRO (--zero-stage 1, 2 or 3) and --pipeline-model-parallel-size 1; "
            f"got --zero-stage {p.zero_stage}, --pipeline-model-parallel-size {pp}"
        )
    if p.distributed_backend not in (None, "nccl", "gloo"):
        raise ConfigError(f"--distributed-backend {p.distributed_backend} is not nccl or gloo")
    # Layer counts list every stage: 2 x PP of them under --pipeline-schedule dualpipev (model/virtual_stages.py).
    check_partition_method(p.pipeline_partition_method, config.model.num_layers,
                           2 * pp if p.pipeline_schedule == "dualpipev" else pp)
    return config.replace(parallel__data_parallel_size=world // (tp * pp * cp))


def model_rules(config: Config, notes: List[str]) -> Config:
    m, tp, pp = config.model, config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size
    hidden, heads = m.hidden_size, m.num_attention_heads
    check_activation(m)
    ffn = m.ffn_hidden_size if m.ffn_hidden_size is not None else default_ffn_hidden_size(hidden, m.gated_linear_unit)
    check_latent_attention(m)
    if hidden % heads and m.kv_channels is None and not m.multi_latent_attention:
        divisors = [h for h in range(1, hidden + 1) if hidden % h == 0 and h % tp == 0]
        near = sorted(divisors, key=lambda h: abs(h - heads))[:2]
        raise ConfigError(
            f"--hidden-size {hidden} is not divisible by --num-attention-heads {heads}; every head needs "
            f"the same width. Use --num-attention-heads {batching.or_join(sorted(near))}, or give the head width "
            f"with --kv-channels",
            code="hidden_not_divisible_by_heads"
        )
    if heads % tp:
        raise ConfigError(
            f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}; heads are "
            f"split whole across TP ranks. Use --num-attention-heads "
            f"{batching.or_join(batching.nearest_multiples(heads, tp))} or a TP size that divides {heads}",
            code="heads_not_divisible_by_tp"
        )
    if ffn % tp:
        unit = "--swiglu" if m.swiglu else "--quick-geglu"
        gated = f" (with {unit}, both the gate and the up projection)" if m.gated_linear_unit else ""
        raise ConfigError(
            f"--ffn-hidden-size {ffn} is not divisible by --tensor-model-parallel-size {tp}; the MLP is split "
            f"column-wise across TP ranks{gated}. Use --ffn-hidden-size "
            f"{batching.or_join(batching.nearest_multiples(ffn, tp))}", code="ffn_not_divisible_by_tp"
        )
    groups = query_groups(m, tp)
    if m.normalization not in NORMALIZATIONS:
        raise ConfigError(f"--normalization {m.normalization} is not one of {', '.join(NORMALIZATIONS)}")
    m = check_positions(m)  # `--position-embedding-type yarn` comes back as rope with --rope-type yarn
    config = config.replace(model__position_embedding_type=m.position_embedding_type, model__rope_type=m.rope_type)
    if m.attention_backend not in ("auto", "sdpa", "fused"):
        raise ConfigError(f"--attention-backend {m.attention_backend} is not auto, sdpa or fused")
    check_qk_layernorm(config)
    max_pos = m.max_position_embeddings if m.max_position_embeddings is not None else m.seq_length
    if m.seq_length > max_pos:
        raise ConfigError(
            f"--seq-length {m.seq_length} is larger than --max-position-embeddings {max_pos}; positions past "
            f"the table have no embedding. Use --max-position-embeddings {m.seq_length} or more"
        )
    if m.num_layers < pp:
        raise ConfigError(
            f"--num-layers {m.num_layers} is smaller than --pipeline-model-parallel-size {pp}; every stage "
            f"needs at least one transformer layer. Use --pipeline-model-parallel-size {m.num_layers} or less",
            code="layers_fewer_than_stages"
        )
    if m.num_layers % pp:
        counts = layers_per_stage_uniform(m.num_layers, pp)
        notes.append(
            f"warning: --num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
            f"stages get unequal layer counts (uniform split: {', '.join(map(str, counts))}), "
            f"the partitioner balances by cost"
        )
    _check_sequence_parallel(config)
    _check_context_parallel(config, groups)
    check_attention_mask(m, notes)
    check_mtp(config)
    check_moe(config.replace(model__ffn_hidden_size=ffn), notes)
    granularity = _recompute_granularity(m, notes)
    return config.replace(model__ffn_hidden_size=ffn, model__max_position_embeddings=max_pos,
                          model__recompute_granularity=granularity, model__num_query_groups=groups)


def default_ffn_hidden_size(hidden: int, gated: bool) -> int:
    """Megatron-LM's default MLP width: 4h, or gated (--swiglu, --quick-geglu) 2/3 of it rounded down to a
    multiple of 64 (the gated MLP's three matrices then hold about as many parameters as GeLU's two); at least 64."""
    if not gated:
        return 4 * hidden
    return max(64, int(4 * hidden * 2 / 3 / 64) * 64)


def _check_sequence_parallel(config: Config) -> None:
    p, seq = config.parallel, config.model.seq_length
    tp = p.tensor_model_parallel_size
    if not p.sequence_parallel:
        return
    if tp == 1:
        raise ConfigError("--sequence-parallel splits the sequence across the tensor-parallel ranks and needs "
                          "--tensor-model-parallel-size 2 or more; got 1. Use --tensor-model-parallel-size 2, or "
                          "drop --sequence-parallel", code="sequence_parallel_without_tp")
    if seq % tp:
        raise ConfigError(f"--seq-length {seq} is not divisible by --tensor-model-parallel-size {tp}: "
                          f"--sequence-parallel gives each TP rank seq-length / TP positions. Use --seq-length "
                          f"{batching.or_join(batching.nearest_multiples(seq, tp))}", code="seq_not_divisible_by_tp")
    if p.zero_stage >= 2:
        raise ConfigError(f"--sequence-parallel with --zero-stage {p.zero_stage}: the sequence-parallel gradients "
                          f"(LayerNorms, row-parallel biases) are summed over TP once per step in the pipeline "
                          f"engine, which ZeRO 2/3 do not use; use --zero-stage 1 (or 0)",
                          code="sequence_parallel_with_zero")


def _check_context_parallel(config: Config, groups: int) -> None:
    """CP splits each TP rank's heads (inside attention) and the sequence (outside it) C ways."""
    p, m = config.parallel, config.model
    cp, tp, seq = p.context_parallel_size, p.tensor_model_parallel_size, m.seq_length
    if cp == 1:
        return
    local_heads = m.num_attention_heads // tp
    if local_heads % cp:
        raise ConfigError(
            f"--num-attention-heads {m.num_attention_heads} / --tensor-model-parallel-size {tp} = {local_heads} "
            f"heads per TP rank is not divisible by --context-parallel-size {cp}: the all-to-all gives each CP "
            f"rank whole heads. Use --context-parallel-size "
            f"{batching.or_join([c for c in (1, 2, 4, 8) if local_heads % c == 0][-2:])}",
            code="heads_not_divisible_by_cp")
    local_groups = max(groups // tp, 1)
    if local_groups % cp and cp % local_groups:
        raise ConfigError(
            f"--num-query-groups {groups} at --tensor-model-parallel-size {tp} leaves {local_groups} key/value "
            f"groups per TP rank, which neither divides nor is divided by --context-parallel-size {cp}; use a "
            f"--context-parallel-size that divides {local_groups} or is a multiple of it",
            code="groups_not_compatible_with_cp")
    shards = cp * tp if p.sequence_parallel else cp
    if seq % shards:
        what = (f"--context-parallel-size {cp} x --tensor-model-parallel-size {tp} (with --sequence-parallel)"
                if p.sequence_parallel else f"--context-parallel-size {cp}")
        raise ConfigError(f"--seq-length {seq} is not divisible by {what} = {shards}: each rank holds an equal "
                          f"part of the sequence. Use --seq-length "
                          f"{batching.or_join(batching.nearest_multiples(seq, shards))}",
                          code="seq_not_divisible_by_cp")


def _recompute_granularity(m, notes: List[str]):
    """Megatron-LM's rules for --recompute-granularity / -method / -num-layers; the granularity to use."""
    granularity = m.recompute_granularity
    if m.recompute_activations:
        if granularity == "full":
            raise ConfigError("--recompute-activations means --recompute-granularity selective (as in Megatron-LM); "
                              "it contradicts --recompute-granularity full: drop one of them")
        granularity = "selective"
        notes.append("note: --recompute-activations recomputes the attention core (--recompute-granularity "
                     "selective, as in Megatron-LM); before this version it recomputed whole layers, which is now "
                     "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    if granularity not in (None, "full", "selective"):
        raise ConfigError(f"--recompute-granularity {granularity} is not full or selective")
    if m.recompute_method not in (None, "uniform", "block"):
        raise ConfigError(f"--recompute-method {m.recompute_method} is not uniform or block")
    if granularity == "full":
        if m.recompute_method is None or m.recompute_num_layers is None:
            raise ConfigError("--recompute-granularity full needs --recompute-method (uniform or block) and "
                              "--recompute-num-layers N, as in Megatron-LM; e.g. --recompute-method uniform "
                              "--recompute-num-layers 1 recomputes every layer from its own input")
        if not 1 <= m.recompute_num_layers <= m.num_layers:
            raise ConfigError(f"--recompute-num-layers {m.recompute_num_layers} must be between 1 and --num-layers "
                              f"{m.num_layers}, e.g. 1")
    else:
        for name in ("recompute_method", "recompute_num_layers"):
            if getattr(m, name) is not None:
                raise ConfigError(f"{flag(name)} {getattr(m, name)} applies only with --recompute-granularity full; "
                                  f"add --recompute-granularity full or drop {flag(name)}")
    return granularity


def batch_rules(config: Config, notes: List[str]) -> Config:
    b = config.batch
    batch = batching.resolve_batch(
        config.parallel.data_parallel_size,
        micro_batch_size=b.micro_batch_size,
        global_batch_size=b.global_batch_size,
        gradient_accumulation_steps=b.gradient_accumulation_steps,
        rampup_batch_size=b.rampup_batch_size,
    )
    return dataclasses.replace(config, batch=batch)


def optimizer_rules(config: Config, notes: List[str]) -> Config:
    o, train_iters = config.optimizer, config.training.train_iters
    if o.min_lr > o.lr:
        raise ConfigError(f"--min-lr {o.min_lr} must be between 0 and --lr {o.lr}")
    if o.lr_decay_style not in ("constant", "linear", "cosine"):
        raise ConfigError(f"--lr-decay-style {o.lr_decay_style} is not constant, linear or cosine")
    decay_iters = o.lr_decay_iters if o.lr_decay_iters is not None else train_iters
    if o.lr_warmup_iters > decay_iters:
        raise ConfigError(
            f"--lr-warmup-iters {o.lr_warmup_iters} is longer than the decay "
            f"({'--lr-decay-iters' if o.lr_decay_iters is not None else '--train-iters'} {decay_iters}); "
            f"use --lr-warmup-iters {max(decay_iters // 10, 0)}"
        )
    return config.replace(optimizer__lr_decay_iters=decay_iters)


def muon_rules(config: Config, notes: List[str]) -> Config:
    """--optimizer muon where training/muon.py can see whole matrices: its own parameters (ZeRO 0) or DeepSpeed's
    flat partitions of them (ZeRO 1/2, the bf16 optimizer). ZeRO 3 partitions the parameters themselves, and
    optimizer offload steps a CPU copy DeepSpeed manages apart."""
    o, p = config.optimizer, config.parallel
    if o.optimizer != "muon":
        return config
    if p.zero_stage == 3:
        raise ConfigError("--optimizer muon runs at --zero-stage 0, 1 or 2 (ZeRO 3 partitions the parameters, and "
                          "Muon needs each matrix whole); use --zero-stage 1, or --optimizer adam")
    if p.cpu_offload:
        raise ConfigError("--optimizer muon does not run with --cpu-offload (the offloaded step is DeepSpeed's, not "
                          "ours); drop --cpu-offload, or use --optimizer adam")
    if o.muon_tp_mode == "blockwise" and p.tensor_model_parallel_size > 1:
        notes.append(f"--muon-tp-mode blockwise: each of the {p.tensor_model_parallel_size} TP ranks orthogonalises "
                     f"its own shard, not the dense matrix: the update depends on the TP size")
    return config


def precision_rules(config: Config, notes: List[str]) -> Config:
    p = config.precision
    if p.bf16 and p.fp16:
        raise ConfigError("--bf16 and --fp16 were both given; choose one (bf16 needs no loss scaling)")
    if p.fp16 and config.parallel.zero_stage == 0:
        # DeepSpeed 0.19 scales the loss in backward only for its ZeRO optimizers, while its ZeRO-0
        # fp16 optimizer still divides the gradients by the scale: training silently stalls.
        # tests/training/test_fp16_loss_scale.py measures it, and fails once DeepSpeed fixes it.
        raise ConfigError("--fp16 with --zero-stage 0: DeepSpeed's ZeRO-0 fp16 optimizer does not apply the loss "
                          "scale in backward, so gradients come out scaled down and training stalls; use "
                          "--zero-stage 1 with --fp16, or --bf16")
    if p.loss_scale is not None and not p.fp16:
        raise ConfigError(f"--loss-scale {p.loss_scale} only applies with --fp16; drop it or add --fp16")
    return _gradient_accumulation_dtype(config)


def _gradient_accumulation_dtype(config: Config) -> Config:
    """Resolve --accumulate-allreduce-grads-in-fp32: on by default where DeepSpeed 0.19 can do it
    (bf16 at ZeRO 1 without offload: its BF16_Optimizer), refused where asked for and it cannot."""
    p, zero = config.precision, config.parallel.zero_stage
    asked = p.accumulate_allreduce_grads_in_fp32
    possible = p.bf16 and zero == 1 and not config.parallel.cpu_offload
    if asked and not p.bf16:
        raise ConfigError(f"--accumulate-allreduce-grads-in-fp32 applies to --bf16 only: {p.dtype_name} runs "
                          + ("accumulate and reduce in fp32 already" if p.dtype_name == "fp32" else
                             "keep fp16 gradients in DeepSpeed 0.19's fp16 optimizers")
                          + "; drop the flag", code="grad_accum_dtype")
    if asked and not possible:
        where = ("--zero-stage 0 (DeepSpeed 0.19 refuses bf16 weights with fp32 accumulation without ZeRO)"
                 if zero == 0 else "--cpu-offload (DeepSpeed's ZeRO-Offload optimizer keeps bf16 gradients)"
                 if zero == 1 else f"--zero-stage {zero} (DeepSpeed's ZeRO {zero} optimizer keeps bf16 gradient "
                 "partitions)")
        raise ConfigError(f"--accumulate-allreduce-grads-in-fp32 is not available with --bf16 at {where}; use "
                          "--zero-stage 1 without --cpu-offload (DeepSpeed's BF16_Optimizer, fp32 accumulators), "
                          "or --no-accumulate-allreduce-grads-in-fp32", code="grad_accum_dtype")
    return config.replace(precision__accumulate_allreduce_grads_in_fp32=bool(possible if asked is None else asked))


def training_rules(config: Config, notes: List[str]) -> Config:
    t = config.training
    if t.save_interval is not None and not t.save:
        raise ConfigError(f"--save-interval {t.save_interval} needs --save DIR to say where checkpoints go")
    if t.keep_last is not None and not t.save:
        raise ConfigError(f"--keep-last {t.keep_last} needs --save DIR")
    if t.async_save and not t.save:
        raise ConfigError("--async-save writes checkpoints in the background; it needs --save DIR")
    if t.exit_interval is not None and not t.save:
        notes.append("warning: --exit-interval without --save exits without a checkpoint")
    return config


def logging_rules(config: Config, notes: List[str]) -> Config:
    if config.logging.log_level not in LOG_LEVELS:
        raise ConfigError(f"--log-level {config.logging.log_level} is not one of {', '.join(LOG_LEVELS)}")
    if config.logging.timing_breakdown and config.parallel.zero_stage >= 2:
        raise ConfigError(f"--timing-breakdown times the pipeline engine's instructions, which --zero-stage "
                          f"{config.parallel.zero_stage} does not use; use --zero-stage 0 or 1, or drop the flag")
    return config


def split_rules(split: Sequence[float]) -> Tuple[float, float, float]:
    """The --split weights as given -> normalised (train, valid, test)."""
    text = format_split(split)
    if len(split) != 3 or not all(0 <= w < math.inf for w in split) or not sum(split) > 0:
        raise ConfigError(f"--split '{text}' must be up to three non-negative numbers with a positive sum, e.g. 969,30,1")
    total = sum(split)
    return tuple(w / total for w in split)

