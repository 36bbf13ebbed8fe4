"""Split the GPT's layer specs into contiguous pipeline stages.

Each spec gets a cost. `cost`: forward FLOPs per token from the config alone
(no layer is built to count it), so the output head (2 h V plus the fp32
cross entropy) weighs what it computes and the embedding is not free.
`profile`: seconds of one forward + backward measured on the device
(cost/spec_profile.py). Both pick the boundaries that minimise the most
expensive stage, with at least one transformer layer per stage. `uniform`,
`parameters`, `type:<regex>` and explicit layer counts are there for users
coming from DeepSpeed and Megatron-DeepSpeed.

The costs themselves, and the bounds a config gets, are the cost model's (cost/stages.py); the GPT's
pipeline module (model/gpt.py) is handed the result as a `PipelineSplit`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Sequence

from megatron_lite.config import ConfigError


@dataclass(frozen=True)
class SpecCost:
    name: str
    """Class name of the layer, matched by `type:<regex>`."""
    flops: float
    """Forward FLOPs per token."""
    parameters: int
    """Parameters this layer holds (whole model, before TP splitting)."""
    is_transformer: bool
    """A transformer layer: every stage must hold at least one."""
    seconds: Optional[float] = None
    """Measured forward + backward time of one micro-batch (the `profile` method), if measured."""


@dataclass(frozen=True)
class PipelineSplit:
    """Where the GPT's pipeline module cuts its specs (cost/stages.py `pipeline_split` decides)."""
    bounds: List[int]
    """Stage i holds specs[bounds[i]:bounds[i + 1]]."""
    layers_per_stage: List[int]
    """Transformer layers on each stage (saved with a checkpoint to read its stage files back)."""
    table: str
    """The stage table rank 0 prints when the module is built."""


def layers_per_stage_uniform(num_layers: int, stages: int) -> List[int]:
    """Transformer layers per stage when split as evenly as possible (earlier stages take the extra)."""
    base, extra = divmod(num_layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def _balanced(costs: Sequence[float], transformer: Sequence[bool], stages: int) -> List[int]:
    """Stage boundaries (len stages + 1) that minimise the largest stage cost.

    Exact dynamic programme over contiguous splits: best[k][j] is the smallest
    possible maximum when the first j specs form k stages. Ties go to the
    split that puts earlier boundaries later, which keeps the lighter stages last.
    """
    n = len(costs)
    prefix = [0.0]
    layers = [0]
    for c, t in zip(costs, transformer):
        prefix.append(prefix[-1] + c)
        layers.append(layers[-1] + int(t))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(1, n + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf or layers[j] - layers[i] < 1:
                    continue
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value <= best[k][j]:
                    best[k][j], cut[k][j] = value, i
    if best[stages][n] == inf:
        raise ConfigError(f"cannot split {layers[-1]} transformer layers into {stages} stages with at least one each")
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def _from_layer_counts(specs: Sequence[SpecCost], counts: Sequence[int]) -> List[int]:
    """Boundaries that give stage s exactly counts[s] transformer layers; non-transformer
    specs stay with the transformer layer next to them (embedding first, head last)."""
    positions = [i for i, s in enumerate(specs) if s.is_transformer]
    bounds = [0]
    seen = 0
    for count in counts[:-1]:
        seen += count
        bounds.append(positions[seen - 1] + 1)
    bounds.append(len(specs))
    return bounds


PARTITION_METHODS = ("cost", "profile", "uniform", "parameters")


def check_partition_method(method: str, num_layers: int, stages: int,
                           flag: str = "--pipeline-partition-method") -> None:
    """ConfigError naming `flag` (the flag the user typed: convert_checkpoint's target flag, or training's)
    when `method` is none of the methods, a regular expression that does not compile, or layer counts that
    do not fit; checked before a layer is built."""
    example = ",".join(map(str, layers_per_stage_uniform(max(num_layers, stages), stages)))
    if method in PARTITION_METHODS:
        return
    if method.startswith("type:"):
        try:
            re.compile(method[len("type:"):])
        except re.error as e:
            raise ConfigError(f"{flag} {method} is not a regular expression after type: ({e}); e.g. "
                              f"type:ParallelTransformerLayer") from None
        return
    try:
        counts = [int(c) for c in method.split(",")]
    except ValueError:
        raise ConfigError(f"{flag} '{method}' is not one of {', '.join(PARTITION_METHODS)}, type:<regex>, or "
                          f"comma-separated layer counts like {example}") from None
    if len(counts) != stages or sum(counts) != num_layers or min(counts) < 1:
        raise ConfigError(f"{flag} {method} must list {stages} stage layer counts, each >= 1, summing to "
                          f"--num-layers {num_layers}; e.g. {example}")


def partition(specs: Sequence[SpecCost], stages: int, method: str = "cost") -> List[int]:
    """Stage boundaries: stage s holds specs[bounds[s]:bounds[s+1]]."""
    num_transformer = sum(s.is_transformer for s in specs)
    if num_transformer < stages:
        raise ConfigError(f"--num-layers {num_transformer} is smaller than --pipeline-model-parallel-size {stages}",
                          code="layers_fewer_than_stages")
    if method == "cost":
        bounds = _balanced([s.flops for s in specs], [s.is_transformer for s in specs], stages)
    elif method == "profile":
        if any(s.seconds is None for s in specs):
            raise ValueError("the profile method needs measured seconds for every spec (cost/spec_profile.py)")
        bounds = _balanced([s.seconds for s in specs], [s.is_transformer for s in specs], stages)
    elif method == "parameters":
        bounds = _balanced([float(s.parameters) for s in specs], [s.is_transformer for s in specs], stages)
    elif method == "uniform":
        bounds = _from_layer_counts(specs, layers_per_stage_uniform(num_transformer, stages))
    elif method.startswith("type:"):
        pattern = re.compile(method[len("type:"):], re.IGNORECASE)
        weights = [1.0 if pattern.search(s.name) else 0.0 for s in specs]
        if not any(weights):
            raise ConfigError(f"--pipeline-partition-method {method} matches no layer; layer names: "
                              f"{', '.join(sorted({s.name for s in specs}))}")
        bounds = _balanced(weights, [s.is_transformer for s in specs], stages)
    else:
        check_partition_method(method, num_transformer, stages)
        bounds = _from_layer_counts(specs, [int(c) for c in method.split(",")])
    return bounds

