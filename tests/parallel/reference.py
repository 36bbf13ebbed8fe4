"""Comparing a TP rank's tensors with the dense single-process reference."""
import torch
from torch import nn

MAX_RELATIVE_ERROR = 1e-5


def rank_slice(tensor: torch.Tensor, rank: int, world: int, dim: int) -> torch.Tensor:
    """Rank's contiguous 1/world of tensor along dim: what a TP rank holds of a dense tensor."""
    return tensor.chunk(world, dim=dim)[rank]


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|: stable where single elements are near zero."""
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30)).item()


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = MAX_RELATIVE_ERROR) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != dense {tuple(expected.shape)}"
    err = max_relative_error(actual, expected)
    assert err <= tol, f"{what}: max relative error {err:.2e} > {tol:.0e}"


def master_weights(*shapes, std: float = 0.02):
    """The TP = 1 weights the parallel layers draw, in order, from the current seed: normal(0, std) drawn on
    the CPU as layers.py draws every master (so values do not depend on the device), then put on the test
    device (tests/device.py). Drawn on the test device instead, a CUDA run compared the layers' CPU-drawn
    weights with CUDA-drawn ones (the GPU check's failures in test_layers.py, test_grad_norm.py)."""
    device = torch.empty(0).device
    return [nn.init.normal_(torch.empty(shape, device="cpu"), 0.0, std).to(device) for shape in shapes]
