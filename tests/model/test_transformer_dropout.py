"""Dropout of a transformer layer draws from the layer's own streams, and recompute replays them."""
import dataclasses

import torch

from megatron_lite.config import ModelConfig
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


def _step(recompute):
    layer = _layer(2, dataclasses.replace(CONFIG, recompute_activations=recompute))
    model_parallel_seed(SEED, CONFIG.num_layers)
    x = _input().requires_grad_()
    y = layer(x)
    y.backward(torch.ones_like(y))
    tracker_after = {name: state[0] for name, state in get_rng_tracker().get_states().items()}
    return y.detach(), x.grad, [p.grad for p in layer.parameters()], tracker_after


def test_recompute_replays_the_layer_streams_and_leaves_them_where_the_forward_left_them():
    plain, recomputed = _step(False), _step(True)
    assert torch.equal(plain[0], recomputed[0])
    assert torch.equal(plain[1], recomputed[1]), "input gradient differs: recompute drew other masks"
    for a, b in zip(plain[2], recomputed[2]):
        assert torch.equal(a, b)
    assert plain[3].keys() == recomputed[3].keys()
    for name in plain[3]:
        assert torch.equal(plain[3][name], recomputed[3][name]), f"stream {name} moved during recompute"
