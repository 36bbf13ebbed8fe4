"""Numbers read from a Hugging Face config.json: whole where a count is meant, finite, in range, refused by name.

A config.json is text anyone can edit, and JSON has no integer type of its own: `"num_attention_heads": 0`,
`"num_hidden_layers": Infinity` (Python's json reads it) or `"rms_norm_eps": NaN` would reach a division
or int() before validation sees them. hf_gpt2.py, hf_llama.py and hf_qwen3.py read every number through these,
so each such value is one line naming the file and the field, with the rule from flag_numbers.problem() that
the flags use:

    hf/config.json: num_attention_heads = 0 must be at least 1
"""
from __future__ import annotations

import json
from typing import Any

from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.flag_numbers import problem

REQUIRED = object()


def as_json(value: Any) -> str:
    """A config.json value as the file spells it (true, null, ["a"], NaN), not as Python does (True, None, ['a'])."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


def refusal(where: str, key: str, value: Any, why: str) -> CheckpointError:
    """The one line refusing config.json's `key`: `hf/config.json: num_attention_heads = 0 must be at least 1`."""
    return CheckpointError(f"{where}: {key} = {as_json(value)} {why}")


def _value(c: dict, key: str, default: Any) -> Any:
    if key in c and c[key] is not None:
        return c[key]
    if default is REQUIRED:
        raise KeyError(key)
    return default


def whole(c: dict, key: str, where: str, default: Any = REQUIRED, minimum: int = 1) -> int:
    """c[key] as a count (a float that is a whole number, as some exporters write, is taken)."""
    value = _value(c, key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    why = problem(value, True, minimum=minimum)
    if why:
        raise refusal(where, key, value, why)
    return value


def real(c: dict, key: str, where: str, default: Any = REQUIRED, minimum=None, above=None, maximum=None,
         below=None) -> float:
    """c[key] as a finite number within the bounds."""
    value = _value(c, key, default)
    why = problem(value, False, minimum=minimum, above=above, maximum=maximum, below=below)
    if why:
        raise refusal(where, key, value, why)
    return float(value)


def refuse_gpt_oss_parts(m, architecture: str) -> None:
    """An architecture without gpt-oss's attention sinks and clamped, offset, quick-GeLU-gated MLP cannot hold a model
    built with them: say which flags (GptOssForCausalLM holds them)."""
    given = [flag for flag, on in (("--softmax-type " + m.softmax_type, m.softmax_type != "vanilla"),
                                   ("--quick-geglu", m.quick_geglu),
                                   (f"--glu-linear-offset {m.glu_linear_offset:g}", m.glu_linear_offset != 0.0),
                                   (f"--activation-func-clamp-value {m.activation_func_clamp_value}",
                                    m.activation_func_clamp_value is not None)) if on]
    if given:
        raise CheckpointError(f"{architecture} has no place for {', '.join(given)}: this model was built with them "
                              f"(gpt-oss's; export it as GptOssForCausalLM)")
