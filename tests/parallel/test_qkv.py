"""The grouped-query QKV projection split over TP against the dense one: outputs, input gradient, every
weight's gradient (a group shared by several ranks: summed over exactly those ranks), and the gradient
norm counting each weight once; heads of --kv-channels 8, not hidden / heads = 4."""
import pytest
import torch

from tests.harness import run_distributed

HIDDEN, HEADS, HEAD_DIM = 32, 8, 8  # heads wider than hidden / heads (--kv-channels)
SEED = 11


def _build(groups):
    from megatron_lite.parallel.qkv import QKVParallelLinear

    torch.manual_seed(SEED)  # the same master weight at every TP
    return QKVParallelLinear(HIDDEN, HEADS, groups, HEAD_DIM, bias=True, init_method=torch.nn.init.normal_)


def _inputs(groups):
    g = torch.Generator().manual_seed(3)
    rows = (HEADS + 2 * groups) * HEAD_DIM
    return torch.randn(2, 5, HIDDEN, generator=g), torch.randn(2, 5, rows, generator=g), torch.randn(rows, generator=g)


def _sections(t, groups, tp, rank):
    """Rank's [Q_r; K_r; V_r] pieces of a dense [Q; K; V] tensor along its first (or last) dim."""
    q, kv = HEADS * HEAD_DIM, groups * HEAD_DIM
    return torch.cat([p.chunk(tp, dim=-1)[rank] for p in t.split((q, kv, kv), dim=-1)], dim=-1)


def _columns_used(t, groups, tp, rank):
    """The dense output columns rank computes: its query heads, then its group(s)' keys and values."""
    q, kv = HEADS * HEAD_DIM, groups * HEAD_DIM
    query, key, value = t.split((q, kv, kv), dim=-1)
    heads = HEADS // tp
    if groups >= tp:
        keep = slice(rank * kv // tp, (rank + 1) * kv // tp)
    else:
        group = rank * heads // (HEADS // groups)
        keep = slice(group * HEAD_DIM, (group + 1) * HEAD_DIM)
    return torch.cat([query[..., rank * heads * HEAD_DIM:(rank + 1) * heads * HEAD_DIM], key[..., keep],
                      value[..., keep]], dim=-1)


def _dense(groups):
    layer = _build(groups)
    x, grad, bias = _inputs(groups)
    with torch.no_grad():
        layer.bias.copy_(bias)
    x.requires_grad_()
    y = layer(x)
    y.backward(grad)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _parallel(tp, groups):
    from megatron_lite.parallel import state
    from megatron_lite.parallel.grad_norm import global_grad_norm
    from megatron_lite.parallel.tp import tp_rank

    state.initialize(tp, 1)
    layer, rank = _build(groups), tp_rank()
    x, grad, bias = _inputs(groups)
    with torch.no_grad():
        layer.bias.copy_(_sections(bias, groups, tp, rank))
    x.requires_grad_()
    y = layer(x)
    # In attention a rank's key/value gradient comes from its own query heads only: ranks sharing a group
    # contribute parts of that group's gradient. Here the first of them carries all of it, the others none.
    used = _columns_used(grad, groups, tp, rank)
    if groups < tp and rank % (tp // groups):
        used[..., HEADS // tp * HEAD_DIM:] = 0
    y.backward(used)
    return {"rank": rank, "y": y.detach(), "x_grad": x.grad, "weight_grad": layer.weight.grad,
            "bias_grad": layer.bias.grad, "norm": global_grad_norm(list(layer.parameters())).item()}


@pytest.mark.parametrize("tp, groups", [(2, 2), (4, 2), (4, 1)])
def test_qkv_projection_with_query_groups_matches_the_dense_one(tp, groups):
    dense_y, dense_x_grad, dense_w_grad, dense_b_grad = _dense(groups)
    for r in run_distributed(_parallel, tp, tp, groups):
        rank = r["rank"]
        assert torch.allclose(r["y"], _columns_used(dense_y, groups, tp, rank), atol=1e-5), rank
        assert torch.allclose(r["weight_grad"], _sections(dense_w_grad.t(), groups, tp, rank).t(), atol=1e-5), rank
        assert torch.allclose(r["bias_grad"], _sections(dense_b_grad, groups, tp, rank), atol=1e-5), rank
        dense_norm = torch.cat([dense_w_grad.flatten(), dense_b_grad]).norm().item()
        assert r["norm"] == pytest.approx(dense_norm, rel=1e-5), rank
        # each rank's columns give part of the input gradient; the layer's backward sums the parts over TP
        assert torch.allclose(r["x_grad"], dense_x_grad, atol=1e-5), rank
