"""Random streams for dropout, and activation recompute that replays them.

Every dropout in the model draws from a named stream of the tracker, seeded
from the run seed and what the stream is for, never from the pipeline stage
or the data-parallel rank, so a layer draws the same masks under any PP layout:
  'embedding'              (seed, "embedding"): dropout after the embeddings
  'layer-N'                (seed, N): the residual-stream (hidden) dropout of transformer
                           layer N; its activations are replicated, so every TP rank
                           draws the same mask
  'layer-N-tp-rank'        (seed, N, tp_rank): dropout on split activations (the attention
                           probabilities of this rank's heads), different per TP rank as it
                           would be for different heads at TP = 1. So attention dropout
                           at TP > 1 draws other masks than at TP = 1, as in Megatron-LM
  'layer-N-sequence-shard' (seed, N, "sequence-shard", tp_rank): with --sequence-parallel,
                           the residual-stream dropout of layer N, on this TP rank's part of
                           the sequence; a stream per TP rank, as Megatron-LM forks its
                           model-parallel generator there: the same stream on every rank would
                           repeat one mask pattern on every sequence shard
  'model-parallel-rng'     seed + 2718 + tp_rank: split activations outside any layer (with
                           --sequence-parallel, the embedding dropout on this rank's shard)
So --sequence-parallel changes the residual-stream and embedding dropout masks (not their
distribution) and leaves the attention-probability masks as they are.
With context parallelism (C > 1) every CP rank holds other tokens (and, inside attention, other
heads), so every stream's key also holds ("cp", cp_rank): streams stay equal across TP where the
activations are replicated, and differ across CP ranks everywhere. At C = 1 the keys are as above,
so runs without CP draw the masks they always drew.
The default generators get `seed`, identical on every rank. The tracker keeps
each stream's state aside and swaps it in inside `get_rng_tracker().fork(name)`.
Each state is the CPU generator's plus, when CUDA is available, the current
device's generator's.
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Dict, Optional, Tuple

import torch
import torch.utils.checkpoint

from megatron_lite.parallel.context_parallel import cp_rank, cp_world_size
from megatron_lite.parallel.tp import tp_rank

MODEL_PARALLEL_RNG = "model-parallel-rng"
MODEL_PARALLEL_SEED_OFFSET = 2718
EMBEDDING_RNG = "embedding"

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
        """Set the given streams; streams not in `states` keep their state (a checkpoint saved before a
        stream existed still restores every stream it has)."""
        self._states.update(states)

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
                           f"model_parallel_seed(seed, num_layers) first")
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


@contextlib.contextmanager
def seeded(seed: int):
    """Initialise under a private seed without disturbing the caller's generators (each layer spec's weights)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def layer_rng(layer_number: int) -> str:
    """Stream of layer `layer_number`'s dropout on replicated activations (the residual stream)."""
    return f"layer-{layer_number}"


def layer_split_rng(layer_number: int) -> str:
    """Stream of layer `layer_number`'s dropout on activations split over TP (attention probabilities)."""
    return f"layer-{layer_number}-tp-rank"


def layer_sequence_shard_rng(layer_number: int) -> str:
    """Stream of layer `layer_number`'s residual-stream dropout on this TP rank's sequence shard."""
    return f"layer-{layer_number}-sequence-shard"


def stream_seed(*key) -> int:
    """A 64-bit seed that is a fixed function of key, e.g. (seed, layer number, TP rank).

    A hash rather than seed + offset, so no two keys share a seed by arithmetic accident.
    """
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little")


def model_parallel_seed(seed: int, num_layers: int) -> None:
    """Seed the default generators and every tracked stream of a model with num_layers layers
    (numbered from 1); the streams are the same on every PP stage and DP rank."""
    torch.manual_seed(seed)  # CPU and every CUDA device, whichever one this rank ends up using
    _RNG_TRACKER.reset()
    cp = ("cp", cp_rank()) if cp_world_size() > 1 else ()
    _RNG_TRACKER.add(MODEL_PARALLEL_RNG, stream_seed(seed, MODEL_PARALLEL_RNG, tp_rank(), *cp) if cp
                     else seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank())
    _RNG_TRACKER.add(EMBEDDING_RNG, stream_seed(seed, EMBEDDING_RNG, *cp))
    for n in range(1, num_layers + 1):
        _RNG_TRACKER.add(layer_rng(n), stream_seed(seed, n, *cp))
        _RNG_TRACKER.add(layer_split_rng(n), stream_seed(seed, n, tp_rank(), *cp))
        _RNG_TRACKER.add(layer_sequence_shard_rng(n), stream_seed(seed, n, "sequence-shard", tp_rank(), *cp))


def dropout_draws(dropout: torch.nn.Dropout) -> bool:
    """Whether `dropout` draws a mask now (training, p > 0): otherwise it is the identity and draws nothing,
    so no stream needs swapping in (which a compiled layer could not trace: model/compile.py)."""
    return dropout.training and dropout.p > 0


@torch.compiler.disable
def run_in_stream(stream: str, function, *args):
    """function(*args) drawing from the tracked stream `stream`, always eagerly.

    Why eager: swapping generator states in and out (get/set_rng_state) cannot be traced, and inductor's
    own random numbers are not eager's, so a compiled layer breaks its graph here and draws exactly the
    masks an eager layer would (--compile with dropout: model/compile.py)."""
    with _RNG_TRACKER.fork(stream):
        return function(*args)


def checkpoint(function, *args, draws: bool = True):
    """function(*args) without keeping its activations; backward recomputes them.

    torch's checkpoint restores the default CPU and device generators for the
    recompute; the context below does the same for the tracker's streams, so
    dropout masks inside `fork(name)` are the forward's masks too. Streams are put
    back afterwards, so recompute draws nothing from the training's sequence.
    Inside a compiled layer (model/compile.py) dynamo traces torch's checkpoint only without that context: a
    function that draws nothing (draws=False) is traced so, one that draws runs eagerly as here.
    """
    if torch.compiler.is_compiling():
        if draws:
            return _checkpoint_eagerly(function, *args)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    return _checkpoint_replaying_streams(function, *args)


def _checkpoint_replaying_streams(function, *args):
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


_checkpoint_eagerly = torch.compiler.disable(_checkpoint_replaying_streams)
