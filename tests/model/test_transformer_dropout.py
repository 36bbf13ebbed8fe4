"""Dropout of a transformer layer draws from the layer's own streams, and recompute replays them."""
import dataclasses

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.model.recompute import run_stage
from megatron_lite.model.transformer import TransformerLayer
from megatron_lite.parallel.random import get_rng_tracker, model_parallel_seed

SEED = 99
CONFIG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=8,
                     hidden_dropout=0.5, attention_dropout=0.5)


def _layer(layer_number, config=CONFIG):
    torch.manual_seed(0)  # the same weights whatever the layer number
    return TransformerLayer(config, layer_number)


def _input():
    return torch.randn(2, CONFIG.seq_length, CONFIG.hidden_size, generator=torch.Generator().manual_seed(1))


def _fresh_output(layer):
    model_parallel_seed(SEED, CONFIG.num_layers)
    return layer(_input())


def test_two_layers_with_equal_weights_draw_different_dropout_masks_from_fresh_streams():
    first, second = _fresh_output(_layer(1)), _fresh_output(_layer(2))
    assert not torch.equal(first, second), "layers 1 and 2 drew the same dropout masks"
    assert torch.equal(first, _fresh_output(_layer(1))), "a layer's masks must follow from (seed, layer number)"
    evaluated = [layer.eval()(_input()) for layer in (_layer(1), _layer(2))]
    assert torch.equal(*evaluated), "without dropout the two layers compute the same function"


RECOMPUTE = {"none": {}, "selective": {"recompute_granularity": "selective"},
             "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}


def _step(recompute, backend="sdpa"):
    config = dataclasses.replace(CONFIG, attention_backend=backend, **RECOMPUTE[recompute])
    layer = _layer(2, config)
    model_parallel_seed(SEED, CONFIG.num_layers)
    x = _input().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        y = run_stage([layer], x, config)
    y.backward(torch.ones_like(y))
    tracker_after = {name: state[0] for name, state in get_rng_tracker().get_states().items()}
    return y.detach(), x.grad, [p.grad for p in layer.parameters()], tracker_after, sum(saved)


@pytest.mark.parametrize("backend", ["sdpa", "fused"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_replays_the_layer_streams_and_leaves_them_where_the_forward_left_them(recompute, backend):
    plain, recomputed = _step("none", backend), _step(recompute, backend)
    assert recomputed[4] < plain[4], "recompute should keep fewer activations"
    assert torch.equal(plain[0], recomputed[0])
    assert torch.equal(plain[1], recomputed[1]), "input gradient differs: recompute drew other masks"
    for a, b in zip(plain[2], recomputed[2]):
        assert torch.equal(a, b)
    assert plain[3].keys() == recomputed[3].keys()
    for name in plain[3]:
        assert torch.equal(plain[3][name], recomputed[3][name]), f"stream {name} moved during recompute"
