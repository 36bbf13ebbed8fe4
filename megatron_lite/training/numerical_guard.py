"""The numerical guard: each rank's loss and gradients checked before any reduction, every rank agreeing
whether the step is applied, stopped on (NaN/Inf) or left out (a spike).

Once per step, where the engine calls `check` (deepspeed_compat/step_guard.py says where that is):

  1. this rank's numbers, on the device, without a host sync: its loss (the mean of its micro-batch losses,
     where it computes one), whether it is finite, and the squared norm of its accumulated gradients from one
     fused torch._foreach_norm, whether they are all finite;
  2. one all-reduce (sum) of those five numbers over the world, and one host read of the result;
  3. the decision, the same on every rank from the same reduced numbers: a NaN/Inf anywhere stops the run
     (NumericalFault, before any rank's update; the ranks are named from one all-gather made only then);
     Rules may leave the update out (a spike); otherwise the step is applied.

The statistics the rules see are the same on every rank: the loss is the mean over the ranks that compute one
(the loss DeepSpeed reports), the gradient norm the root of the sum of every rank's local squared norm before
the reduction (monotone in each rank's own; replicated parameters count once per replica).

Under --rerun-mode (training/rerun.py sets `phase`): FIRST rejects instead of raising (`rejection`, the update left
out) so that the step can be replayed; NUMBERS_ONLY takes the numbers of a replay, judges nothing and leaves the
update out.
"""
from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional

import torch
import torch.distributed as dist

from megatron_lite import fault_log
from megatron_lite.config.numerical_guard import NumericalGuardConfig
from megatron_lite.exit_codes import EXIT_NUMERICAL_FAULT
from megatron_lite.training.fault_injection import FaultInjector

SPIKE_FACTOR = 10.0
"""Megatron-LM's SPIKY_LOSS_FACTOR: --check-for-spiky-loss / --check-for-large-grads reject a value this many
times the largest of the first FIRST_VALUES."""
FIRST_VALUES = 100

APPLY, FIRST, NUMBERS_ONLY = "apply", "first", "numbers_only"
"""The guard's phases: a step as usual; a step's first run under --rerun-mode validate_results; a run whose
numbers only are wanted (a replay, report_stats' first run)."""


class NumericalFault(Exception):
    """A NaN/Inf in a rank's loss or gradients: raised on every rank at once, before any update; str() is the
    line to print."""


class Rules:
    """Whether an applied-so-far-finite step's update is left out: --check-for-spiky-loss and
    --check-for-large-grads (Megatron-LM's: over 10x the largest of the first 100 values) and --skip-update-sigma
    (ours, as OLMo-core's SkipStepOptimizer: above the mean of the last W applied steps by more than N standard
    deviations, once W steps were applied). Pure Python; the same on every rank, saved in the checkpoint."""

    def __init__(self, g: NumericalGuardConfig):
        self.g = g
        self.first_max = {"loss": 0.0, "grad_norm": 0.0}
        self.first_count = {"loss": 0, "grad_norm": 0}
        self.window = {"loss": deque(maxlen=g.skip_update_window), "grad_norm": deque(maxlen=g.skip_update_window)}

    def reason_to_skip(self, loss: Optional[float], grad_norm: Optional[float]) -> Optional[str]:
        """Why this step's update is left out, or None to apply it (and remember it)."""
        values = {"loss": loss, "grad_norm": grad_norm}
        tenfold = {"loss": self.g.check_for_spiky_loss, "grad_norm": self.g.check_for_large_grads}
        reason = None
        for name, value in values.items():
            if value is None:
                continue
            if tenfold[name] and self.first_count[name] >= FIRST_VALUES and value > SPIKE_FACTOR * self.first_max[name]:
                reason = reason or (f"{name} {value:.6g} is over {SPIKE_FACTOR:g}x the largest of the first "
                                    f"{FIRST_VALUES} ({self.first_max[name]:.6g})")
            window = self.window[name]
            if self.g.skip_update_sigma is not None and len(window) == window.maxlen:
                mean = sum(window) / len(window)
                std = math.sqrt(sum((v - mean) ** 2 for v in window) / len(window))
                if value - mean > self.g.skip_update_sigma * std:
                    reason = reason or (f"{name} {value:.6g} is {_sigmas(value - mean, std)} above the mean "
                                        f"{mean:.6g} of the last {len(window)} applied steps "
                                        f"(--skip-update-sigma {self.g.skip_update_sigma:g})")
        for name, value in values.items():
            if value is None:
                continue
            if self.first_count[name] < FIRST_VALUES:  # Megatron-LM counts every checked value, rejected or not
                self.first_count[name] += 1
                self.first_max[name] = max(self.first_max[name], abs(value))
            if reason is None:
                self.window[name].append(value)
        return reason

    def state_dict(self) -> dict:
        return {"first_max": dict(self.first_max), "first_count": dict(self.first_count),
                "window": {name: list(values) for name, values in self.window.items()}}

    def load_state_dict(self, saved: Optional[dict]) -> None:
        """A checkpoint's rules state; one saved before the guard existed (None) leaves the fresh state."""
        if not saved:
            return
        self.first_max.update(saved["first_max"])
        self.first_count.update(saved["first_count"])
        for name, values in saved["window"].items():
            self.window[name] = deque(values, maxlen=self.g.skip_update_window)


def _sigmas(distance: float, std: float) -> str:
    return f"{distance / std:.1f} sigma" if std > 0 else "above a constant window"


@dataclass
class Rejection:
    """Why a step's first run was rejected (phase FIRST): fatal for NaN/Inf, not for a spike."""
    fatal: bool
    message: str
    loss_fault: bool
    """The loss was at fault (else the gradients): which value the rerun's record shows."""


@dataclass
class Coordinates:
    """Where a rank sits: for the line that names it."""
    rank: int
    tp: int
    pp: int
    dp: int
    host: str

    def __str__(self) -> str:
        return f"rank {self.rank} (tp {self.tp}, pp {self.pp}, dp {self.dp}, host {self.host})"


class NumericalGuard:
    """The guard of one rank's engine. `iteration` is set by the engine before each step (for the faults and
    the line); `skip_update` answers the optimizer-step hook of the step just checked."""

    def __init__(self, g: NumericalGuardConfig, check_gradients: bool, coordinates: Coordinates,
                 device: torch.device):
        self.g = g
        self.check_gradients = check_gradients
        self.coordinates = coordinates
        self.device = device
        self.rules = Rules(g)
        self.injector = FaultInjector(g.inject_fault, coordinates.rank)
        self.iteration = 0
        self.skip_update = False
        self.skip_reason: Optional[str] = None
        self.phase = APPLY
        self.rejection: Optional[Rejection] = None
        self.local: Optional[torch.Tensor] = None
        """This rank's numbers of the last check under the rerun (phase not APPLY), before the reduction: [bad loss,
        bad gradient, loss, computes a loss, squared gradient norm]."""
        self.suspicious: Optional[dict] = None
        """After a reproducible fault (training/rerun.py): the iteration, rank and host, saved in the checkpoint."""

    @property
    def active(self) -> bool:
        """Whether check() has anything to do: a check, a rule or a fault."""
        g = self.g
        return bool(g.check_for_nan_in_loss_and_grad or g.check_for_spiky_loss or g.check_for_large_grads
                    or g.skip_update_sigma is not None or g.inject_fault)

    def check(self, loss_sum: Optional[torch.Tensor], micro_batches: int, grads: List[torch.Tensor]) -> None:
        """This rank's step numbers, before any reduction: raise NumericalFault on every rank, or set
        skip_update the same on every rank. loss_sum: the sum of this rank's micro-batch losses (None where it
        computes none); grads: its accumulated gradients (none checked with check_gradients False)."""
        self.injector.gradients(grads, self.iteration)
        grads = grads if self.check_gradients else []
        local = torch.zeros(5, dtype=torch.float64, device=self.device)
        if loss_sum is not None:
            loss = loss_sum.detach().double().reshape(()) / micro_batches
            local[0] = (~torch.isfinite(loss)).double()
            local[2] = loss
            local[3] = 1.0
        if grads:
            norms = torch.stack(torch._foreach_norm(grads)).double()  # one fused pass over every gradient
            local[1] = (~torch.isfinite(norms)).any().double()
            local[4] = norms.square().sum()
        if self.phase != APPLY:  # for the rerun, which takes it at once: no tensor held between steps
            self.local = local
        reduced = local.clone()
        dist.all_reduce(reduced)
        bad_loss, bad_grad, loss_total, loss_count, grad_square = reduced.tolist()
        self.skip_update, self.skip_reason = False, None
        if self.phase == NUMBERS_ONLY:
            self.skip_update = True
            return
        if bad_loss or bad_grad:
            if self.g.check_for_nan_in_loss_and_grad and self.phase == FIRST:  # replayed next (training/rerun.py)
                line = self._fault_line(local)
                self.rejection = Rejection(True, line, loss_fault=bool(bad_loss))
                self.skip_update, self.skip_reason = True, line
                return
            if self.g.check_for_nan_in_loss_and_grad:
                if local[0] or local[1]:  # this rank found it: the scheduler's side learns its node (fault_log.py)
                    fault_log.record(EXIT_NUMERICAL_FAULT, "numerical", rank=self.coordinates.rank,
                                     iteration=self.iteration, detail="loss" if local[0] else "gradients")
                raise NumericalFault(self._fault_line(local))
            return  # unchecked: DeepSpeed does what it does, and the rules' statistics stay finite
        loss_mean = loss_total / loss_count if loss_count else None
        grad_norm = math.sqrt(grad_square) if self.check_gradients else None
        self.skip_reason = self.rules.reason_to_skip(loss_mean, grad_norm)
        self.skip_update = self.skip_reason is not None
        if self.skip_update and self.phase == FIRST:
            self.rejection = Rejection(False, self.skip_reason, loss_fault=self.skip_reason.startswith("loss"))

    def _fault_line(self, local: torch.Tensor) -> str:
        """The line every rank raises: which ranks found what (an all-gather of each rank's two flags and place;
        made only on a fault)."""
        places = [None] * dist.get_world_size()
        dist.all_gather_object(places, (bool(local[0]), bool(local[1]), str(self.coordinates)))
        found = []
        for what, index in (("loss", 0), ("gradient", 1)):
            ranks = [place for place in places if place[index]]
            if ranks:
                found.append(f"NaN/Inf in the {what} of " + ", ".join(place[2] for place in ranks))
        return (f"{'; '.join(found)} at iteration {self.iteration}, before the gradient reduction; the step was "
                f"applied on no rank (--check-for-nan-in-loss-and-grad)")

    def state_dict(self) -> dict:
        saved = self.rules.state_dict()
        if self.suspicious is not None:  # a note for people and schedulers; a resume does not read it
            saved["suspicious"] = self.suspicious
        return saved

    def load_state_dict(self, saved: Optional[dict]) -> None:
        self.rules.load_state_dict(saved)
        fault = (saved or {}).get("suspicious")
        if fault and fault["rank"] == self.coordinates.rank and fault["host"] == self.coordinates.host:
            # Megatron-LM #5281: the same hardware back after exit 16 reproduces the fault and exits 16 again.
            print(f"warning: this checkpoint was saved after a fault that reproduced on rank {fault['rank']} of this "
                  f"host ({fault['host']}) at iteration {fault['iteration']}; resuming on the same host will likely "
                  f"exit 16 again: exclude it", flush=True)


def coordinates() -> Coordinates:
    from megatron_lite.parallel import state

    return Coordinates(dist.get_rank(), state.get_tensor_model_parallel_rank(),
                       state.get_pipeline_model_parallel_rank(), state.get_data_parallel_rank(), os.uname()[1])
