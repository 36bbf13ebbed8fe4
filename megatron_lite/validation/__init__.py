"""`validate(config)`: every rule, on the dataclasses, before any process group exists.

The sections run in order; each completes its own derived fields (DP size,
batch sizes, vocabulary, ...). A section whose inputs come from a section that
failed is skipped, every other one still runs, so one command line's
independent problems are reported together.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from megatron_lite.config import Config
from megatron_lite.validation.compile import compile_rules
from megatron_lite.validation.numerical_guard import numerical_guard_rules
from megatron_lite.validation.probes import data_rules, deepspeed_rules, tokenizer_matches_data, tokenizer_rules
from megatron_lite.validation.resume import checkpoint_rules
from megatron_lite.validation.moe import moe_pipeline_rules
from megatron_lite.validation.pipeline_schedule import pipeline_schedule_rules
from megatron_lite.validation.stragglers import straggler_rules
from megatron_lite.validation.watchdog import watchdog_rules
from megatron_lite.validation.rules import (
    batch_rules,
    logging_rules,
    muon_rules,
    optimizer_rules,
    precision_rules,
    training_rules,
)
from megatron_lite.validation.sections import MODEL_SECTIONS, Section, numbers_name, numbers_section, run_sections

# (name, rule, the sections it needs to have passed); a section comes after those it needs.
NUMBERS = {s: numbers_name(s) for s in ("model", "parallel", "batch", "optimizer", "precision", "data", "training",
                                        "logging", "numerical_guard", "watchdog")}
"""A rule per config section checking its numbers first (validation/numbers.py); every rule needs those of the
sections it reads, so it compares and divides values known to be finite and in range."""
_MODEL_RULES = MODEL_SECTIONS[2:]  # dependent flags, parallel, model (sections.py): after every section's numbers
SECTIONS: Tuple[Section, ...] = (
    *(numbers_section(section) for section in NUMBERS),
    *_MODEL_RULES,
    ("batch", batch_rules, ("parallel", NUMBERS["batch"])),
    ("pipeline-schedule", pipeline_schedule_rules, ("parallel", "model", "batch")),
    ("training", training_rules, (NUMBERS["training"],)),
    ("optimizer", optimizer_rules, (NUMBERS["optimizer"], NUMBERS["training"])),
    ("muon", muon_rules, ("parallel", "optimizer")),
    ("precision", precision_rules, (NUMBERS["precision"], NUMBERS["parallel"])),
    ("logging", logging_rules, (NUMBERS["logging"], NUMBERS["parallel"])),
    ("stragglers", straggler_rules, (NUMBERS["logging"], NUMBERS["parallel"])),
    ("tokenizer", tokenizer_rules, ("parallel", "model", NUMBERS["data"])),
    ("moe-pipeline", moe_pipeline_rules, ("parallel", "model", "precision", "tokenizer")),
    ("data", data_rules, ("batch", "training", NUMBERS["data"])),
    ("tokenizer-data", tokenizer_matches_data, ("tokenizer", "data")),
    ("deepspeed", deepspeed_rules, ("parallel", "model", "batch", "training", "optimizer", "precision")),
    ("checkpoint", checkpoint_rules, ("parallel", "model", "tokenizer")),
    ("compile", compile_rules, ("parallel", "model")),
    ("numerical-guard", numerical_guard_rules, (NUMBERS["numerical_guard"], NUMBERS["parallel"], NUMBERS["training"])),
    ("watchdog", watchdog_rules, (NUMBERS["watchdog"],)),
)


def validate(config: Config, world_size: Optional[int] = None) -> Tuple[Config, List[str]]:
    """The checked, completed config and the notes rank 0 prints; ConfigError lists every problem found."""
    return run_sections(config, SECTIONS, world_size)
