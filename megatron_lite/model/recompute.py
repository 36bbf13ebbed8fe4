"""Full activation recompute: which transformer layers of a stage run under checkpoint, and running them.

--recompute-granularity full, with Megatron-LM's methods, over each pipeline stage's transformer layers
(a stage's layers are consecutive; N = --recompute-num-layers; the chunks: model/recompute_options.py):
  uniform  the layers in chunks of N from the stage's first (the last chunk may be shorter); each chunk
           keeps only its input and runs again in backward
  block    the first N layers each keep only their input and run again in backward; the rest keep
           their activations
Recompute draws the forward's dropout masks again (parallel/random.py `checkpoint`). Selective
recompute is inside the attention (model/attention.py).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from megatron_lite.config import ModelConfig
from megatron_lite.model.recompute_options import recompute_chunks
from megatron_lite.model.transformer import TransformerLayer
from megatron_lite.parallel.random import checkpoint


def _run(functions: Sequence[Callable]) -> Callable:
    def run(x):
        for fn in functions:
            x = fn(x)
        return x
    return run


def run_stage(functions: Sequence[Callable], x, model: ModelConfig):
    """x through a stage's layer functions in order (the embedding takes the (tokens, positions)
    tuple), the transformer layers recomputed as --recompute-granularity full says."""
    layers = [i for i, fn in enumerate(functions) if isinstance(fn, TransformerLayer)]
    if model.recompute_granularity != "full" or not layers or not torch.is_grad_enabled():
        return _run(functions)(x)
    first, last = layers[0], layers[-1] + 1
    x = _run(functions[:first])(x)
    for start, end, again in recompute_chunks(model.recompute_method, model.recompute_num_layers, len(layers)):
        chunk = _run(functions[first + start:first + end])
        x = checkpoint(chunk, x) if again else chunk(x)
    return _run(functions[last:])(x)
