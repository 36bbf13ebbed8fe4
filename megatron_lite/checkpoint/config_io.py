"""A run's `Config` from the dict saved in megatron_lite.json (dataclasses.asdict of it)."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict

from megatron_lite.config import Config


def _section(cls, values: Dict[str, Any]):
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        if name not in known:  # a field from a newer version of the package: not ours to interpret
            continue
        kwargs[name] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


def config_from_dict(values: Dict[str, Any]) -> Config:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    kwargs = {}
    for name, field in sections.items():
        if name in values:
            cls = type(getattr(Config(), name))
            kwargs[name] = _section(cls, values[name])
    return Config(**kwargs)
