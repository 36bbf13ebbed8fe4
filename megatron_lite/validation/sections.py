"""How validation runs its sections, and the sections that say what a model is.

A section is (name, rule, the sections it needs to have passed); `run_sections` runs a table of them in order,
skips a section whose needs failed, and reports every other problem together. validate() runs every section
(validation/__init__.py); a reader of a checkpoint runs MODEL_SECTIONS on the config the checkpoint records
(validation/saved_config.py): the same rules pretrain_gpt.py ran on its flags, without those that read files of the
machine that trained (data, tokenizer, --load) or say how that run trained.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron_lite.config import Config, ConfigError
from megatron_lite.validation.dependent_flags import dependent_flag_rules
from megatron_lite.validation.numbers import numbers_of
from megatron_lite.validation.rules import model_rules, parallel_rules

Rule = Callable[[Config, List[str]], Config]
Section = Tuple[str, Rule, Tuple[str, ...]]


def numbers_name(section: str) -> str:
    """The name of the rule checking one config section's numbers, which other sections name as needed."""
    return f"numbers of {section}"


def numbers_section(section: str) -> Section:
    """The rule checking one config section's numbers (validation/numbers.py)."""
    return numbers_name(section), numbers_of(section), ()


MODEL_SECTIONS: Tuple[Section, ...] = (
    numbers_section("model"),
    numbers_section("parallel"),
    ("dependent-flags", dependent_flag_rules, ()),  # before any rule completes a field it compares to its default
    ("parallel", parallel_rules, (numbers_name("parallel"), numbers_name("model"))),
    ("model", model_rules, ("parallel",)),
)


def run_sections(config: Config, table: Sequence[Section],
                 world_size: Optional[int] = None) -> Tuple[Config, List[str]]:
    """The checked, completed config and the notes rank 0 prints; ConfigError lists every problem found."""
    if world_size is not None:
        config = config.replace(parallel__world_size=world_size)
    notes: List[str] = []
    failed: Dict[str, Optional[ConfigError]] = {}  # section -> its error, or None when skipped
    for name, rule, needs in table:
        if any(n in failed for n in needs):
            failed[name] = None
            continue
        try:
            config = rule(config, notes)
        except ConfigError as e:
            failed[name] = e
    problems = [error for error in failed.values() if error]
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigError(f"{len(problems)} problems:\n" + "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, 1)),
                          codes=[code for p in problems for code in p.codes])
    return config, notes
