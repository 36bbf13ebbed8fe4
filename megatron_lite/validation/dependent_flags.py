"""Flags that act only with another (`needs=` beside the flag in config/, option.py Needs): given without it they
would do nothing and say nothing (--moe-router-topk 3 without --num-experts trains a dense model), so they are
refused in one line naming them and what to add.

A flag counts as given when its field differs from the dataclass default: the validated Config does not know what
was typed, and a flag typed at its default changes nothing. This runs before any rule completes a field.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List

from megatron_lite.config import Config, ConfigError, flag_fields
from megatron_lite.config.option import Needs


def _at(config: Config, path: str) -> Any:
    section, name = path.split(".")
    return getattr(getattr(config, section), name)


def _given(f: dataclasses.Field, value: Any) -> str:
    """The flag as it would be typed for `value`: a switch alone, a value after its flag."""
    meta = f.metadata
    if isinstance(f.default, bool):
        return "--no-" + meta["flag"][2:] if meta.get("action") == "boolean_optional" and not value else meta["flag"]
    if "unparse" in meta:
        return " ".join([meta["flag"], *meta["unparse"](value)])
    return f"{meta['flag']} {value:g}" if isinstance(value, float) else f"{meta['flag']} {value}"


def dependent_flag_rules(config: Config, notes: List[str]) -> Config:
    """Every flag given without what its Needs ask for; flags failing the same Needs are named together, and the
    first such group is the one line raised."""
    failing: Dict[Needs, List[str]] = {}
    for section, f in flag_fields():
        needs = f.metadata.get("needs", ())
        value = getattr(getattr(config, section), f.name)
        if not needs or value == f.default:
            continue
        unmet = next((n for n in needs if not n.holds(_at(config, n.path))), None)
        if unmet is not None:
            failing.setdefault(unmet, []).append(_given(f, value))
    if failing:
        needs, given = next(iter(failing.items()))
        them = "them" if len(given) > 1 else "it"
        raise ConfigError(f"{', '.join(given)} {needs.says}; add {needs.add} or drop {them}", code=needs.code)
    return config
