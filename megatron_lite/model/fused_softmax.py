"""FusedScaleMaskSoftmax: softmax(scale * scores) over keys, masked positions excluded.

The compiled kernels (csrc/fused_softmax, loaded from megatron_lite._C) do the
scale, mask, softmax and its backward in one pass each over memory, with float
accumulation for every input dtype. Inputs they do not take (another device,
float64, CUDA rows longer than CUDA_MAX_KEYS) and `fusion=False` go through the
torch fallback, which computes the same thing with eager ops.

Masking, in kernels and fallback alike:
  "causal":  query i sees keys 0..i (needs sq == sk);
  "padding": mask bool [b or 1, 1, sq, sk] (any of the first three dims may be 1),
             True = masked, broadcast over heads; no mask means nothing is masked;
  "none":    every key is seen.
A row whose every key is masked has probability 0 everywhere (not NaN, not uniform),
and gradient 0.

Attention sinks (`sinks`, float [np], one logit per head: --softmax-type off-by-one or learnable) join every
row's denominator, unscaled, and give no value: p_j = exp(scale s_j) / (exp(sink) + sum_k exp(scale s_k)); a
fully masked row then gives the sink all the mass (probabilities 0, as without sinks). The scores' gradient is
the plain formula (the sink's own column has no upstream gradient), and the sink's is
-sum over its head's rows of p_sink x sum_j dp_j p_j: the kernels return both row quantities, in float.
"""
import functools
import importlib
import math
import warnings
from typing import Optional

import torch

MASK_TYPES = ("causal", "padding", "none")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CUDA_MAX_KEYS = 16384
"""Longest key row the CUDA kernels take; longer rows use the fallback."""


@functools.lru_cache(maxsize=None)
def _compiled():
    """The compiled extension, or None (with one warning) when it cannot be imported."""
    try:
        compiled = importlib.import_module("megatron_lite._C")
    except ImportError as error:
        warnings.warn(
            f"megatron_lite._C could not be imported ({error}); FusedScaleMaskSoftmax falls back to "
            "slower eager torch ops. Rebuild the kernels with `pip install --no-build-isolation -e .` "
            "(or `python setup.py build_ext --inplace`) in the megatron_lite checkout.",
            stacklevel=3,
        )
        return None
    if not hasattr(torch.ops.megatron_lite, "scaled_masked_softmax_row_dot_backward"):
        warnings.warn(
            "megatron_lite._C was built from an older checkout (its fused softmax ops are missing); "
            "FusedScaleMaskSoftmax falls back to eager torch ops. Rebuild with "
            "`pip install --no-build-isolation -e .` (or `python setup.py build_ext --inplace`).",
            stacklevel=3,
        )
        return None
    _register_fake_kernels()
    return compiled


def kernel_available(scores: torch.Tensor) -> bool:
    """Whether a compiled kernel takes these scores (the caller has checked them)."""
    if scores.dtype not in KERNEL_DTYPES:
        return False
    if not _kernels_on(scores.device.type):
        return False
    return scores.device.type == "cpu" or scores.size(-1) <= CUDA_MAX_KEYS


@torch.compiler.assume_constant_result
def _kernels_on(device_type: str) -> bool:
    """Whether the extension loaded with kernels for this kind of device. A constant to a compiled layer
    (model/compile.py): dynamo cannot trace the import, and the answer does not change within a process."""
    compiled = _compiled()
    return compiled is not None and (device_type == "cpu" or (device_type == "cuda" and compiled.with_cuda))


def _register_fake_kernels() -> None:
    """Output shapes of the four ops for tracing (torch.compile runs them on fake tensors first): the
    probabilities and gradients are the scores' shape and dtype; the sink probabilities and row dots one fp32
    number per row."""
    def rows(t):
        return t.new_empty((math.prod(t.shape[:-1]),), dtype=torch.float32)

    torch.library.register_fake("megatron_lite::scaled_masked_softmax_forward",
                                lambda scores, mask, scale, causal: torch.empty_like(scores, memory_format=torch.contiguous_format))
    torch.library.register_fake("megatron_lite::scaled_masked_softmax_backward",
                                lambda grad, probs, scale, causal: torch.empty_like(probs, memory_format=torch.contiguous_format))
    torch.library.register_fake("megatron_lite::scaled_masked_softmax_sink_forward",
                                lambda scores, mask, sinks, scale, causal: (
                                    torch.empty_like(scores, memory_format=torch.contiguous_format), rows(scores)))
    torch.library.register_fake("megatron_lite::scaled_masked_softmax_row_dot_backward",
                                lambda grad, probs, scale, causal: (
                                    torch.empty_like(probs, memory_format=torch.contiguous_format), rows(probs)))


class ScaledMaskedSoftmax(torch.autograd.Function):
    """The kernels' forward and backward; the backward needs only the saved probabilities."""

    @staticmethod
    def forward(ctx, scores, mask, scale, causal):
        # Non-contiguous scores or masks are copied to contiguous ones inside the op.
        probs = torch.ops.megatron_lite.scaled_masked_softmax_forward(scores, mask, scale, causal)
        ctx.save_for_backward(probs)
        ctx.scale, ctx.causal = scale, causal
        return probs

    @staticmethod
    def backward(ctx, grad_probs):
        (probs,) = ctx.saved_tensors
        grad_scores = torch.ops.megatron_lite.scaled_masked_softmax_backward(grad_probs, probs, ctx.scale, ctx.causal)
        return grad_scores, None, None, None


class ScaledMaskedSoftmaxWithSinks(torch.autograd.Function):
    """The kernels with attention sinks: the forward also returns each row's sink probability, the backward each
    row's dot(dp, p); the sink's gradient is made from the two here ([rows] numbers, not another pass)."""

    @staticmethod
    def forward(ctx, scores, mask, sinks, scale, causal):
        probs, sink_probs = torch.ops.megatron_lite.scaled_masked_softmax_sink_forward(
            scores, mask, sinks.float(), scale, causal)
        ctx.save_for_backward(probs, sink_probs)
        ctx.scale, ctx.causal, ctx.sink_dtype = scale, causal, sinks.dtype
        return probs

    @staticmethod
    def backward(ctx, grad_probs):
        probs, sink_probs = ctx.saved_tensors
        grad_scores, dots = torch.ops.megatron_lite.scaled_masked_softmax_row_dot_backward(
            grad_probs, probs, ctx.scale, ctx.causal)
        grad_sinks = None
        if ctx.needs_input_grad[2]:
            b, heads, sq, _ = probs.shape
            grad_sinks = -(sink_probs * dots).view(b, heads, sq).sum((0, 2)).to(ctx.sink_dtype)
        return grad_scores, None, grad_sinks, None, None


def softmax_with_sinks(logits: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of logits [b, np, sq, sk] with each head's sink as one more column, dropped after
    it (in the logits' dtype)."""
    column = sinks.to(logits.dtype).view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :-1]


def torch_softmax(scores, mask, scale, causal, softmax_in_fp32=True, sinks=None):
    """The fallback: the same masked softmax from eager torch ops (autograd gives the backward); sinks as one
    more column of the softmax, dropped after it."""
    x = scores.float() if softmax_in_fp32 and scores.dtype in (torch.float16, torch.bfloat16) else scores
    if causal:
        sq, sk = x.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)
    x = x * scale
    if mask is not None:
        # The dtype's lowest finite value rather than -inf keeps fully masked rows free of NaN
        # (in the backward too); exp() of it minus any row max is exactly 0.
        x = x.masked_fill(mask, torch.finfo(x.dtype).min)
    probs = torch.softmax(x, dim=-1) if sinks is None else softmax_with_sinks(x, sinks)
    if mask is not None:
        probs = probs.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)
    return probs.to(scores.dtype)


def check_inputs(scores: torch.Tensor, mask: Optional[torch.Tensor], attn_mask_type: str,
                 sinks: Optional[torch.Tensor] = None) -> None:
    """Raise with the offending shape or dtype and what would work."""
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
        got = scores.dtype if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise TypeError(f"FusedScaleMaskSoftmax: scores must be a float32, bfloat16 or float16 tensor, got {got}")
    if scores.dim() != 4:
        raise ValueError(f"FusedScaleMaskSoftmax: scores must be [b, np, sq, sk], got shape {tuple(scores.shape)}")
    b, heads, sq, sk = scores.shape
    if attn_mask_type == "causal" and sq != sk:
        raise ValueError(
            f"FusedScaleMaskSoftmax: the causal mask needs sq == sk, got scores of shape {tuple(scores.shape)}"
        )
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != heads or not sinks.is_floating_point()
                              or sinks.device != scores.device):
        raise ValueError(f"FusedScaleMaskSoftmax: sinks must be a float tensor of shape [{heads}] (one per head) on "
                         f"{scores.device}, got {tuple(sinks.shape)} {sinks.dtype} on {sinks.device}")
    if mask is None:
        return
    if attn_mask_type != "padding":
        raise ValueError(
            f"FusedScaleMaskSoftmax: a mask was given but attn_mask_type is {attn_mask_type!r}; "
            "use attn_mask_type='padding' to apply it, or pass mask=None"
        )
    if mask.dtype != torch.bool:
        raise TypeError(f"FusedScaleMaskSoftmax: mask must be torch.bool (True = masked), got {mask.dtype}")
    if mask.device != scores.device:
        raise ValueError(f"FusedScaleMaskSoftmax: mask is on {mask.device} but scores are on {scores.device}")
    fits = mask.dim() == 4 and mask.size(3) == sk and all(mask.size(d) in (1, scores.size(d)) for d in range(3))
    if not fits:
        raise ValueError(
            f"FusedScaleMaskSoftmax: mask of shape {tuple(mask.shape)} does not fit scores of shape "
            f"{tuple(scores.shape)}; use [{b} or 1, 1, {sq}, {sk}]"
        )


class FusedScaleMaskSoftmax(torch.nn.Module):
    """probs = softmax(scale * scores, masked keys excluded), in the dtype of the scores.

    attn_mask_type: "causal", "padding" or "none" (see the module docstring).
    scale: multiplies the scores before the softmax; None means 1.
    softmax_in_fp32: the fallback computes fp16/bf16 scores in float32 (the kernels always do).
    fusion: False forces the torch fallback.
    """

    def __init__(self, attn_mask_type="causal", scale=None, softmax_in_fp32=True, fusion=True):
        super().__init__()
        if attn_mask_type not in MASK_TYPES:
            raise ValueError(
                f"FusedScaleMaskSoftmax: attn_mask_type must be one of {MASK_TYPES}, got {attn_mask_type!r}"
            )
        self.attn_mask_type = attn_mask_type
        self.scale = 1.0 if scale is None else float(scale)
        self.softmax_in_fp32 = softmax_in_fp32
        self.fusion = fusion

    def forward(self, scores: torch.Tensor, mask: Optional[torch.Tensor] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """sinks: None, or float [np] attention-sink logits (module docstring)."""
        check_inputs(scores, mask, self.attn_mask_type, sinks)
        causal = self.attn_mask_type == "causal"
        if self.fusion and kernel_available(scores):
            if sinks is not None:
                return ScaledMaskedSoftmaxWithSinks.apply(scores, mask, sinks, self.scale, causal)
            return ScaledMaskedSoftmax.apply(scores, mask, self.scale, causal)
        return torch_softmax(scores, mask, self.scale, causal, self.softmax_in_fp32, sinks)

    def extra_repr(self) -> str:
        return f"attn_mask_type={self.attn_mask_type!r}, scale={self.scale}, fusion={self.fusion}"
