"""Float64 reference for the fused softmax tests, written independently of the module under test."""
import torch

# Largest error allowed against the float64 reference, per dtype: fp32 is near exact; the
# low-precision outputs are within a few rounding steps of a value in [0, 1].
FORWARD_TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}
# Gradients reach |dy| (a few units), and the kernel starts from the probabilities rounded to
# the input dtype, so the low-precision bounds scale with the gradient's magnitude.
BACKWARD_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def reference_softmax(scores, mask, scale, mask_type):
    """softmax(scale * scores) in float64 with masked keys at probability 0 and fully masked rows all 0.

    Differentiable without NaN: fully masked rows are computed unmasked and then multiplied by 0.
    """
    x = scores.double() * scale
    sq, sk = x.shape[-2:]
    if mask_type == "causal":
        mask = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)
    if mask is None or mask_type == "none":
        return torch.softmax(x, dim=-1)
    fully_masked = mask.all(dim=-1, keepdim=True)
    x = x.masked_fill(mask & ~fully_masked, float("-inf"))
    return torch.softmax(x, dim=-1) * ~fully_masked


def random_padding_mask(b, sq, sk, generator, fully_masked_row=True):
    """bool [b, 1, sq, sk], True = masked, about 30% masked, with one fully masked row when there is room."""
    mask = torch.rand(b, 1, sq, sk, generator=generator) < 0.3
    if fully_masked_row and sq > 1:
        mask[0, 0, sq // 2] = True
    return mask


def max_error(actual, expected):
    return (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
