import functools

import pytest
import torch

from tests.harness import run_distributed
from tests.parallel.reference import rank_slice

SHAPE = (2, 3, 8)
MAPPINGS = ("copy", "reduce", "scatter", "gather")


def _apply_mappings(tp, inputs, grads):
    """Each mapping once: rank r feeds inputs[name][r] forward and grads[name][r] backward."""
    import torch.distributed as dist

    from megatron_lite.parallel import mappings, state

    state.initialize(tp)
    rank = dist.get_rank()
    functions = {
        "copy": mappings.copy_to_tensor_model_parallel_region,
        "reduce": mappings.reduce_from_tensor_model_parallel_region,
        "scatter": mappings.scatter_to_tensor_model_parallel_region,
        "gather": mappings.gather_from_tensor_model_parallel_region,
    }
    out = {}
    for name, fn in functions.items():
        x = inputs[name][rank].clone().requires_grad_()
        y = fn(x)
        y.backward(grads[name][rank])
        out[name] = (y.detach(), x.grad)
    return out


@functools.lru_cache(maxsize=None)
def _case(tp):
    """Per-rank inputs and output grads, and every rank's (forward, input grad) per mapping."""
    g = torch.Generator().manual_seed(tp)
    full = lambda: [torch.randn(SHAPE, generator=g) for _ in range(tp)]  # noqa: E731
    part = lambda: [torch.randn(SHAPE[:-1] + (SHAPE[-1] // tp,), generator=g) for _ in range(tp)]  # noqa: E731
    replicated = torch.randn(SHAPE, generator=g)
    inputs = {"copy": full(), "reduce": full(), "scatter": [replicated] * tp, "gather": part()}
    grads = {"copy": full(), "reduce": full(), "scatter": part(), "gather": [replicated] * tp}
    return inputs, grads, run_distributed(_apply_mappings, tp, tp, inputs, grads)


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_copy_to_region_is_identity_forward_and_sums_grads_over_tp_backward(tp):
    inputs, grads, results = _case(tp)
    for rank, r in enumerate(results):
        y, x_grad = r["copy"]
        assert torch.equal(y, inputs["copy"][rank])
        torch.testing.assert_close(x_grad, sum(grads["copy"]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_reduce_from_region_sums_over_tp_forward_and_is_identity_backward(tp):
    inputs, grads, results = _case(tp)
    for rank, r in enumerate(results):
        y, x_grad = r["reduce"]
        torch.testing.assert_close(y, sum(inputs["reduce"]), rtol=1e-6, atol=1e-6)
        assert torch.equal(x_grad, grads["reduce"][rank])


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_scatter_to_region_splits_last_dim_forward_and_gathers_backward(tp):
    inputs, grads, results = _case(tp)
    for rank, r in enumerate(results):
        y, x_grad = r["scatter"]
        assert torch.equal(y, rank_slice(inputs["scatter"][rank], rank, tp, -1))
        assert torch.equal(x_grad, torch.cat(grads["scatter"], dim=-1))


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_gather_from_region_concatenates_last_dim_forward_and_splits_backward(tp):
    inputs, grads, results = _case(tp)
    for rank, r in enumerate(results):
        y, x_grad = r["gather"]
        assert torch.equal(y, torch.cat(inputs["gather"], dim=-1))
        assert torch.equal(x_grad, rank_slice(grads["gather"][rank], rank, tp, -1))


def _mappings_at_tp1_with_collectives_forbidden():
    import torch.distributed as dist

    from megatron_lite.parallel import mappings, state

    state.initialize(1)  # world 2: TP 1 x DP 2, so a stray collective would have peers to talk to

    def forbidden(*args, **kwargs):
        raise AssertionError("collective issued at TP = 1")

    saved = dist.all_reduce, dist.all_gather
    dist.all_reduce = dist.all_gather = forbidden
    try:
        x = torch.randn(SHAPE, requires_grad=True)
        outs = [fn(x) for fn in (mappings.copy_to_tensor_model_parallel_region,
                                 mappings.reduce_from_tensor_model_parallel_region,
                                 mappings.scatter_to_tensor_model_parallel_region,
                                 mappings.gather_from_tensor_model_parallel_region)]
        sum(o.sum() for o in outs).backward()
        return all(o is x for o in outs), torch.equal(x.grad, torch.full(SHAPE, 4.0))
    finally:
        dist.all_reduce, dist.all_gather = saved


def test_mappings_at_tp1_return_their_input_and_issue_no_collective():
    for same_object, grad_is_identity in run_distributed(_mappings_at_tp1_with_collectives_forbidden, 2):
        assert same_object and grad_is_identity
