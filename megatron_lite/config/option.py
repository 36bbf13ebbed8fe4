"""option(): a config field set by a command-line flag (`arguments.py` builds the parser from these), and Needs:
what a flag needs to act at all (validation/dependent_flags.py refuses it without)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Needs:
    """A flag acts only while the field at `path` ("model.num_experts") holds `holds`; without, it is refused:
    "<the flags given> <says>; add <add> or drop it/them" (flags failing the same Needs are named together)."""
    path: str
    holds: Callable[[Any], bool]
    says: str
    add: str
    code: str = "flag_without_what_it_needs"
    """ConfigError's code, for tools that sort refusals (the tuning planner's)."""


def given(value: Any) -> bool:
    """A field whose default None means "not given" was given."""
    return value is not None


def equals(expected: Any) -> Callable[[Any], bool]:
    return lambda value: value == expected


def differs_from(other: Any) -> Callable[[Any], bool]:
    return lambda value: value != other


def option(default: Any, flag: str, **cli: Any) -> Any:
    """A field set by `flag` (Megatron-LM's name). `cli` holds what argparse needs beyond the
    field's type: action (store_true is implied for a bool defaulting to False; store_false and
    boolean_optional), choices, nargs, metavar, aliases, and parse / unparse (flag values <->
    field value) for fields whose syntax is richer than one value; and a number's range, as
    flag_numbers.problem() takes it: minimum / maximum (inclusive), above / below (exclusive),
    which validation's number_rules checks for every value, from a flag or from code; and `needs`,
    a tuple of Needs checked in order (a later one only where the earlier ones hold) whenever the field
    differs from its default."""
    return field(default=default, metadata={"flag": flag, **cli})
