"""Comparing a TP rank's tensors with the dense single-process reference."""
import torch

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
