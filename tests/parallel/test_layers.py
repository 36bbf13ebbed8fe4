"""Tensor-parallel layers against dense nn.Linear / nn.Embedding holding the same master weights."""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed
from tests.parallel.reference import assert_matches, master_weights, rank_slice

TPS = [1, 2, pytest.param(4, marks=pytest.mark.slow)]  # TP 4 in the full suite only (scripts/test.sh --fast leaves it out)
SEED = 1234
BATCH, SEQ, HIDDEN, OUT, FFN, VOCAB = 2, 3, 8, 12, 16, 16
HEADS = 4


def _masters(*shapes):
    """The TP = 1 weights: normal(0, 0.02) drawn in order from the caller's seed."""
    torch.manual_seed(SEED)
    return master_weights(*shapes)


def _randn(*shape):
    return torch.randn(shape, generator=_randn.generator)


_randn.generator = torch.Generator().manual_seed(0)


def _qkv_of_rank(t, rank, tp, dim):
    """Rank's [q_r; k_r; v_r] of a fused [q; k; v] tensor: whole heads of each of q, k and v."""
    return torch.cat([rank_slice(part, rank, tp, dim) for part in t.chunk(3, dim=dim)], dim=dim)


def _dense_linear_case(in_features, out_features, bias=True):
    """Dense nn.Linear holding the master weight (and a random bias), run on a random input and output grad."""
    (weight,) = _masters((out_features, in_features))
    dense = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        dense.weight.copy_(weight)
        if bias:
            dense.bias.copy_(_randn(out_features))
    x, grad = _randn(BATCH, SEQ, in_features), _randn(BATCH, SEQ, out_features)
    return (dense, x, grad, *_dense_forward_backward(dense, x, grad))


def _last_dim(tp, split):
    """t, rank -> rank's slice of t's last dim if split, else t."""
    return (lambda t, r: rank_slice(t, r, tp, -1)) if split else (lambda t, r: t)


def _dense_forward_backward(module, x, grad_out):
    if x.is_floating_point():
        x = x.clone().requires_grad_()
    y = module(x)
    y.backward(grad_out)
    return y.detach(), x.grad


# Builders run on each rank after state.initialize() and torch.manual_seed(SEED).

def _column(bias, gather_output=False, stride=1, split=rank_slice):
    from megatron_lite.parallel.layers import ColumnParallelLinear
    from megatron_lite.parallel.tp import tp_rank, tp_world_size

    layer = ColumnParallelLinear(HIDDEN, bias.numel(), gather_output=gather_output, stride=stride)
    with torch.no_grad():
        layer.bias.copy_(split(bias, tp_rank(), tp_world_size(), 0))
    return layer


def _row(bias, input_is_parallel):
    from megatron_lite.parallel.layers import RowParallelLinear

    layer = RowParallelLinear(FFN, bias.numel(), input_is_parallel=input_is_parallel)
    with torch.no_grad():
        layer.bias.copy_(bias)
    return layer


def _embedding():
    from megatron_lite.parallel.layers import VocabParallelEmbedding

    return VocabParallelEmbedding(VOCAB, HIDDEN)


def _mlp(bias1, bias2):
    from megatron_lite.parallel.layers import RowParallelLinear

    column = _column(bias1)
    row = RowParallelLinear(FFN, HIDDEN)
    with torch.no_grad():
        row.bias.copy_(bias2)
    return nn.Sequential(column, nn.GELU(), row)


class _TiedHead(nn.Module):
    def __init__(self, parallel_output):
        from megatron_lite.parallel.layers import VocabParallelEmbedding

        super().__init__()
        self.embedding = VocabParallelEmbedding(VOCAB, HIDDEN)
        self.parallel_output = parallel_output

    def forward(self, hidden):
        from megatron_lite.parallel.layers import parallel_lm_logits

        return parallel_lm_logits(hidden, self.embedding.weight, parallel_output=self.parallel_output)


def _forward_backward(tp, build, xs, grads):
    """Build, run rank r's input xs[r] forward and grads[r] backward; return output and every gradient."""
    import torch.distributed as dist

    from megatron_lite.parallel import state

    state.initialize(tp)
    torch.manual_seed(SEED)
    module = build()
    rank = dist.get_rank()
    x = xs[rank].clone()
    if x.is_floating_point():
        x.requires_grad_()
    y = module(x)
    y.backward(grads[rank])
    return {
        "y": y.detach(), "x_grad": x.grad,
        "params": {name: (p.detach(), p.grad) for name, p in module.named_parameters()},
        "vocab_range": (getattr(module, "vocab_start_index", None), getattr(module, "vocab_end_index", None)),
    }


def _run(tp, build, x, grads_per_rank):
    return run_distributed(_forward_backward, tp, tp, build, [x] * tp, grads_per_rank)


def _assert_params_match(result, dense, rank, tp, split_dims):
    """split_dims: dense parameter name -> dim it is split along on TP ranks, None if replicated."""
    params = result["params"]
    for (name, (value, grad)), (dense_name, dense_param) in zip(params.items(), dense.named_parameters()):
        dim = split_dims[dense_name]
        expect = (lambda t: t) if dim is None else functools.partial(rank_slice, rank=rank, world=tp, dim=dim)
        assert torch.equal(value, expect(dense_param.detach())), f"rank {rank} {name} is not the dense slice"
        assert_matches(grad, expect(dense_param.grad), f"rank {rank} {name} grad")


@pytest.mark.parametrize("gather_output", [False, True])
@pytest.mark.parametrize("tp", TPS)
def test_column_parallel_linear_matches_dense_linear(tp, gather_output):
    dense, x, grad, y, x_grad = _dense_linear_case(HIDDEN, OUT)
    local = _last_dim(tp, split=not gather_output)
    results = _run(tp, functools.partial(_column, dense.bias.detach(), gather_output), x,
                   [local(grad, r) for r in range(tp)])
    for rank, result in enumerate(results):
        assert_matches(result["y"], local(y, rank), f"rank {rank} output")
        assert_matches(result["x_grad"], x_grad, f"rank {rank} input grad")
        _assert_params_match(result, dense, rank, tp, {"weight": 0, "bias": 0})


@pytest.mark.parametrize("input_is_parallel", [True, False])
@pytest.mark.parametrize("tp", TPS)
def test_row_parallel_linear_matches_dense_linear_with_bias_added_once(tp, input_is_parallel):
    dense, x, grad, y, x_grad = _dense_linear_case(FFN, HIDDEN)
    local = _last_dim(tp, split=input_is_parallel)
    build = functools.partial(_row, dense.bias.detach(), input_is_parallel)
    results = run_distributed(_forward_backward, tp, tp, build, [local(x, r) for r in range(tp)], [grad] * tp)
    for rank, result in enumerate(results):
        assert_matches(result["y"], y, f"rank {rank} output")
        assert_matches(result["x_grad"], local(x_grad, rank), f"rank {rank} input grad")
        _assert_params_match(result, dense, rank, tp, {"weight": 1, "bias": None})


@pytest.mark.parametrize("tp", TPS)
def test_vocab_parallel_embedding_matches_dense_embedding_for_ids_in_every_rank_range(tp):
    (weight,) = _masters((VOCAB, HIDDEN))
    ids = torch.cat([torch.arange(VOCAB), torch.tensor([0, VOCAB - 1, 5, 5, 9, 12, 3, 14])])
    ids = ids[torch.randperm(ids.numel(), generator=_randn.generator)].view(4, 6)
    grad = _randn(4, 6, HIDDEN)
    dense = nn.Embedding(VOCAB, HIDDEN)
    dense.weight.data.copy_(weight)
    y, _ = _dense_forward_backward(dense, ids, grad)

    results = _run(tp, _embedding, ids, [grad] * tp)
    per_rank = VOCAB // tp
    for rank, result in enumerate(results):
        assert result["vocab_range"] == (rank * per_rank, (rank + 1) * per_rank)
        assert_matches(result["y"], y, f"rank {rank} output")
        _assert_params_match(result, dense, rank, tp, {"weight": 0})


@pytest.mark.parametrize("tp", TPS)
def test_column_gelu_row_mlp_matches_dense_mlp(tp):
    weight1, weight2 = _masters((FFN, HIDDEN), (HIDDEN, FFN))
    bias1, bias2 = _randn(FFN), _randn(HIDDEN)
    x, grad = _randn(BATCH, SEQ, HIDDEN), _randn(BATCH, SEQ, HIDDEN)
    dense = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))
    for param, value in zip(dense.parameters(), (weight1, bias1, weight2, bias2)):
        param.data.copy_(value)
    y, x_grad = _dense_forward_backward(dense, x, grad)

    results = _run(tp, functools.partial(_mlp, bias1, bias2), x, [grad] * tp)
    for rank, result in enumerate(results):
        assert_matches(result["y"], y, f"rank {rank} output")
        assert_matches(result["x_grad"], x_grad, f"rank {rank} input grad")
        _assert_params_match(result, dense, rank, tp, {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": None})


@pytest.mark.parametrize("tp", TPS)
def test_fused_qkv_with_stride_3_gives_each_rank_whole_heads_of_q_k_and_v(tp):
    dense, x, grad, y, x_grad = _dense_linear_case(HIDDEN, 3 * HIDDEN)
    build = functools.partial(_column, dense.bias.detach(), stride=3, split=_qkv_of_rank)
    results = _run(tp, build, x, [_qkv_of_rank(grad, r, tp, -1) for r in range(tp)])
    heads_per_rank, head_dim = HEADS // tp, HIDDEN // HEADS
    dense_heads = y.view(BATCH, SEQ, 3, HEADS, head_dim)  # [b, s, (q k v), heads, head_dim]
    for rank, result in enumerate(results):
        own = dense_heads[:, :, :, rank * heads_per_rank:(rank + 1) * heads_per_rank]
        assert_matches(result["y"].view(BATCH, SEQ, 3, heads_per_rank, head_dim), own, f"rank {rank} heads")
        assert_matches(result["x_grad"], x_grad, f"rank {rank} input grad")
        for name, (value, param_grad) in result["params"].items():
            dense_param = getattr(dense, name)
            assert torch.equal(value, _qkv_of_rank(dense_param.detach(), rank, tp, 0)), name
            assert_matches(param_grad, _qkv_of_rank(dense_param.grad, rank, tp, 0), f"rank {rank} {name} grad")


@pytest.mark.parametrize("parallel_output", [True, False])
@pytest.mark.parametrize("tp", TPS)
def test_parallel_lm_logits_on_tied_embedding_weight_matches_dense_matmul(tp, parallel_output):
    dense, hidden, grad, y, hidden_grad = _dense_linear_case(HIDDEN, VOCAB, bias=False)
    local = _last_dim(tp, split=parallel_output)
    results = _run(tp, functools.partial(_TiedHead, parallel_output), hidden, [local(grad, r) for r in range(tp)])
    for rank, result in enumerate(results):
        assert_matches(result["y"], local(y, rank), f"rank {rank} logits")
        assert_matches(result["x_grad"], hidden_grad, f"rank {rank} hidden grad")
        _assert_params_match(result, dense, rank, tp, {"weight": 0})


def _column_with_gathered_strided_output():
    from megatron_lite.parallel import state
    from megatron_lite.parallel.layers import ColumnParallelLinear

    state.initialize(2)
    try:
        ColumnParallelLinear(HIDDEN, 3 * HIDDEN, gather_output=True, stride=3)
    except ValueError as error:
        return str(error)
    return None


def test_column_parallel_linear_refuses_gathered_output_with_stride_at_tp2():
    for message in run_distributed(_column_with_gathered_strided_output, 2):
        assert message is not None and "gather_output" in message


def test_uneven_split_names_the_layer_and_a_size_that_works():
    from megatron_lite.parallel.tp import split_size

    with pytest.raises(ValueError, match=r"RowParallelLinear input_size 10 is not divisible by 4; .* 8 or 12"):
        split_size(10, 4, "RowParallelLinear input_size")


def test_layers_without_parallel_state_are_the_dense_layers():
    """A plain process (no torch.distributed) is TP = 1: how the dense reference model is built."""
    from megatron_lite.parallel import state
    from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    assert not state.is_initialized()
    weight1, weight2, table = _masters((FFN, HIDDEN), (HIDDEN, FFN), (VOCAB, HIDDEN))
    torch.manual_seed(SEED)
    column, row, embedding = ColumnParallelLinear(HIDDEN, FFN), RowParallelLinear(FFN, HIDDEN), \
        VocabParallelEmbedding(VOCAB, HIDDEN)
    assert torch.equal(column.weight, weight1) and torch.equal(row.weight, weight2)
    assert torch.equal(embedding.weight, table)
    assert (embedding.vocab_start_index, embedding.vocab_end_index) == (0, VOCAB)

    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=_randn.generator)
    dense = F.linear(F.gelu(F.linear(F.embedding(ids, table), weight1)), weight2)
    assert_matches(row(F.gelu(column(embedding(ids)))), dense, "dense stack")


def test_parameters_are_tagged_with_split_dim_and_stride():
    from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    def tags(p):
        return p.tensor_model_parallel, p.partition_dim, p.partition_stride

    qkv, row = ColumnParallelLinear(HIDDEN, 3 * HIDDEN, stride=3), RowParallelLinear(FFN, HIDDEN)
    assert tags(qkv.weight) == tags(qkv.bias) == (True, 0, 3)
    assert tags(row.weight) == (True, 1, 1)
    # Replicated: DeepSpeed's is_model_parallel_parameter() must be False so it is counted once.
    assert tags(row.bias) == (False, -1, 1)
    assert tags(VocabParallelEmbedding(VOCAB, HIDDEN).weight) == (True, 0, 1)

    from deepspeed.runtime.utils import is_model_parallel_parameter

    assert is_model_parallel_parameter(row.weight) and not is_model_parallel_parameter(row.bias)


def test_bf16_parameters_are_the_fp32_master_rounded_to_bf16():
    from megatron_lite.parallel.layers import ColumnParallelLinear

    (weight,) = _masters((OUT, HIDDEN))
    torch.manual_seed(SEED)
    layer = ColumnParallelLinear(HIDDEN, OUT, params_dtype=torch.bfloat16)
    assert layer.weight.dtype == layer.bias.dtype == torch.bfloat16
    assert torch.equal(layer.weight, weight.bfloat16())
