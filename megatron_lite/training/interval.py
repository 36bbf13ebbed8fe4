"""What the training loop adds up between two log lines, and over the whole run (training/loop.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from megatron_lite.training.engine import StepStats


@dataclass
class Interval:
    """What happened since the last log line."""
    seconds: float = 0.0
    """Time spent in training steps (evaluation and saving excluded)."""
    iterations: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    mtp_sums: Optional[List[float]] = None
    """With --mtp-num-layers: each depth's loss, summed over the steps."""
    skipped: int = 0
    global_batch_size: int = 0
    """The last step's global batch (it grows during ramp-up)."""

    def add(self, stats: StepStats, samples: int, seconds: float) -> None:
        self.seconds += seconds
        self.iterations += 1
        self.samples += samples
        self.loss_sum += stats.loss
        if stats.mtp_losses is not None:
            self.mtp_sums = [a + b for a, b in zip(self.mtp_sums or [0.0] * len(stats.mtp_losses), stats.mtp_losses)]
        self.skipped += int(stats.skipped)
        self.global_batch_size = samples

    def mtp_scalars(self) -> dict:
        """Each Multi-Token Prediction depth's mean loss over the interval ({} without depths)."""
        if self.mtp_sums is None:
            return {}
        return {f"mtp/depth{k}_loss": total / self.iterations for k, total in enumerate(self.mtp_sums, 1)}
