"""The numbers flags take: finite, whole where a count is meant, in range, checked before they are used.

One rule for every tool. `add_number(parser, "--vocab-size", int, minimum=1, default=32000)` gives argparse a
`type` that refuses nan, inf, a fraction or 1e30 where a count is meant, and a value out of range, saying what
works; argparse names the flag and exits 2 before the tool does anything:

    train_tokenizer.py: error: argument --vocab-size: must be at least 1, got 0; e.g. 32000

pretrain_gpt.py's numbers are config/ fields (their bounds in the field's metadata), checked by validation's
`number_rules` with the same `problem()`. A whole number is at most WHOLE_MAX unless its flag says otherwise.
Torch-free, at the bottom of the imports, like config/.
"""
from __future__ import annotations

import argparse
import math
import numbers
from typing import Callable, Optional

WHOLE_MAX = 2 ** 31 - 1
"""The largest count a flag takes unless it names its own maximum: C's int, which SentencePiece's options,
numpy's seeds and torch's sizes per dimension hold; a count past it is a typo, not a plan."""

GPU_MEMORY_GB_MAX = 1 << 16
"""--gpu-memory-gb at most: 64 TiB per device, past any accelerator; a larger value is a typo (MB for GB)."""


def shown(value) -> str:
    """A number as a refusal prints it: 1e-05, 10, not 1e-05 and 10.0."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def suggested_value(default, minimum=None):
    """The value a refusal suggests: the default (a list's first), else the least allowed, else 1."""
    if isinstance(default, (list, tuple)):
        default = default[0] if default else None
    return next(candidate for candidate in (default, minimum, 1) if candidate is not None)


def problem(value, whole: bool, minimum=None, maximum=None, above=None, below=None) -> Optional[str]:
    """Why `value` cannot be the flag's number ('must be at least 1'), or None. `minimum`/`maximum` are
    inclusive bounds, `above`/`below` exclusive ones."""
    if whole and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        return "must be a whole number"
    if not whole and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        return "must be a number"
    if not whole and not math.isfinite(value):
        return "must be a finite number"
    if above is not None and not value > above:
        return f"must be more than {shown(above)}"
    if minimum is not None and value < minimum:
        return f"must be at least {shown(minimum)}"
    if below is not None and not value < below:
        return f"must be less than {shown(below)}"
    top = maximum if maximum is not None else WHOLE_MAX if whole else None
    if top is not None and value > top:
        return f"must be at most {shown(top)}"
    return None


def number(kind: type, example, **bounds) -> Callable[[str], float]:
    """An argparse `type`: the text as an int or float within `bounds` (problem()'s), else ArgumentTypeError
    naming the value and `example`, a value that works."""
    whole = kind is int

    def parse(text: str):
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            value = text
        why = problem(value, whole, **bounds)
        if why:
            raise argparse.ArgumentTypeError(f"{why}, got {text}; e.g. {example}")
        return value

    parse.__name__ = kind.__name__  # argparse's own messages name the type
    return parse


def add_number(parser, *names: str, kind: type = int, minimum=None, maximum=None, above=None, below=None,
               example=None, **kwargs):
    """parser.add_argument(*names, type=number(...), **kwargs): the flag's default is the example a refusal
    gives, unless `example` says otherwise (a default of None)."""
    suggested = example if example is not None else suggested_value(kwargs.get("default"), minimum)
    bounds = dict(minimum=minimum, maximum=maximum, above=above, below=below)
    return parser.add_argument(*names, type=number(kind, suggested, **bounds), **kwargs)
