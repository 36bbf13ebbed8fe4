"""Flag values richer than one number or word: their parsers (flag text -> field value) and formatters
(field value -> flag text), and the vocabulary padding the --make-vocab-size-divisible-by flag asks for."""
from __future__ import annotations

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


def parse_moe_layer_freq(text: str) -> Tuple[str, Optional[Tuple[int, ...]]]:
    """--moe-layer-freq's syntax -> (its canonical text, the pattern or None for an int N). An int N >= 1, or a
    pattern of 0s and 1s: a list [0,1,1] or Megatron-LM's ([0]*1+[1]*5) (list literals of 0/1 joined by +, each
    optionally times a count); parsed, never evaluated as code."""
    body = text.replace(" ", "")
    if body.isdigit() and int(body) >= 1:
        return body, None
    if body.startswith("(") and body.endswith(")"):
        body = body[1:-1]
    pattern: List[int] = []
    for term in body.split("+") if body else [""]:
        items, _, times = term.partition("]*")
        if not items.startswith("[") or (times and not times.isdigit()):
            pattern = []
            break
        if not times:
            items = items.rstrip("]")
        values = items[1:].split(",")
        if not all(v in ("0", "1") for v in values):
            pattern = []
            break
        pattern += [int(v) for v in values] * (int(times) if times else 1)
    if not pattern:
        raise ConfigError(f"--moe-layer-freq '{text}' must be an integer N >= 1 (every N-th layer is MoE) or a "
                          f"pattern of 0 (dense) and 1 (MoE) per layer like ([0]*1+[1]*3) or [0,1,1,1]")
    return text.replace(" ", ""), tuple(pattern)


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
