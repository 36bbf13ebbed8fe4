"""Random streams for tensor parallelism, and activation recompute that replays them.

Two streams per process:
  default generator(s)   seed, identical on every TP rank: dropout on replicated
                          activations (residual stream, embeddings) agrees across ranks
  'model-parallel-rng'    seed + 2718 + tp_rank: dropout on split activations
                          (attention probabilities of this rank's heads) differs per rank,
                          as it would for different heads at TP = 1
The tracker keeps the second stream's state aside and swaps it in inside
`get_rng_tracker().fork()`. Each state is the CPU generator's plus, when CUDA
is available, the current device's generator's.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional, Tuple

import torch
import torch.utils.checkpoint

from megatron_lite.parallel.tp import tp_rank

MODEL_PARALLEL_RNG = "model-parallel-rng"
MODEL_PARALLEL_SEED_OFFSET = 2718

RNGState = Tuple[torch.Tensor, Optional[torch.Tensor]]


def _get_default_state() -> RNGState:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


def _set_default_state(rng_state: RNGState) -> None:
    cpu, cuda = rng_state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def _seed_current(seed: int) -> None:
    # The CPU and the current CUDA device only: the generators a tracked state swaps.
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states that can be swapped in around a block of code."""

    def __init__(self):
        self._states: Dict[str, RNGState] = {}

    def reset(self) -> None:
        self._states = {}

    def get_states(self) -> Dict[str, RNGState]:
        """A copy of every tracked state (for checkpoints and recompute)."""
        return dict(self._states)

    def set_states(self, states: Dict[str, RNGState]) -> None:
        self._states = dict(states)

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG state {name!r} is already tracked; call reset() first")
        saved = _get_default_state()
        _seed_current(seed)
        self._states[name] = _get_default_state()
        _set_default_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Draw from the tracked stream `name` inside the block; the default stream is left untouched."""
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} is not tracked; call megatron_lite.parallel.random."
                           f"model_parallel_seed(seed) first")
        saved = _get_default_state()
        _set_default_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_default_state()
            _set_default_state(saved)


_RNG_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _RNG_TRACKER


def model_parallel_seed(seed: int) -> None:
    """Seed the default generators with seed (same on all TP ranks) and the split stream per TP rank."""
    torch.manual_seed(seed)  # CPU and every CUDA device, whichever one this rank ends up using
    _RNG_TRACKER.reset()
    _RNG_TRACKER.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank())


def checkpoint(function, *args):
    """function(*args) without keeping its activations; backward recomputes them.

    torch's checkpoint restores the default CPU and device generators for the
    recompute; the context below does the same for the tracker's streams, so
    dropout masks inside `fork()` are the forward's masks too. Streams are put
    back afterwards, so recompute draws nothing from the training's sequence.
    """
    forward_states = _RNG_TRACKER.get_states()

    @contextlib.contextmanager
    def replay_tracker():
        before_recompute = _RNG_TRACKER.get_states()
        _RNG_TRACKER.set_states(forward_states)
        try:
            yield
        finally:
            _RNG_TRACKER.set_states(before_recompute)

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                                             context_fn=lambda: (contextlib.nullcontext(), replay_tracker()))
