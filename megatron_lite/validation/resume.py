"""What --load holds and whether this run may continue it, checked before any process group exists.

A folder with no checkpoint yet (missing, empty, or only our lock and unfinished saves) starts from
iteration 0: that is how a Slurm job whose --load equals its --save starts the first time. Anything else
that is not one of our checkpoints is refused (checkpoint/format.py `probe_load_dir`).

A checkpoint is continued only by a run that builds the same model: every field below must match, and
the tokenizer model must be the same file (SHA-256). The rest may change on a resume: iterations, the
learning-rate schedule, intervals, data, batch sizes, dropout, logging; the parallel layout where the
loader supports the change. As Megatron-LM's check_checkpoint_args, but listing every difference at once.
"""
from __future__ import annotations

import os
from typing import Iterable, List, Optional

from megatron_lite.config import Config, ConfigError, flag_fields
from megatron_lite.config.flag_values import moe_layer_list
from megatron_lite.data.tokenizer import TOKENIZER_FIELDS
from megatron_lite.validation.latent_attention import MLA_FIELDS
from megatron_lite.validation.positions import YARN_FIELDS

# (section, field) of the model's shape and meaning; a resume must keep every one.
MODEL_FIELDS = (
    ("model", "num_layers"), ("model", "hidden_size"), ("model", "num_attention_heads"),
    ("model", "ffn_hidden_size"), ("model", "position_embedding_type"), ("model", "max_position_embeddings"),
    ("model", "rotary_base"), ("model", "vocab_size"), ("model", "untie_embeddings_and_output_weights"),
    ("model", "normalization"), ("model", "swiglu"), ("model", "num_query_groups"), ("model", "add_bias_linear"),
    ("model", "use_rope_scaling"), ("model", "rope_scaling_factor"), ("model", "openai_gelu"),
    ("model", "window_size"), ("model", "window_attn_skip_freq"), ("model", "kv_channels"), ("model", "qk_layernorm"),
    ("model", "add_qkv_bias"), ("model", "rope_type"), ("model", "rotary_percent"),
    *(("model", name) for name in YARN_FIELDS),
    ("model", "multi_latent_attention"), *(("model", name) for name in MLA_FIELDS),
    # The experts and how they are chosen are the model's (Megatron-LM's load_args_from_checkpoint takes them too);
    # the router's losses, capacity and dispatch are the run's. Before these were here, --use-checkpoint-args
    # left an MoE checkpoint's run without --num-experts, and a resume could change the experts unchecked.
    ("model", "num_experts"), ("model", "moe_ffn_hidden_size"), ("model", "moe_layer_freq"),
    ("model", "moe_router_topk"), ("model", "moe_router_score_function"), ("model", "moe_router_pre_softmax"),
    ("model", "moe_router_topk_scaling_factor"), ("model", "moe_router_num_groups"),
    ("model", "moe_router_group_topk"), ("model", "moe_router_enable_expert_bias"),
    ("model", "moe_shared_expert_intermediate_size"), ("model", "moe_shared_expert_gate"),
    # The depths are weights of the model (layer files of their own). --mtp-loss-scaling-factor is not: how much
    # their loss weighs is the run's choice, which DeepSeek-V3 changed mid-training (0.3, then 0.1).
    ("model", "mtp_num_layers"),
    # gpt-oss: the sinks are weights (learnable) or a fixed logit (off-by-one); the activation is the MLP's math.
    ("model", "softmax_type"), ("model", "quick_geglu"), ("model", "glu_linear_offset"),
    ("model", "activation_func_clamp_value"),
)
# Not here: --reset-attention-mask and --reset-position-ids say how samples are packed, a choice of the data
# (Megatron-LM lets a resumed run change them); the window is the model's own.
# DeepSpeed's own loader reads only files of its own layout; ours moves any ZeRO 0/1 checkpoint to any
# ZeRO 0/1 run (checkpoint/layout_free.py), but cannot take ZeRO 2/3 files apart or fill a ZeRO 2/3 engine.
LAYOUT_FIELDS = (("parallel", "tensor_model_parallel_size"), ("parallel", "pipeline_model_parallel_size"),
                 ("parallel", "data_parallel_size"), ("parallel", "context_parallel_size"), ("parallel", "zero_stage"),
                 ("model", "padded_vocab_size"))

# What --use-checkpoint-args takes from the checkpoint: the model's shape and meaning, as Megatron-LM's
# load_args_from_checkpoint does, but not --seq-length (this run's choice, up to the maximum positions).
CHECKPOINT_ARGS = tuple(name for _, name in MODEL_FIELDS) + (
    "group_query_attention", "norm_epsilon", "make_vocab_size_divisible_by")
FLAG_NAMES = {"vocab_size": "--vocab-size (the tokenizer's vocabulary)",
              "padded_vocab_size": "the padded vocabulary (--make-vocab-size-divisible-by x TP)",
              "data_parallel_size": "the data-parallel size (world size / (TP x CP x PP))",
              "num_query_groups": "--num-query-groups (key/value heads; --group-query-attention)",
              "kv_channels": "--kv-channels (the head width)",
              "add_bias_linear": "biases in linear layers (--disable-bias-linear turns them off)",
              "add_qkv_bias": "a bias in the QKV linear (--add-qkv-bias, or biases in every linear layer)"}


def flag_name(field: str) -> str:
    return FLAG_NAMES.get(field, "--" + field.replace("_", "-"))


def shown(value) -> str:
    """A field's value as a user reads it: not Python's spelling ("None", "(3, 0)", "True")."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value))
    return str(value)


def _field(section: str, name: str):
    """The dataclass field of a flag, or None for a derived field (no flag of its own)."""
    return next((f for s, f in flag_fields() if s == section and f.name == name and "flag" in f.metadata), None)


def _as_written(f, value) -> str:
    """A compared value as its flag takes it (--window-size 3,0), else as shown(); a --moe-layer-freq pattern is
    compared as the layer list it means (_value) and shown so."""
    if value is not None and f is not None and "unparse" in f.metadata and f.name != "moe_layer_freq":
        return " ".join(f.metadata["unparse"](value))
    return shown(value)


def _resume_advice(use_checkpoint_args: bool) -> str:
    """What makes this run resume the checkpoint's model. A flag typed on the command line wins over
    --use-checkpoint-args and is then compared, so that flag alone never helps: before, a changed
    --moe-router-topk was told to add it, and the run was refused again."""
    keep = "leave out the model flags that differ (one given here overrides the checkpoint's value, then is compared)"
    if use_checkpoint_args:
        return f"{keep}, or start a new run with another --save"
    return (f"give the checkpoint's values, or add --use-checkpoint-args and {keep}, or start a new run with "
            f"another --save")


def _applies(field: str, saved: Config) -> bool:
    position = saved.model.position_embedding_type
    if field == "max_position_embeddings":
        return position == "learned_absolute"  # rotary positions have no table
    if field in ("rotary_base", "use_rope_scaling", "rope_type", "rotary_percent"):
        return position == "rope"
    if field in YARN_FIELDS:
        return position == "rope" and saved.model.rope_type == "yarn"
    if field == "rope_scaling_factor":
        return saved.model.use_rope_scaling
    if field == "window_attn_skip_freq":
        return saved.model.window_size is not None
    return True


def _value(config: Config, section: str, name: str):
    value = getattr(getattr(config, section), name)
    if name == "num_query_groups" and value is None:  # saved before grouped-query attention: one per head
        return config.model.num_attention_heads
    if name == "kv_channels":  # the width, given or implied (a checkpoint saved before the flag implies it)
        return config.model.head_dim
    if name == "add_qkv_bias":  # whether the QKV linear has one: redundant beside every linear's bias
        return config.model.qkv_bias
    if name == "moe_layer_freq":  # the layers it makes MoE: `1` and `[1,1]` at 2 layers are the same model
        try:
            return "[" + ",".join(map(str, moe_layer_list(value, config.model.num_layers))) + "]"
        except ConfigError:  # a pattern this parser refuses, saved by an older one: compared as written
            return value
    return value


def resume_differences(saved: Config, new: Config, saved_tokenizer_sha256: Optional[str] = None,
                       new_tokenizer_sha256: Optional[str] = None, fields=MODEL_FIELDS) -> List[str]:
    """Every one of `fields` (and the tokenizer) this run changes, as 'FLAG: checkpoint X, this run Y'."""
    problems = []
    for section, name in fields:
        if not _applies(name, saved) and not _applies(name, new):
            continue
        before, after = _value(saved, section, name), _value(new, section, name)
        if before != after:
            f = _field(section, name)
            problems.append(f"{flag_name(name)}: checkpoint {_as_written(f, before)}, this run {_as_written(f, after)}")
    if saved_tokenizer_sha256 and new_tokenizer_sha256 and saved_tokenizer_sha256 != new_tokenizer_sha256:
        d = new.data
        files = " ".join(f"{flag} {path}" for flag, path in (("--tokenizer-model", d.tokenizer_model),
                                                              ("--vocab-file", d.vocab_file),
                                                              ("--merge-file", d.merge_file)) if path)
        problems.append(f"{files.split(' ')[0]}: checkpoint trained with a model of SHA-256 "
                        f"{saved_tokenizer_sha256[:12]}..., this run's {files} {'are' if d.vocab_file else 'is'} "
                        f"{new_tokenizer_sha256[:12]}...")
    return problems


def _saved(load: str):
    """(tag folder, metadata, saved Config) of --load's checkpoint; None when it holds none yet."""
    from megatron_lite.checkpoint.format import CheckpointError, probe_load_dir
    from megatron_lite.validation.saved_config import checkpoint_config

    try:
        tag = probe_load_dir(load)
        if tag is None:
            return None
        metadata, saved = checkpoint_config(load, tag)  # the model it records, checked as every reader checks it
        return os.path.join(load, tag), metadata, saved
    except CheckpointError as e:
        raise ConfigError(str(e)) from None


def with_checkpoint_args(config: Config, given: Iterable[str]) -> Config:
    """--use-checkpoint-args: the model fields of --load's checkpoint, except those given as flags (`given`:
    `section__field` names), which the resume check then compares with the checkpoint; its tokenizer too
    unless a tokenizer flag is given."""
    load = config.training.load
    saved = _saved(load) if load else None
    if saved is None:
        raise ConfigError(f"--use-checkpoint-args takes the model flags from --load's checkpoint, but "
                          f"{'no --load was given' if not load else f'--load {load} holds no checkpoint'}; give "
                          f"--load CKPT (a convert_checkpoint.py import-hf output, or a --save folder)")
    model, data = saved[2].model, saved[2].data
    taken = {f"model__{name}": getattr(model, name) for name in CHECKPOINT_ARGS if f"model__{name}" not in given}
    if not any(f"data__{name}" in given for name in TOKENIZER_FIELDS):  # as Megatron-LM's: the one recorded
        taken.update({f"data__{name}": getattr(data, name) for name in TOKENIZER_FIELDS})
    return config.replace(**taken)


# The learning-rate schedule's flags: what a LambdaLR over training/optimizer.py's lr_at holds besides its step.
SCHEDULE_FIELDS = ("lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_decay_iters")
SCHEDULE_FLAG_NAMES = {"lr_decay_iters": "--lr-decay-iters (--train-iters when not given)"}


def schedule_on_resume(config: Config, saved: Config, where: str) -> Config:
    """A resume whose schedule flags differ from the checkpoint's takes one of them only when told which, as
    Megatron-LM asserts unless --override-opt-param-scheduler (this run's) or --use-checkpoint-opt-param-scheduler
    (the checkpoint's). Before this, the checkpoint's peak silently scaled this run's curve (measured: --lr 1e30 on
    a resume ran at lr 0, then 1.5e-5). --finetune never gets here: it starts a fresh schedule."""
    o = config.optimizer
    if o.override_opt_param_scheduler and o.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt-param-scheduler takes this run's learning-rate schedule and "
                          "--use-checkpoint-opt-param-scheduler the checkpoint's; give one of them")
    differences = [(name, getattr(saved.optimizer, name), getattr(o, name)) for name in SCHEDULE_FIELDS
                   if getattr(saved.optimizer, name) != getattr(o, name)]
    if not differences or o.override_opt_param_scheduler:
        return config
    if o.use_checkpoint_opt_param_scheduler:
        return config.replace(**{f"optimizer__{name}": before for name, before, _ in differences})
    listed = "; ".join(f"{SCHEDULE_FLAG_NAMES.get(name, '--' + name.replace('_', '-'))}: checkpoint {before}, "
                       f"this run {after}" for name, before, after in differences)
    raise ConfigError(f"--load {where} was trained on another learning-rate schedule ({listed}); add "
                      f"--override-opt-param-scheduler to continue on this run's, or "
                      f"--use-checkpoint-opt-param-scheduler to keep the checkpoint's")


def checkpoint_rules(config: Config, notes: List[str]) -> Config:
    load = config.training.load
    if config.training.finetune and not load:
        raise ConfigError("--finetune loads the weights of --load's checkpoint; give --load CKPT")
    if not load:
        return config
    from megatron_lite.data.sidecar import tokenizer_sha256

    found = _saved(load)
    if found is None:
        if config.training.finetune:
            raise ConfigError(f"--finetune: --load {load} holds no checkpoint to take the weights of")
        return config
    where, metadata, saved = found
    d = config.data  # the tokenizer section, which this one needs, found its files
    new_sha = tokenizer_sha256(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file)
    problems = resume_differences(saved, config, metadata.get("tokenizer_sha256"), new_sha)
    if problems:
        raise ConfigError(f"--load {where} was trained with another model ({'; '.join(problems)}): "
                          f"{_resume_advice(config.training.use_checkpoint_args)}")
    from megatron_lite.checkpoint.layout_free import storage_of

    from megatron_lite.checkpoint.format import weights_only

    if weights_only(metadata, config.training.finetune):
        if config.parallel.zero_stage >= 2:
            why = "--finetune" if config.training.finetune else "an imported model"
            raise ConfigError(f"--load {where} is loaded as weights only ({why}), which fills ZeRO 0 and 1 engines; "
                              f"use --zero-stage 0 or 1")
        return config

    if saved.optimizer.optimizer != config.optimizer.optimizer:  # Muon's matrices keep one buffer, AdamW's two
        raise ConfigError(f"--load {where} was trained with --optimizer {saved.optimizer.optimizer}, this run has "
                          f"--optimizer {config.optimizer.optimizer}: its optimizer states do not carry over; resume "
                          f"with --optimizer {saved.optimizer.optimizer}, or add --finetune to take its weights and "
                          f"start the optimizer fresh")
    config = schedule_on_resume(config, saved, where)
    problems = resume_differences(saved, config, fields=LAYOUT_FIELDS)
    stored_zero, stored_precision = storage_of(metadata)
    if stored_precision != config.precision.dtype_name:
        problems.append(f"precision: checkpoint {stored_precision}, this run {config.precision.dtype_name}")
    if problems and max(stored_zero, config.parallel.zero_stage) >= 2:
        raise ConfigError(f"--load {where} cannot be moved to this run: " + "; ".join(problems) +
                          f"; a checkpoint moves between layouts and precisions at ZeRO 0 and 1 only (this run: "
                          f"--zero-stage {config.parallel.zero_stage}, the checkpoint's files: ZeRO {stored_zero}); "
                          f"resume it with its own layout, ZeRO stage and precision")
    return config
