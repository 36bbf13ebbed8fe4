"""Our Config -> DeepSpeed's config dict, merged with the user's `--deepspeed-config` JSON.

Batch sizes come from `batching.py` only. The user's JSON may add anything we
do not set (communication logging, flops profiler, ...) and may say "auto" for
a value we set; a value that contradicts ours is an error naming both, since
silently preferring either one trains a different model than the user thinks.
Validation builds this dict once to find contradictions before any process
group exists; no torch here, so that stays cheap.
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict

from megatron_lite.config import Config, ConfigError


def clips_in_optimizer(config: Config) -> bool:
    """Whether our optimizer sees the model's own gradients and so does the clipping itself
    (ZeRO 0 without fp16 loss scaling; see training/optimizer.py for why)."""
    return config.optimizer.clip_grad > 0 and config.parallel.zero_stage == 0 and not config.precision.fp16


def deepspeed_optimizer(config: Config) -> str:
    """The optimizer DeepSpeed 0.19 wraps around our AdamW for this config (runtime/engine.py
    `_do_optimizer_sanity_check`; docs/precision.md has the table): what the first screen names and
    what the memory estimate books. tests/training/test_deepspeed_optimizer.py checks it against the
    engine's own choice at every (precision, ZeRO) pair."""
    precision, zero = config.precision, config.parallel.zero_stage
    if zero == 3:
        return "DeepSpeedZeroOptimizer_Stage3"
    if zero == 0:
        # Our GPT is always a PipelineModule: DeepSpeed's pipeline engine takes BF16_Optimizer for bf16.
        return "BF16_Optimizer" if precision.bf16 else "FP16_Optimizer" if precision.fp16 else "AdamW"
    if precision.bf16 and precision.accumulate_allreduce_grads_in_fp32:
        return "BF16_Optimizer"
    return "DeepSpeedZeroOptimizer"


def _ours(config: Config) -> Dict[str, Any]:
    batch, precision = config.batch, config.precision
    zero: Dict[str, Any] = {"stage": config.parallel.zero_stage}
    offload: Dict[str, Any] = {}
    if config.parallel.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        # Under offload DeepSpeed refuses a client optimizer unless told. Ours is torch's AdamW, the
        # same maths on every path; DeepSpeedCPUAdam would be faster on the CPU copy but builds a C++ op
        # at first use (minutes) and is not what the other paths train with.
        offload["zero_force_ds_cpu_optimizer"] = False
    fp16: Dict[str, Any] = {"enabled": precision.fp16}
    if precision.fp16:
        fp16.update(
            loss_scale=precision.loss_scale or 0,  # 0 = dynamic in DeepSpeed
            initial_scale_power=int(round(math.log2(precision.initial_loss_scale))),
            loss_scale_window=precision.loss_scale_window,
            hysteresis=precision.hysteresis,
            min_loss_scale=precision.min_loss_scale,
        )
    return {
        # DeepSpeed's data-parallel ranks are DP x CP (parallel/state.py), each taking micro x gas samples
        # per step as it counts them; the CP ranks of a sample each count it once.
        "train_batch_size": batch.global_batch_size * config.parallel.context_parallel_size,
        "train_micro_batch_size_per_gpu": batch.micro_batch_size,
        "gradient_accumulation_steps": batch.gradient_accumulation_steps,
        "gradient_clipping": config.optimizer.clip_grad,
        "zero_optimization": zero,
        # ZeRO refuses optimizers it has not tested unless told; ours is torch's AdamW.
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": precision.bf16},
        "fp16": fp16,
        # We print our own metrics line; DeepSpeed's would repeat it every step.
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
        **offload,
        **_pipeline(config),
        **_fp32_gradients(config),
    }


def _fp32_gradients(config: Config) -> Dict[str, Any]:
    """--accumulate-allreduce-grads-in-fp32 (validation resolved it: bf16 at ZeRO 1): DeepSpeed's
    engine then takes BF16_Optimizer, whose per-micro-batch accumulators are fp32, and all-reduces them
    in fp32 (without communication_data_type it would cast them to bf16 for the all-reduce)."""
    if not (config.precision.bf16 and config.precision.accumulate_allreduce_grads_in_fp32):
        return {}
    return {"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}


def sends_partitioned(config: Config) -> bool:
    """Whether DeepSpeed's pipeline engine cuts a stage's output (and its gradient) into TP parts for the send
    and gathers them on the next stage (pipe_partitioned / grad_partitioned, on by default, apply at TP > 1):
    not under sequence parallelism or --pipeline-schedule dualpipev, where _pipeline turns them off. cost/memory.py
    sizes the pipe buffers by it."""
    return (config.parallel.tensor_model_parallel_size > 1 and not config.parallel.sequence_parallel
            and config.parallel.pipeline_schedule != "dualpipev")


def _pipeline(config: Config) -> Dict[str, Any]:
    if config.parallel.pipeline_schedule == "dualpipev":
        # DeepSpeed's DualPipeVEngine asserts both off (it sends whole tensors in batched P2P); they default on.
        return {"pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}
    if not config.parallel.sequence_parallel:
        return {}
    # DeepSpeed's partitioned sends assume every TP rank holds the same tensor. Under sequence parallelism each
    # rank holds its own sequence shard, already 1/TP of the activation: send it whole.
    return {"pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}


def _merge(ours: Dict[str, Any], theirs: Dict[str, Any], source: str, path: str = "") -> Dict[str, Any]:
    merged = dict(ours)
    for key, value in theirs.items():
        where = f"{path}{key}"
        if key not in ours or value == "auto":
            if value != "auto":
                merged[key] = value
            continue
        mine = ours[key]
        if isinstance(mine, dict) and isinstance(value, dict):
            merged[key] = _merge(mine, value, source, where + ".")
        elif value != mine and not (isinstance(value, (int, float)) and isinstance(mine, (int, float))
                                    and not isinstance(value, bool) and float(value) == float(mine)):
            raise ConfigError(
                f"--deepspeed-config {source}: \"{where}\" is {json.dumps(value)} but the command-line flags give "
                f"{json.dumps(mine)}; remove it from the JSON (or set it to \"auto\") and use the flag instead"
            )
    return merged


def deepspeed_config(config: Config) -> Dict[str, Any]:
    """The dict for `deepspeed.initialize(config=...)`: ours, merged with the contents of
    `--deepspeed-config` that validation read."""
    source = config.training.deepspeed_config or "<dict>"
    extra = config.training.deepspeed_config_contents
    merged = _ours(config)
    if extra:
        merged = _checked_merge(merged, extra, source)
    if clips_in_optimizer(config):
        # ZeRO 0 without fp16: our ClippedAdamW clips (see training/optimizer.py), DeepSpeed must not.
        merged["gradient_clipping"] = 0.0
    return merged


def _checked_merge(ours: Dict[str, Any], extra: Dict[str, Any], source: str) -> Dict[str, Any]:
    for key in ("optimizer", "scheduler"):
        if key in extra:
            raise ConfigError(
                f"--deepspeed-config {source}: \"{key}\" is set, but megatron_lite builds the optimizer (AdamW) and "
                f"the learning-rate schedule from --lr, --min-lr, --lr-decay-style, --lr-warmup-iters and "
                f"--weight-decay; remove \"{key}\" from the JSON"
            )
    return _merge(ours, extra, source)
