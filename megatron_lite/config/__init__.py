"""Typed, immutable run configuration: data, no rules; and the one source of every flag.

Each field set from the command line carries its Megatron-LM flag name (and, where
argparse needs more than the type, its action, choices or nargs) in its metadata,
and its docstring is the flag's help: `arguments.py` builds the parser from these
dataclasses, so a new flag is a new field with `option(...)` and a docstring.
Fields without a flag are derived by validation or come from the launcher.

Code (tests, benchmarks, the tuning planner) builds these dataclasses directly.
Either way a `Config` is checked and completed by `megatron_lite.validation.validate()`,
which fills the fields documented as derived and refuses inconsistent ones.

The package: errors.py (ConfigError), option.py (option), flag_values.py (the flags' value parsers and
formatters), model.py (ModelConfig, from the sections in model_core.py, model_positions.py,
model_attention.py and model_moe.py), sections.py (the other sections), run_config.py (Config, flag_fields,
flag_for, require_vocab). It imports nothing of megatron_lite outside itself.
"""
from megatron_lite.config.errors import ConfigError
from megatron_lite.config.flag_values import (format_data_path, format_split, format_window_size, pad_vocab_size,
                                              parse_data_path, parse_moe_layer_freq, parse_split, parse_window_size,
                                              vocab_padding_note)
from megatron_lite.config.model import ModelConfig
from megatron_lite.config.model_core import NORMALIZATIONS
from megatron_lite.config.option import option
from megatron_lite.config.run_config import RENAMED_FIELDS, Config, flag_fields, flag_for, require_vocab
from megatron_lite.config.sections import (LOG_LEVELS, TIMEOUT_MINUTES_MAX, TOKENIZER_TYPES, BatchConfig, DataConfig,
                                           LoggingConfig, OptimizerConfig, ParallelConfig, PrecisionConfig,
                                           TrainingConfig)

__all__ = [
    "BatchConfig", "Config", "ConfigError", "DataConfig", "LOG_LEVELS", "LoggingConfig", "ModelConfig", "NORMALIZATIONS",
    "OptimizerConfig", "ParallelConfig", "PrecisionConfig", "RENAMED_FIELDS", "TIMEOUT_MINUTES_MAX", "TOKENIZER_TYPES",
    "TrainingConfig", "flag_fields", "flag_for", "format_data_path", "format_split", "format_window_size", "option",
    "pad_vocab_size", "parse_data_path", "parse_moe_layer_freq", "parse_split", "parse_window_size",
    "require_vocab", "vocab_padding_note",
]
