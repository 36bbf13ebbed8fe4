"""FusedScaleMaskSoftmax on CPU: the compiled kernels and the torch fallback against a float64 reference."""
import pytest
import torch

from megatron_lite.model import fused_softmax
from megatron_lite.model.fused_softmax import FusedScaleMaskSoftmax
from tests.model.softmax_reference import (
    BACKWARD_TOLERANCE,
    FORWARD_TOLERANCE,
    max_error,
    random_padding_mask,
    reference_softmax,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# [b, np, sq, sk]: odd key lengths (1, 17, 1000), batch 1, single rows; causal needs sq == sk.
SHAPES = {
    "none": [(2, 3, 4, 17), (1, 1, 3, 1), (1, 2, 3, 1000), (3, 2, 1, 64)],
    "padding": [(2, 3, 4, 17), (1, 1, 3, 1), (2, 2, 3, 1000), (1, 4, 5, 64)],
    "causal": [(2, 3, 17, 17), (1, 1, 1, 1), (1, 1, 1000, 1000), (1, 2, 64, 64)],
}
CASES = [(kind, shape) for kind, shapes in SHAPES.items() for shape in shapes]


def make_inputs(kind, shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    scores = (3 * torch.randn(shape, generator=generator)).to(dtype)
    b, _, sq, sk = shape
    mask = random_padding_mask(b, sq, sk, generator) if kind == "padding" else None
    grad = torch.randn(shape, generator=generator).to(dtype)
    return scores, mask, grad


def run(softmax, scores, mask, grad):
    scores = scores.clone().requires_grad_(True)
    probs = softmax(scores, mask)
    probs.backward(grad)
    return probs.detach(), scores.grad


def reference(kind, scores, mask, grad, scale):
    scores = scores.double().requires_grad_(True)
    probs = reference_softmax(scores, mask, scale, kind)
    probs.backward(grad.double())
    return probs.detach(), scores.grad


@pytest.mark.parametrize("fusion", [True, False], ids=["kernel", "fallback"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,shape", CASES, ids=[f"{k}-{'x'.join(map(str, s))}" for k, s in CASES])
def test_forward_and_backward_match_float64_reference(kind, shape, dtype, fusion):
    scores, mask, grad = make_inputs(kind, shape, dtype)
    softmax = FusedScaleMaskSoftmax(attn_mask_type=kind, scale=0.37, fusion=fusion)
    probs, grad_scores = run(softmax, scores, mask, grad)
    expected_probs, expected_grad = reference(kind, scores, mask, grad, 0.37)
    assert probs.dtype == dtype and grad_scores.dtype == dtype
    assert max_error(probs, expected_probs) <= FORWARD_TOLERANCE[dtype]
    assert max_error(grad_scores, expected_grad) <= BACKWARD_TOLERANCE[dtype] * max(1.0, expected_grad.abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_is_used_for_cpu_inputs_of_kernel_dtypes(dtype):
    scores = torch.randn(1, 2, 8, 8, dtype=dtype, requires_grad=True)
    probs = FusedScaleMaskSoftmax("causal")(scores)
    assert type(probs.grad_fn).__name__ == "ScaledMaskedSoftmaxBackward"


def test_float64_scores_take_the_fallback_and_match_the_reference():
    scores = torch.randn(2, 2, 9, 9, dtype=torch.float64, requires_grad=True)
    probs = FusedScaleMaskSoftmax("causal", scale=0.5)(scores)
    assert type(probs.grad_fn).__name__ != "ScaledMaskedSoftmaxBackward"
    torch.testing.assert_close(probs, reference_softmax(scores, None, 0.5, "causal"))


@pytest.mark.parametrize("fusion", [True, False], ids=["kernel", "fallback"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fully_masked_rows_give_zero_probabilities_and_zero_gradients(dtype, fusion):
    scores = torch.randn(2, 3, 4, 6, dtype=dtype, requires_grad=True)
    mask = torch.zeros(2, 1, 4, 6, dtype=torch.bool)
    mask[1, 0, 2] = True  # query 2 of batch 1 sees no key, in every head
    probs = FusedScaleMaskSoftmax("padding", fusion=fusion)(scores, mask)
    probs.backward(torch.randn_like(probs))
    assert torch.equal(probs[1, :, 2], torch.zeros_like(probs[1, :, 2]))
    assert torch.equal(scores.grad[1, :, 2], torch.zeros_like(scores.grad[1, :, 2]))
    assert torch.allclose(probs[0].float().sum(-1), torch.ones(3, 4), atol=1e-2)


@pytest.mark.parametrize("fusion", [True, False], ids=["kernel", "fallback"])
@pytest.mark.parametrize("kind", ["causal", "padding"])
def test_masked_scores_never_reach_the_output_even_when_nan(kind, fusion):
    scores, mask, _ = make_inputs(kind, (2, 2, 33, 33), torch.float32)
    hidden = torch.ones(33, 33, dtype=torch.bool).triu(1).expand(2, 1, 33, 33) if kind == "causal" else mask
    poisoned = scores.masked_fill(hidden, float("nan"))
    probs = FusedScaleMaskSoftmax(kind, scale=0.8, fusion=fusion)(poisoned, mask)
    assert torch.equal(probs.masked_select(hidden.expand_as(probs)), torch.zeros(int(hidden.expand_as(probs).sum())))
    assert max_error(probs, reference_softmax(scores, mask, 0.8, kind)) <= 1e-6


@pytest.mark.parametrize("fusion", [True, False], ids=["kernel", "fallback"])
def test_non_contiguous_scores_grads_and_broadcast_masks_are_handled(fusion):
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(2, 17, 4, 17, generator=generator)
    scores = base.transpose(1, 2).requires_grad_(True)  # [2, 4, 17, 17], not contiguous
    key_padding = torch.rand(2, 1, 1, 17, generator=generator) < 0.3
    mask = key_padding.expand(2, 1, 17, 17)  # stride 0 over queries
    probs = FusedScaleMaskSoftmax("padding", scale=0.5, fusion=fusion)(scores, mask)
    grad = torch.randn(2, 4, 17, 17, generator=generator).transpose(-1, -2)  # not contiguous either
    probs.backward(grad)
    expected_probs, expected_grad = reference("padding", scores.detach(), mask, grad, 0.5)
    assert max_error(probs, expected_probs) <= 1e-6
    assert max_error(scores.grad, expected_grad) <= 1e-5


def test_fallback_warns_once_with_rebuild_hint_when_extension_is_missing(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "megatron_lite._C", None)  # makes the import fail
    fused_softmax._compiled.cache_clear()
    try:
        scores = torch.randn(1, 2, 5, 5)
        softmax = FusedScaleMaskSoftmax("causal")
        with pytest.warns(UserWarning, match="pip install --no-build-isolation -e") as caught:
            first = softmax(scores)
            second = softmax(scores)
        assert len([w for w in caught if "megatron_lite._C" in str(w.message)]) == 1
        assert max_error(first, reference_softmax(scores, None, 1.0, "causal")) <= 1e-6
        assert torch.equal(first, second)
    finally:
        fused_softmax._compiled.cache_clear()
