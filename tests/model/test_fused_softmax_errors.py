"""FusedScaleMaskSoftmax and its ops reject bad inputs with messages that name the problem."""
import pytest
import torch

import megatron_lite._C  # noqa: F401  (registers torch.ops.megatron_lite)
from megatron_lite.model.fused_softmax import FusedScaleMaskSoftmax


def test_unknown_mask_type_is_rejected_at_construction():
    with pytest.raises(ValueError, match="attn_mask_type must be one of"):
        FusedScaleMaskSoftmax("triangular")


@pytest.mark.parametrize("fusion", [True, False], ids=["kernel", "fallback"])
def test_integer_scores_are_rejected(fusion):
    with pytest.raises(TypeError, match="float32, bfloat16 or float16 tensor, got torch.int64"):
        FusedScaleMaskSoftmax("none", fusion=fusion)(torch.ones(1, 1, 2, 2, dtype=torch.long))


def test_scores_must_be_four_dimensional():
    with pytest.raises(ValueError, match=r"\[b, np, sq, sk\], got shape \(4, 8, 8\)"):
        FusedScaleMaskSoftmax("causal")(torch.randn(4, 8, 8))


def test_causal_needs_square_scores():
    with pytest.raises(ValueError, match="causal mask needs sq == sk"):
        FusedScaleMaskSoftmax("causal")(torch.randn(1, 2, 4, 8))


@pytest.mark.parametrize(
    "mask_shape", [(2, 1, 4), (2, 1, 4, 7), (3, 1, 4, 8), (2, 1, 5, 8)], ids=["3d", "sk", "batch", "sq"]
)
def test_padding_mask_of_wrong_shape_is_rejected_with_a_shape_that_works(mask_shape):
    with pytest.raises(ValueError, match=r"use \[2 or 1, 1, 4, 8\]"):
        FusedScaleMaskSoftmax("padding")(torch.randn(2, 3, 4, 8), torch.zeros(mask_shape, dtype=torch.bool))


def test_padding_mask_must_be_bool():
    with pytest.raises(TypeError, match="mask must be torch.bool"):
        FusedScaleMaskSoftmax("padding")(torch.randn(2, 3, 4, 8), torch.zeros(2, 1, 4, 8))


@pytest.mark.parametrize("kind", ["causal", "none"])
def test_mask_given_to_a_maskless_type_is_rejected_not_ignored(kind):
    with pytest.raises(ValueError, match="use attn_mask_type='padding'"):
        FusedScaleMaskSoftmax(kind)(torch.randn(1, 1, 4, 4), torch.zeros(1, 1, 4, 4, dtype=torch.bool))


def test_ops_reject_float64_with_the_dtypes_they_take():
    with pytest.raises(RuntimeError, match="input must be float32, bfloat16 or float16, got Double"):
        torch.ops.megatron_lite.scaled_masked_softmax_forward(torch.randn(2, 2, dtype=torch.float64), None, 1.0, False)


def test_ops_reject_a_mask_that_does_not_broadcast():
    with pytest.raises(RuntimeError, match="does not broadcast to input shape"):
        torch.ops.megatron_lite.scaled_masked_softmax_forward(
            torch.randn(2, 3, 4, 8), torch.zeros(2, 3, 1, 8, dtype=torch.bool)[:, :1, :, :3], 1.0, False
        )


def test_ops_reject_mismatched_gradient_shape():
    probs = torch.softmax(torch.randn(2, 4, 4), -1)
    with pytest.raises(RuntimeError, match="grad_output shape"):
        torch.ops.megatron_lite.scaled_masked_softmax_backward(torch.randn(2, 4, 3), probs, 1.0, True)
