"""--inject-fault (or MEGATRON_LITE_INJECT_FAULT): real numbers corrupted on a chosen rank at a chosen iteration,
for tests and drills of the numerical guard (training/numerical_guard.py). Megatron-LM's --error-injection-rate
only fakes a check's outcome; here the loss and gradients the checks read are wrong, as a faulty device's are."""
from __future__ import annotations

from typing import List, Tuple

import torch

SPIKE_FACTOR = 1000.0
"""spike_loss multiplies the rank's loss, and through backward its gradients, by this."""


class FaultInjector:
    """The faults of one rank (config's (kind, rank, iteration, persistent)), applied at their iteration: on the
    step's first attempt, and on its replays (training/rerun.py sets `attempt`) only when persistent, so that the
    rerun tells a transient fault from a reproducible one from real numbers."""

    def __init__(self, faults: Tuple[Tuple[str, int, int, bool], ...], rank: int):
        self.faults = {(kind, iteration): persistent
                       for kind, fault_rank, iteration, persistent in faults if fault_rank == rank}
        self.attempt = 0
        """0: the step's first run; 1, ...: its replays."""

    def wants(self, kind: str, iteration: int) -> bool:
        persistent = self.faults.get((kind, iteration))
        return persistent is not None and (self.attempt == 0 or persistent)

    @property
    def corrupts_loss(self) -> bool:
        return any(kind in ("inf_loss", "spike_loss") for kind, _ in self.faults)

    def loss(self, loss: torch.Tensor, iteration: int) -> torch.Tensor:
        """A micro-batch's loss as this rank computes it at `iteration`, before its backward."""
        if self.wants("inf_loss", iteration):
            return loss + float("inf")  # the loss Inf, its gradients as they were: a loss fault only
        if self.wants("spike_loss", iteration):
            return loss * SPIKE_FACTOR
        return loss

    def gradients(self, grads: List[torch.Tensor], iteration: int) -> None:
        """nan_grad: a NaN written into the first of this rank's accumulated gradients, in place."""
        if self.wants("nan_grad", iteration) and grads:
            with torch.no_grad():
                grads[0].view(-1)[0] = float("nan")
