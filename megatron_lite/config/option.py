"""option(): a config field set by a command-line flag (`arguments.py` builds the parser from these)."""
from __future__ import annotations

from dataclasses import field
from typing import Any


def option(default: Any, flag: str, **cli: Any) -> Any:
    """A field set by `flag` (Megatron-LM's name). `cli` holds what argparse needs beyond the
    field's type: action (store_true is implied for a bool defaulting to False; store_false and
    boolean_optional), choices, nargs, metavar, aliases, and parse / unparse (flag values <->
    field value) for fields whose syntax is richer than one value; and a number's range, as
    flag_numbers.problem() takes it: minimum / maximum (inclusive), above / below (exclusive),
    which validation's number_rules checks for every value, from a flag or from code."""
    return field(default=default, metadata={"flag": flag, **cli})
