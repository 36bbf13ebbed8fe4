"""Sequence-parallel mappings and layers against dense tensors and nn.Linear: [b, s, h] split along s."""
import pytest
import torch
from torch import nn

from tests.harness import run_distributed
from tests.parallel.reference import assert_matches, master_weights, rank_slice

TPS = [2, pytest.param(4, marks=pytest.mark.slow)]
B, S, H, OUT = 2, 8, 6, 12  # b > 1: the collectives copy through a [tp, b, s/tp, h] buffer


def _randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _mappings(tp, replicated, partials, grads):
    import torch.distributed as dist

    from megatron_lite.parallel import mappings, state

    state.initialize(tp)
    rank = dist.get_rank()
    out = {}
    for name, fn, x in (("scatter", mappings.scatter_to_sequence_parallel_region, replicated),
                        ("reduce_scatter", mappings.reduce_scatter_to_sequence_parallel_region, partials[rank])):
        x = x.clone().requires_grad_()
        y = fn(x)
        y.backward(grads[rank])
        out[name] = (y.detach(), x.grad)
    return out


@pytest.mark.parametrize("tp", TPS)
def test_sequence_mappings_split_or_reduce_scatter_forward_and_gather_backward(tp):
    replicated = _randn(B, S, H, seed=0)
    partials = [_randn(B, S, H, seed=1 + r) for r in range(tp)]
    grads = [_randn(B, S // tp, H, seed=10 + r) for r in range(tp)]
    results = run_distributed(_mappings, tp, tp, replicated, partials, grads)
    gathered = torch.cat(grads, dim=1)  # every rank's shard gradient, in sequence order
    for rank, r in enumerate(results):
        y, x_grad = r["scatter"]
        assert torch.equal(y, rank_slice(replicated, rank, tp, 1))
        assert torch.equal(x_grad, gathered)
        y, x_grad = r["reduce_scatter"]
        torch.testing.assert_close(y, rank_slice(sum(partials), rank, tp, 1), rtol=1e-6, atol=1e-6)
        assert torch.equal(x_grad, gathered)


def _dense(in_features, out_features, seed):
    """nn.Linear with the master weight the parallel layers draw after torch.manual_seed(seed)."""
    layer = nn.Linear(in_features, out_features)
    torch.manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(master_weights((out_features, in_features))[0])
        layer.bias.copy_(_randn(out_features, seed=seed + 1))
    return layer


def _sequence_parallel_layers(tp, kind, x_shards, grad_outputs, bias):
    """Column: rank r gets its sequence shard and gathers; row: rank r its input columns, full sequence."""
    import torch.distributed as dist

    from megatron_lite.parallel import state
    from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear, parallel_lm_logits

    state.initialize(tp)
    rank = dist.get_rank()
    torch.manual_seed(3)  # the masters are drawn from the same seed as the dense layers
    init = lambda w: nn.init.normal_(w, 0.0, 0.02)  # noqa: E731
    if kind == "column":
        layer = ColumnParallelLinear(H, OUT, init_method=init, sequence_parallel=True)
        with torch.no_grad():
            layer.bias.copy_(rank_slice(bias, rank, tp, 0))
    elif kind == "row":
        layer = RowParallelLinear(OUT, H, init_method=init, sequence_parallel=True)
        with torch.no_grad():
            layer.bias.copy_(bias)
    else:  # the tied head: logits of every position against a vocab-split weight
        weight = nn.Parameter(rank_slice(master_weights((OUT, H))[0], rank, tp, 0).clone())
        layer = lambda x: parallel_lm_logits(x, weight, sequence_parallel=True)  # noqa: E731
        layer.named_parameters = lambda: [("weight", weight)]
    x = x_shards[rank].clone().requires_grad_()
    y = layer(x)
    y.backward(grad_outputs[rank])
    return {"y": y.detach(), "x_grad": x.grad, "params": {n: p.grad for n, p in layer.named_parameters()}}


@pytest.mark.parametrize("kind", ["column", "head"])
@pytest.mark.parametrize("tp", TPS)
def test_column_parallel_linear_on_a_sequence_shard_matches_dense_linear(tp, kind):
    dense = _dense(H, OUT, seed=3)
    if kind == "head":
        dense.bias = None
    x, grad = _randn(B, S, H, seed=20), _randn(B, S, OUT, seed=21)
    x_dense = x.clone().requires_grad_()
    y = dense(x_dense)
    y.backward(grad)
    bias = dense.bias.detach() if dense.bias is not None else torch.zeros(OUT)
    results = run_distributed(_sequence_parallel_layers, tp, tp, kind, [rank_slice(x, r, tp, 1) for r in range(tp)],
                              [rank_slice(grad, r, tp, -1) for r in range(tp)], bias)
    for rank, r in enumerate(results):
        assert_matches(r["y"], rank_slice(y.detach(), rank, tp, -1), f"rank {rank} output")
        assert_matches(r["x_grad"], rank_slice(x_dense.grad, rank, tp, 1), f"rank {rank} input gradient")
        assert_matches(r["params"]["weight"], rank_slice(dense.weight.grad, rank, tp, 0),
                       f"rank {rank} weight gradient")
        if kind == "column":
            assert_matches(r["params"]["bias"], rank_slice(dense.bias.grad, rank, tp, 0), f"rank {rank} bias gradient")


@pytest.mark.parametrize("tp", TPS)
def test_row_parallel_linear_reduce_scatters_to_sequence_shards_and_its_bias_gradient_sums_to_dense(tp):
    dense = _dense(OUT, H, seed=3)
    x, grad = _randn(B, S, OUT, seed=30), _randn(B, S, H, seed=31)
    x_dense = x.clone().requires_grad_()
    y = dense(x_dense)
    y.backward(grad)
    results = run_distributed(_sequence_parallel_layers, tp, tp, "row", [rank_slice(x, r, tp, -1) for r in range(tp)],
                              [rank_slice(grad, r, tp, 1) for r in range(tp)], dense.bias.detach())
    for rank, r in enumerate(results):
        assert_matches(r["y"], rank_slice(y.detach(), rank, tp, 1), f"rank {rank} output")
        assert_matches(r["x_grad"], rank_slice(x_dense.grad, rank, tp, -1), f"rank {rank} input gradient")
        assert_matches(r["params"]["weight"], rank_slice(dense.weight.grad, rank, tp, 1),
                       f"rank {rank} weight gradient")
    # The bias sees this rank's positions only: the ranks' partial gradients add up to the dense one
    # (parallel/sequence_parallel.py sums them over TP once per step).
    assert_matches(sum(r["params"]["bias"] for r in results), dense.bias.grad, "summed bias gradient")


def _sum_over_tp(tp, grads):
    import torch.distributed as dist

    from megatron_lite.parallel import state
    from megatron_lite.parallel.sequence_parallel import all_reduce_gradients_over_tp

    state.initialize(tp)
    mine = [g.clone() for g in grads[dist.get_rank()]]
    all_reduce_gradients_over_tp(mine + [None])
    return mine


def test_all_reduce_gradients_over_tp_sums_each_gradient_in_place_whatever_its_dtype():
    grads = [[_randn(3, seed=r), _randn(2, 2, seed=5 + r).bfloat16()] for r in range(2)]
    for summed in run_distributed(_sum_over_tp, 2, 2, grads):
        assert torch.equal(summed[0], grads[0][0] + grads[1][0])
        assert summed[1].dtype == torch.bfloat16 and torch.equal(summed[1], grads[0][1] + grads[1][1])
