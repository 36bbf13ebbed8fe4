"""The numerical guard's section: Megatron-LM's checks of each rank's loss and gradients, its rerun state machine's
mode and tracker file, our rolling skip-step, and fault injection for drills; and --inject-fault's syntax."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from megatron_lite.config.errors import ConfigError
from megatron_lite.config.option import option

FAULT_KINDS = ("nan_grad", "inf_loss", "spike_loss")
PERSISTENT = "persistent"
"""--inject-fault's suffix for a fault that corrupts the step's replay too (a reproducible fault)."""
RERUN_MODES = ("validate_results", "report_stats", "disabled")
INJECT_FAULT_ENV = "MEGATRON_LITE_INJECT_FAULT"
"""The environment variable that sets --inject-fault when the flag is not given (same syntax)."""

Fault = Tuple[str, int, int, bool]
"""(kind, global rank, iteration, persistent): a persistent fault corrupts every attempt at the step (the replay
of --rerun-mode too), a transient one only the first."""


def parse_faults(text: Union[str, Sequence[str]], source: str = "--inject-fault") -> Tuple[Fault, ...]:
    """'nan_grad:1:3:persistent,spike_loss:0:5' -> (('nan_grad', 1, 3, True), ('spike_loss', 0, 5, False)).
    Syntax and per-value ranges only; that the rank and iteration exist is validation's."""
    if not isinstance(text, str):
        text = ",".join(text)
    faults: List[Fault] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, *numbers = item.split(":")
        persistent = len(numbers) == 3 and numbers[2] == PERSISTENT
        numbers = numbers[:2] if persistent else numbers
        ok = kind in FAULT_KINDS and len(numbers) == 2 and all(n.isdigit() for n in numbers)
        if not ok or int(numbers[1]) < 1:
            raise ConfigError(f"{source} '{item}' must be KIND:RANK:ITERATION[:{PERSISTENT}] with KIND one of "
                              f"{', '.join(FAULT_KINDS)}, RANK >= 0 and ITERATION >= 1, e.g. nan_grad:1:3",
                              code="inject_fault_syntax")
        faults.append((kind, int(numbers[0]), int(numbers[1]), persistent))
    return tuple(faults)


def format_faults(faults: Tuple[Fault, ...]) -> List[str]:
    return [",".join(f"{kind}:{rank}:{iteration}" + (f":{PERSISTENT}" if persistent else "")
                     for kind, rank, iteration, persistent in faults)]


@dataclass(frozen=True)
class NumericalGuardConfig:
    check_for_nan_in_loss_and_grad: bool = option(True, "--check-for-nan-in-loss-and-grad",
                                                  action="boolean_optional")
    """Before any gradient is reduced, each rank checks its own loss and accumulated gradients for NaN/Inf; on a
    hit the step is applied on no rank, replayed as --rerun-mode says, and the run stops naming the rank (exit 16,
    17, or 18 with --rerun-mode disabled). At --zero-stage 2/3 (which
    reduce inside backward) and with --fp16 (whose loss scaler owns overflowing gradients) the loss only."""
    check_for_spiky_loss: bool = option(False, "--check-for-spiky-loss")
    """Skip the update of a step whose loss is over 10x the largest of the run's first 100 losses."""
    check_for_large_grads: bool = option(False, "--check-for-large-grads")
    """Skip the update of a step whose gradient norm (before the reduction) is over 10x the largest of the first 100."""
    skip_update_sigma: Optional[float] = option(None, "--skip-update-sigma", above=0, maximum=1e6)
    """Skip the update of a step whose loss or gradient norm is more than this many standard deviations above the
    mean of the last --skip-update-window applied steps (once that many were applied); off when not given."""
    skip_update_window: int = option(128, "--skip-update-window", minimum=2, maximum=10 ** 6)
    """Applied steps the --skip-update-sigma rule's mean and deviation are taken over."""
    rerun_mode: str = option("validate_results", "--rerun-mode", choices=RERUN_MODES)
    """Megatron-LM's rerun state machine (training/rerun.py). validate_results: a step the guard rejects is not
    applied and is replayed in place (its RNG states and micro-batches) to tell a transient fault from a
    reproducible one: a reproducible NaN/Inf saves and exits 16, a transient one exits 17 without saving, a spike
    stays skipped. report_stats: every step runs twice and the loss's relative difference is reported every log
    interval. disabled: no replay (a NaN/Inf exits 18). Under ZeRO 2/3 there is no replay."""
    result_rejected_tracker_filename: Optional[str] = option(None, "--result-rejected-tracker-filename")
    """A file rank 0 appends one JSON line to per step the rerun rejected (ts, node, rank, iteration, status,
    result, message); at start-up an iteration it shows reproducible on the same rank twice is skipped
    (--iterations-to-skip)."""
    inject_fault: Tuple[Fault, ...] = option((), "--inject-fault", parse=parse_faults, unparse=format_faults,
                                             metavar="KIND:RANK:ITERATION[:persistent][,...]")
    """For tests and drills: corrupt real numbers on a rank at an iteration. nan_grad: a NaN in one accumulated
    gradient; inf_loss: the loss Inf; spike_loss: the loss (and so its gradients) x 1000 (loss kinds on a last
    pipeline stage's rank). Transient (the step's first attempt only) unless :persistent (its replay too). Also
    read from MEGATRON_LITE_INJECT_FAULT when the flag is not given."""
