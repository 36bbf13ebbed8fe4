"""RNG tracker: which dropout masks agree across TP ranks, and recompute replaying them."""
import functools

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed

SEED = 1234
N = 256


def _mask():
    return F.dropout(torch.ones(N), p=0.5)


def _replicated_then_split_then_replicated(tp):
    from megatron_lite.parallel import state
    from megatron_lite.parallel.random import get_rng_tracker, model_parallel_seed

    state.initialize(tp)
    model_parallel_seed(SEED, 0)
    first = _mask()
    with get_rng_tracker().fork():
        split = _mask()
    return first, split, _mask()


@functools.lru_cache(maxsize=None)
def _masks(tp):
    return run_distributed(_replicated_then_split_then_replicated, tp, tp)


def _reference_masks(seed, count):
    """What a generator seeded with `seed` draws: the single-process reference."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return [_mask() for _ in range(count)]


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_dropout_inside_fork_differs_across_tp_ranks_and_follows_seed_plus_2718_plus_rank(tp):
    splits = [split for _, split, _ in _masks(tp)]
    for rank, split in enumerate(splits):
        assert torch.equal(split, _reference_masks(SEED + 2718 + rank, 1)[0])
    for a in range(tp):
        for b in range(a + 1, tp):
            assert not torch.equal(splits[a], splits[b]), f"ranks {a} and {b} drew the same split-region mask"


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_dropout_outside_fork_agrees_on_all_tp_ranks_and_fork_does_not_advance_it(tp):
    expected_first, expected_second = _reference_masks(SEED, 2)
    for first, _, second in _masks(tp):
        assert torch.equal(first, expected_first)
        assert torch.equal(second, expected_second)


def _layer_stream_masks(tp, pp):
    from megatron_lite.parallel import state
    from megatron_lite.parallel.random import get_rng_tracker, layer_rng, layer_split_rng, model_parallel_seed

    state.initialize(tp, pp)
    model_parallel_seed(SEED, 2)
    masks = {}
    for name in ("embedding", layer_rng(1), layer_rng(2), layer_split_rng(1), layer_split_rng(2)):
        with get_rng_tracker().fork(name):
            masks[name] = _mask()
    return masks


def test_each_layer_has_its_own_streams_replicated_across_tp_ranks_and_split_per_rank():
    from megatron_lite.parallel.random import stream_seed

    ranks = run_distributed(_layer_stream_masks, 2, 2, 1)
    for rank, masks in enumerate(ranks):
        assert torch.equal(masks["embedding"], _reference_masks(stream_seed(SEED, "embedding"), 1)[0])
        for n in (1, 2):
            assert torch.equal(masks[f"layer-{n}"], _reference_masks(stream_seed(SEED, n), 1)[0])
            assert torch.equal(masks[f"layer-{n}-tp-rank"], _reference_masks(stream_seed(SEED, n, rank), 1)[0])
    first = ranks[0]
    assert not torch.equal(first["layer-1"], first["layer-2"]), "two layers drew the same hidden-dropout mask"
    assert not torch.equal(first["layer-1-tp-rank"], first["layer-2-tp-rank"])
    assert not torch.equal(first["embedding"], first["layer-1"])
    assert torch.equal(ranks[0]["layer-1"], ranks[1]["layer-1"]), "replicated stream differs across TP ranks"
    assert not torch.equal(ranks[0]["layer-1-tp-rank"], ranks[1]["layer-1-tp-rank"])


def test_layer_streams_are_the_same_on_every_pipeline_stage():
    first_stage, second_stage = run_distributed(_layer_stream_masks, 2, 1, 2)
    for name, mask in first_stage.items():
        assert torch.equal(mask, second_stage[name]), f"stream {name} depends on the pipeline stage"


def _block(x):
    """A transformer-like block: dropout on the replicated stream, then on the split stream."""
    from megatron_lite.parallel.random import get_rng_tracker

    h = F.dropout(x, p=0.5)
    with get_rng_tracker().fork():
        h = F.dropout(torch.tanh(h), p=0.5)
    return h * x


def _grads_and_next_masks(recompute):
    from megatron_lite.parallel.random import checkpoint, get_rng_tracker, model_parallel_seed

    model_parallel_seed(SEED, 0)
    x = torch.linspace(-1.0, 1.0, N).requires_grad_()
    y = checkpoint(_block, x) if recompute else _block(x)
    y.backward(torch.linspace(0.5, 1.5, N))
    with get_rng_tracker().fork():
        next_split = _mask()
    return y.detach(), x.grad, _mask(), next_split


def _with_and_without_recompute(tp):
    from megatron_lite.parallel import state

    state.initialize(tp)
    return _grads_and_next_masks(recompute=False), _grads_and_next_masks(recompute=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_checkpoint_recompute_reproduces_dropout_masks_and_leaves_rng_streams_where_they_were(tp):
    results = run_distributed(_with_and_without_recompute, tp, tp)
    for rank, (plain, recomputed) in enumerate(results):
        for name, a, b in zip(("output", "input grad", "next replicated mask", "next split mask"), plain, recomputed):
            assert torch.equal(a, b), f"rank {rank}: {name} differs with recompute"
    if tp > 1:
        assert not torch.equal(results[0][0][1], results[1][0][1]), "split-region masks must differ across ranks"


def test_tracker_states_round_trip_through_get_and_set():
    from megatron_lite.parallel.random import get_rng_tracker, model_parallel_seed

    tracker = get_rng_tracker()
    model_parallel_seed(SEED, 0)
    saved = tracker.get_states()
    with tracker.fork():
        first = _mask()
    tracker.set_states(saved)
    with tracker.fork():
        again = _mask()
    assert torch.equal(first, again)
    assert torch.equal(first, _reference_masks(SEED + 2718, 1)[0])


def test_fork_before_seeding_says_how_to_seed():
    from megatron_lite.parallel.random import RNGStatesTracker

    with pytest.raises(KeyError, match="model_parallel_seed"):
        with RNGStatesTracker().fork():
            pass


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_dropout_follows_the_tracker_and_recompute_replays_it():
    from megatron_lite.parallel.random import checkpoint, get_rng_tracker, model_parallel_seed

    def cuda_mask():
        return F.dropout(torch.ones(N, device="cuda"), p=0.5)

    def reference(seed):
        with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
            torch.cuda.manual_seed(seed)
            return cuda_mask()

    model_parallel_seed(SEED, 0)
    replicated = cuda_mask()
    with get_rng_tracker().fork():
        split = cuda_mask()
    assert torch.equal(replicated, reference(SEED)) and torch.equal(split, reference(SEED + 2718))

    def run(recompute):
        model_parallel_seed(SEED, 0)
        x = torch.linspace(-1.0, 1.0, N, device="cuda").requires_grad_()
        y = checkpoint(_block, x) if recompute else _block(x)
        y.sum().backward()
        return x.grad

    assert torch.equal(run(False), run(True))
