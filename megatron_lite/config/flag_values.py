"""Flag values richer than one number or word: their parsers (flag text -> field value) and formatters
(field value -> flag text), and the vocabulary padding the --make-vocab-size-divisible-by flag asks for."""
from __future__ import annotations

import re
from typing import List, Optional, Sequence, Tuple

from megatron_lite.config.errors import ConfigError


def parse_data_path(values: Optional[Sequence[str]]) -> Tuple[Tuple[float, str], ...]:
    """`prefix` -> ((1.0, prefix),); `w1 p1 w2 p2` -> ((w1, p1), (w2, p2)). Syntax only: the
    weights' values and the files are checked by validation."""
    if not values:
        return ()
    if len(values) == 1:
        return ((1.0, values[0]),)
    if len(values) % 2:
        raise ConfigError(
            f"--data-path takes one prefix or weight/prefix pairs like '0.3 prefixA 0.7 prefixB'; "
            f"got {len(values)} values: {' '.join(values)}"
        )
    pairs = []
    for weight, prefix in zip(values[0::2], values[1::2]):
        try:
            pairs.append((float(weight), prefix))
        except ValueError:
            raise ConfigError(f"--data-path weight '{weight}' (before '{prefix}') is not a number") from None
    return tuple(pairs)


def format_data_path(data_path: Tuple[Tuple[float, str], ...]) -> List[str]:
    """Inverse of parse_data_path."""
    if len(data_path) == 1 and data_path[0][0] == 1.0:
        return [data_path[0][1]]
    return [text for weight, prefix in data_path for text in (repr(float(weight)), prefix)]


def parse_split(split: str) -> Tuple[float, float, float]:
    """Megatron-style '969,30,1' (or '969/30/1') -> (969.0, 30.0, 1.0); missing parts are 0."""
    parts = split.replace("/", ",").split(",")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--split '{split}' must be up to three comma-separated numbers, e.g. 969,30,1") from None
    if len(weights) > 3:
        raise ConfigError(f"--split '{split}' must be up to three non-negative numbers with a positive sum, "
                          f"e.g. 969,30,1")
    return tuple(weights + [0.0] * (3 - len(weights)))


def parse_window_size(text: str) -> Tuple[int, int]:
    """Megatron-LM's --window-size 'L,R' (a token sees the L tokens before it, itself, and R after it) or 'L'
    (= 'L,0') -> (L, R). Syntax only: the values are validation's."""
    parts = text.split(",")
    try:
        window = tuple(int(p) for p in parts)
    except ValueError:
        window = ()
    if len(window) not in (1, 2):
        raise ConfigError(f"--window-size '{text}' must be L or L,R (tokens seen before and after a token), e.g. "
                          f"127,0 for a 128-token causal window")
    return window if len(window) == 2 else (window[0], 0)


MOE_LAYERS_MAX = 10 ** 6
"""The most layers a --moe-layer-freq pattern may describe (and the largest N): checked on the counts, before a
list is built, so ([0]*99999999999+[1]) is refused instead of allocated."""
_LIST = r"\[[01](?:,[01])*\]"
_TERM = re.compile(rf"({_LIST})(?:\*([0-9]{{1,12}}))?", re.ASCII)
_SUM = re.compile(rf"{_LIST}(?:\*[0-9]{{1,12}})?(?:\+{_LIST}(?:\*[0-9]{{1,12}})?)*", re.ASCII)


def parse_moe_layer_freq(text: str) -> Tuple[str, Optional[Tuple[int, ...]]]:
    """--moe-layer-freq's syntax -> (its canonical text, the pattern or None for an int N). Two forms and nothing
    else: an integer N >= 1 (every N-th layer from the first), or one 0 (dense) or 1 (MoE) per layer, as a list
    [0,1,1] or Megatron-LM's sum of lists times counts ([0]*1+[1]*5) (parentheses optional). ASCII digits only;
    parsed, never evaluated as code, and its length checked before the pattern is built."""
    body = text.replace(" ", "")
    shown = body if len(body) <= 60 else body[:57] + "..."
    forms = (f"--moe-layer-freq '{shown}' must be an integer N >= 1 (every N-th layer is MoE) or a pattern of "
             f"0 (dense) and 1 (MoE) per layer like ([0]*1+[1]*3) or [0,1,1,1]")
    if re.fullmatch(r"[0-9]{1,12}", body, re.ASCII):
        if not 1 <= int(body) <= MOE_LAYERS_MAX:
            raise ConfigError(forms if int(body) < 1 else f"{forms}; N is at most {MOE_LAYERS_MAX}")
        return body, None
    inner = body[1:-1] if body.startswith("(") and body.endswith(")") else body
    if not _SUM.fullmatch(inner):
        raise ConfigError(forms)
    terms = [(items[1:-1].split(","), int(count) if count else 1) for items, count in _TERM.findall(inner)]
    layers = sum(len(items) * count for items, count in terms)
    if not 1 <= layers <= MOE_LAYERS_MAX:
        raise ConfigError(f"{forms}; this one describes {layers} layers (at most {MOE_LAYERS_MAX})")
    return body, tuple(int(v) for items, count in terms for v in items * count)


def moe_layer_list(text: str, num_layers: int) -> Tuple[int, ...]:
    """The layers --moe-layer-freq `text` makes MoE at `num_layers` layers (1: MoE, 0: dense), whichever form it
    is written in: how two patterns are compared (a resume's `1` and `[1,1]` at 2 layers are the same model)."""
    _, pattern = parse_moe_layer_freq(text)
    if pattern is None:  # every N-th layer from the first, as Megatron-LM's int form
        every = int(text.replace(" ", ""))
        return tuple(int(i % every == 0) for i in range(num_layers))
    return pattern


def format_window_size(window: Tuple[int, int]) -> List[str]:
    return [f"{window[0]},{window[1]}"]


def format_split(split: Tuple[float, ...]) -> str:
    """(969.0, 30.0, 1.0) -> '969,30,1', as the user wrote it."""
    return ",".join(f"{w:g}" for w in split)


def pad_vocab_size(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Smallest multiple of divisible_by x TP that holds vocab_size, so every TP rank owns an equal slice."""
    multiple = divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def vocab_padding_note(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> Optional[str]:
    """The line rank 0 logs when padding changes the vocabulary, else None."""
    padded = pad_vocab_size(vocab_size, divisible_by, tensor_model_parallel_size)
    if padded == vocab_size:
        return None
    return (f"vocabulary {vocab_size} padded to {padded} (multiple of --make-vocab-size-divisible-by "
            f"{divisible_by} x TP {tensor_model_parallel_size})")
