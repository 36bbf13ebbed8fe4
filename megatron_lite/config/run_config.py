"""Config: the whole run's configuration, one dataclass per section; and the flag of every field."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Tuple

from megatron_lite.config.errors import ConfigError
from megatron_lite.config.model import ModelConfig
from megatron_lite.config.numerical_guard import NumericalGuardConfig
from megatron_lite.config.watchdog import WatchdogConfig
from megatron_lite.config.sections import (BatchConfig, DataConfig, LoggingConfig, OptimizerConfig, ParallelConfig,
                                           PrecisionConfig, TrainingConfig)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape and regularisation."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP / PP / DP degrees and ZeRO."""
    batch: BatchConfig = field(default_factory=BatchConfig)
    """Micro-batch, gradient accumulation and global batch."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW and the learning-rate schedule."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """fp32 / bf16 / fp16 and loss scaling."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and tokenizer."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Iterations, evaluation, checkpoints, seed."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Console, TensorBoard and metrics records."""
    numerical_guard: NumericalGuardConfig = field(default_factory=NumericalGuardConfig)
    """NaN/Inf checks of each rank's loss and gradients, skipped updates, fault injection."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Per-phase progress timeouts watched from outside the ranks (training/watchdog.py)."""

    def replace(self, **sections) -> "Config":
        """A copy with whole sections or `section__field=value` entries replaced."""
        updates = {}
        for key, value in sections.items():
            if "__" in key:
                section, name = key.split("__", 1)
                base = updates.get(section, getattr(self, section))
                updates[section] = dataclasses.replace(base, **{name: value})
            else:
                updates[key] = value
        return dataclasses.replace(self, **updates)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Config":
        """Inverse of to_dict (e.g. a checkpoint's saved config); JSON lists become tuples again."""
        sections = {}
        for f in dataclasses.fields(cls):
            section_cls = f.default_factory  # every section field has its dataclass as factory
            known = {g.name for g in dataclasses.fields(section_cls)}
            saved = {RENAMED_FIELDS.get(k, k): v for k, v in data.get(f.name, {}).items()}
            values = {k: _tuples(v) for k, v in saved.items() if k in known}
            sections[f.name] = section_cls(**values)
        return cls(**sections)


RENAMED_FIELDS = {"layernorm_epsilon": "norm_epsilon"}
"""Field names of configs saved by earlier versions (checkpoints) -> today's names."""


def flag_fields() -> Iterator[Tuple[str, dataclasses.Field]]:
    """(section name, field) of every field a flag sets, in declaration order."""
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory):
            if "flag" in f.metadata:
                yield section.name, f


def flag_for(name: str) -> str:
    """A field's flag by field name (unique over the sections): micro_batch_size -> --micro-batch-size;
    a field without a flag (a derived one) gets its name in flag form."""
    for _, f in flag_fields():
        if f.name == name:
            return f.metadata["flag"]
    return "--" + name.replace("_", "-")


def _tuples(value):
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def require_vocab(config: Config) -> ModelConfig:
    """The model config, once it has a vocabulary size: no layer can be built or counted without one."""
    model = config.model
    if model.padded_vocab_size is None:
        raise ConfigError("the model needs a vocabulary size: give --vocab-size N or a --tokenizer-model")
    return model
