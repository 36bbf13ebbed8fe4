"""Measured cost of each layer spec: one forward + backward at the real micro-batch shape.

FLOP counts misprice layers whose parts are memory-bound (attention's softmax,
the head's fp32 logits and cross entropy), and differently on every device.
So `--pipeline-partition-method profile` times one module of each distinct
spec kind on this rank's device and the partitioner splits on those times.
TP layers run their collectives inside, so every rank of the job must profile
together; the caller makes the ranks agree on one rank's numbers.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, List, Sequence

import torch

from megatron_lite.parallel.random import get_rng_tracker, model_parallel_seed


def _kind(spec) -> str:
    forward_fn = getattr(spec, "forward_fn", None)
    return spec.typename.__name__ + ("" if forward_fn is None else f".{forward_fn.__name__}")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_spec_seconds(specs: Sequence, loss_fn: Callable, micro_batch_size: int, seq_length: int,
                         hidden_size: int, vocab_size: int, seed: int, num_layers: int,
                         device: torch.device, repeats: int = 5, sequence_shards: int = 1) -> List[float]:
    """Median seconds of forward + backward for every spec (specs of one kind share a number).

    The first spec takes (tokens, position ids), the last one's output goes through loss_fn,
    every other one maps hidden states [b, s, h] to [b, s, h] ([b, s / sequence_shards, h]
    under sequence parallelism). Random generators are left as they were.
    """
    b, s, h = micro_batch_size, seq_length, hidden_size
    tokens = torch.randint(0, vocab_size, (b, s), device=device, generator=torch.Generator(device).manual_seed(0))
    positions = torch.arange(s, device=device).expand(b, s).contiguous()
    labels_and_mask = (tokens, torch.ones(b, s, device=device))
    seconds = {}
    tracker_states = get_rng_tracker().get_states()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model_parallel_seed(seed, num_layers)  # dropout streams, so the layers run as in training
        for i, spec in enumerate(specs):
            kind = (_kind(spec), i == 0, i == len(specs) - 1)
            if kind in seconds:
                continue
            module = spec.build().to(device)
            forward_fn = getattr(spec, "forward_fn", None)

            def step():
                if i == 0:
                    out = module((tokens, positions)) if forward_fn is None else forward_fn(module, (tokens, positions))
                else:
                    x = torch.randn(b, s // sequence_shards, h, device=device, requires_grad=True)
                    out = module(x) if forward_fn is None else forward_fn(module, x)
                if i == len(specs) - 1:
                    # The head's tokens: all of them, or a context-parallel rank's part.
                    out = loss_fn(out, tuple(t[:, :out.shape[1]] for t in labels_and_mask))
                out.float().sum().backward()

            step()  # warm-up: allocations, kernel selection
            times = []
            for _ in range(repeats):
                _synchronize(device)
                start = time.perf_counter()
                step()
                _synchronize(device)
                times.append(time.perf_counter() - start)
            seconds[kind] = statistics.median(times)
            del module
    get_rng_tracker().reset()
    get_rng_tracker().set_states(tracker_states)
    return [seconds[(_kind(spec), i == 0, i == len(specs) - 1)] for i, spec in enumerate(specs)]
