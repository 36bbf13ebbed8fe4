"""FusedScaleMaskSoftmax's CUDA kernels against the float64 reference; skipped without a GPU."""
import pytest
import torch

from megatron_lite.model.fused_softmax import CUDA_MAX_KEYS, FusedScaleMaskSoftmax
from tests.model.softmax_reference import (
    BACKWARD_TOLERANCE,
    FORWARD_TOLERANCE,
    max_error,
    random_padding_mask,
    reference_softmax,
)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Warp-per-row (sk <= 1024) and block-per-row rows, with and without 16-byte loads (odd sk),
# up to the longest row the kernels take.
KEY_LENGTHS = [1, 17, 1000, 1024, 1025, 4099, CUDA_MAX_KEYS]


def make_inputs(kind, b, heads, sq, sk, dtype, storage_offset=0):
    generator = torch.Generator().manual_seed(sk)
    numel = b * heads * sq * sk
    flat = 3 * torch.randn(numel + storage_offset, generator=generator)
    scores = flat[storage_offset:].view(b, heads, sq, sk).to("cuda", dtype)
    mask = random_padding_mask(b, sq, sk, generator).cuda() if kind == "padding" else None
    grad = torch.randn(b, heads, sq, sk, generator=generator).to("cuda", dtype)
    return scores, mask, grad


def check_against_reference(kind, scores, mask, grad, scale=0.37, expect_kernel=True):
    leaf = scores.detach().clone().requires_grad_(True)
    probs = FusedScaleMaskSoftmax(kind, scale=scale)(leaf, mask)
    probs.backward(grad)
    assert (type(probs.grad_fn).__name__ == "ScaledMaskedSoftmaxBackward") == expect_kernel
    reference_input = scores.detach().double().requires_grad_(True)
    expected = reference_softmax(reference_input, mask, scale, kind)
    expected.backward(grad.double())
    dtype = scores.dtype
    assert max_error(probs, expected) <= FORWARD_TOLERANCE[dtype]
    bound = BACKWARD_TOLERANCE[dtype] * max(1.0, reference_input.grad.abs().max().item())
    assert max_error(leaf.grad, reference_input.grad) <= bound


def test_extension_was_built_with_cuda_kernels():
    from megatron_lite import _C

    assert _C.with_cuda, "a GPU is present but megatron_lite._C has no CUDA kernels; rebuild with nvcc on PATH"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sk", KEY_LENGTHS)
@pytest.mark.parametrize("kind", ["none", "padding"])
def test_unmasked_and_padding_kernels_match_float64_reference(kind, sk, dtype):
    check_against_reference(kind, *make_inputs(kind, 2, 2, 3, sk, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("s", [1, 17, 256, 1025, 2048])
def test_causal_kernel_matches_float64_reference(s, dtype):
    check_against_reference("causal", *make_inputs("causal", 1, 2, s, s, dtype))


@pytest.mark.parametrize("kind", ["none", "padding"])
def test_misaligned_scores_use_scalar_loads_and_stay_correct(kind):
    check_against_reference(kind, *make_inputs(kind, 2, 2, 3, 1024, torch.float32, storage_offset=1))


def test_rows_longer_than_the_kernels_take_fall_back_with_the_same_result():
    check_against_reference("padding", *make_inputs("padding", 1, 1, 2, CUDA_MAX_KEYS + 1, torch.float32),
                            expect_kernel=False)


def test_fully_masked_rows_are_zero_on_gpu():
    scores = torch.randn(1, 2, 3, 40, device="cuda", requires_grad=True)
    mask = torch.zeros(1, 1, 3, 40, dtype=torch.bool, device="cuda")
    mask[0, 0, 1] = True
    probs = FusedScaleMaskSoftmax("padding")(scores, mask)
    probs.backward(torch.randn_like(probs))
    assert torch.equal(probs[0, :, 1], torch.zeros(2, 40, device="cuda"))
    assert torch.equal(scores.grad[0, :, 1], torch.zeros(2, 40, device="cuda"))


def sink_reference(scores, mask, sinks, scale, kind):
    """float64: the sink one more column of the softmax, dropped after it."""
    x = scores.double() * scale
    sq, sk = x.shape[-2:]
    if kind == "causal":
        mask = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)
    if mask is not None:
        x = x.masked_fill(mask, float("-inf"))
    column = sinks.double().view(1, -1, 1, 1).expand(*x.shape[:-1], 1)
    return torch.softmax(torch.cat([x, column], dim=-1), dim=-1)[..., :-1]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind, sk", [("causal", 17), ("causal", 1025), ("padding", 1000), ("padding", 4099),
                                      ("none", 1024)])
def test_the_kernels_with_sinks_match_the_float64_reference_and_give_the_sinks_their_gradient(kind, sk, dtype):
    sq = sk if kind == "causal" else 3
    scores, mask, grad = make_inputs(kind, 2, 3, sq, sk, dtype)
    sinks = torch.randn(3, device="cuda") * 2
    leaf, sink = scores.detach().clone().requires_grad_(True), sinks.clone().requires_grad_(True)
    probs = FusedScaleMaskSoftmax(kind, scale=0.37)(leaf, mask, sink)
    probs.backward(grad)
    assert type(probs.grad_fn).__name__ == "ScaledMaskedSoftmaxWithSinksBackward"
    x64, sink64 = scores.detach().double().requires_grad_(True), sinks.double().requires_grad_(True)
    expected = sink_reference(x64, mask, sink64, 0.37, kind)
    expected.backward(grad.double())
    assert max_error(probs, expected) <= FORWARD_TOLERANCE[dtype]
    bound = BACKWARD_TOLERANCE[dtype] * max(1.0, x64.grad.abs().max().item())
    assert max_error(leaf.grad, x64.grad) <= bound
    relative = ((sink.grad.double() - sink64.grad).norm() / sink64.grad.norm()).item()
    assert relative <= (1e-5 if dtype == torch.float32 else 5e-2)
