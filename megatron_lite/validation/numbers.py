"""Every number of a Config finite, whole where a count is meant, and in its field's range: one rule for all.

The range is the field's (config/: `option(..., minimum=1)`), the check flag_numbers.problem(), the one
the tools' own flags use; a whole number is at most flag_numbers.WHOLE_MAX unless its field says otherwise.
It runs before every other section, which then compare and divide numbers known to be sane: a NaN passes
every `<` test, and 1e15 minutes overflows timedelta after the process group exists.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megatron_lite.config import Config, ConfigError, flag_fields
from megatron_lite.flag_numbers import problem, shown, suggested_value

BOUNDS = ("minimum", "maximum", "above", "below")


def _kinds(section: str, field: dataclasses.Field):
    """The field's number type (int or float), and whether it holds a tuple of them; (None, False) for a
    field that is not a number (a path, a choice, the data path's nested pairs)."""
    owner = next(f.default_factory for f in dataclasses.fields(Config) if f.name == section)
    hint = typing.get_type_hints(owner)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        hint = args[0]
    if hint in (int, float):
        return hint, False
    if typing.get_origin(hint) is tuple:
        inner = set(typing.get_args(hint)) - {Ellipsis}
        if len(inner) == 1 and next(iter(inner)) in (int, float):
            return next(iter(inner)), True
    return None, False


def numbers_of(section: str) -> Callable[[Config, List[str]], Config]:
    """number_rules for one config section: validation runs one per section, so a bad number skips only the
    rules that read that section, and the others still report their own problems."""
    def rule(config: Config, notes: List[str]) -> Config:
        return number_rules(config, notes, (section,))

    rule.__name__ = f"number_rules[{section}]"
    return rule


def bounds_of(field: dataclasses.Field) -> dict:
    """The field's range, as flag_numbers.problem() takes it."""
    return {k: field.metadata[k] for k in BOUNDS if k in field.metadata}


def example_of(field: dataclasses.Field, bounds: dict):
    """A value that works, for a refusal to suggest: the default, else the least allowed."""
    return suggested_value(field.default, bounds.get("minimum"))


@functools.lru_cache(maxsize=None)
def _number_fields() -> Tuple[Tuple[str, dataclasses.Field, type, bool, Dict[str, Any]], ...]:
    """(section, field, int or float, holds a tuple, its bounds) of every numeric flag field, worked out once:
    the planner validates thousands of candidate configs, and type hints cost milliseconds each."""
    table = []
    for section, field in flag_fields():
        kind, many = _kinds(section, field)
        if kind is not None:
            table.append((section, field, kind, many, bounds_of(field)))
    return tuple(table)


def number_rules(config: Config, notes: List[str], sections: Optional[Sequence[str]] = None) -> Config:
    """ConfigError naming each flag (of `sections`, default all) whose value is not a finite number in its
    range, with a value that works."""
    problems = []
    for section, field, kind, many, bounds in _number_fields():
        if sections is not None and section not in sections:
            continue
        value = getattr(getattr(config, section), field.name)
        if value is None:
            continue
        if many and not isinstance(value, (tuple, list)):  # a saved config's field of the wrong kind ("abc")
            problems.append(f"{field.metadata['flag']} takes {'whole ' if kind is int else ''}numbers, got {value!r}")
            continue
        for item in (value if many else (value,)):
            if kind is float and isinstance(item, int) and not isinstance(item, bool):
                item = float(item)  # code may write lr=1 for 1.0
            why = problem(item, kind is int, **bounds)
            if why:
                problems.append(f"{field.metadata['flag']} {why}, got {shown(item)}; e.g. "
                                f"{shown(example_of(field, bounds))}")
                break
    if len(problems) == 1:
        raise ConfigError(problems[0], code="number_out_of_range")
    if problems:
        raise ConfigError(f"{len(problems)} problems:\n" + "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, 1)),
                          codes=["number_out_of_range"] * len(problems))
    return config
