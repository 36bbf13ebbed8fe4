"""The numerical guard: each rank's loss and gradients checked before any reduction, every rank agreeing
whether the step is applied, stopped on (NaN/Inf) or left out (a spike).

Once per step, in two places under the pipeline engine (deepspeed_compat/step_guard.py says where they are):

  1. `measure`, after the step's last backward and before any gradient is reduced: this rank's numbers, on the
     device, without a host sync: the sum of its micro-batch losses (where it computes one) and the squared norm
     of its accumulated gradients from one fused torch._foreach_norm; then one all-reduce (sum) of those, of
     the count of ranks that compute a loss, and of whether this rank was asked to exit (the training loop's
     SIGTERM/SIGUSR1, agreed here so that the loop needs no collective of its own: take_agreed) over the world,
     started and not waited for;
  2. `decide`, where the optimizer step would begin: the wait for that all-reduce, one host read of the result,
     and the decision, the same on every rank from the same reduced numbers: a NaN/Inf anywhere (a NaN/Inf on
     any rank makes the sum NaN/Inf) stops the run (NumericalFault, before any rank's update; the ranks are named
     from one all-gather made only then); Rules may leave the update out (a spike); otherwise the step is applied.

Why two places: the numbers must be each rank's own, so they are taken before the reduction mixes them; the
decision is needed only by the optimizer step. In between, the all-reduce's latency (0.4-0.9 ms on gloo between
two processes on this project's 2-core VM, benchmarks/bench_straggler_overhead.py) hides behind the gradient
reductions the step makes anyway, and on a GPU the host reads the result when the step's gradients are reduced,
not while the reductions wait to be launched. The reduced gradients of a step that is then stopped or left out
are cleared unused. `check` is both at once (the ZeRO 2/3 path, which reduces inside backward).

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
from typing import Callable, Deque, List, Optional, Tuple

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
    the line); `decide()` answers the optimizer-step hook of the step just measured."""

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
        self._mine: Optional[tuple] = None
        """The last measure()'s own numbers (loss sum, whether this rank computes one, squared gradient norm,
        micro-batches), kept by decide() only for a step the rerun will compare (a rejection, a numbers-only run):
        local_numbers() makes the row of them only when it is asked for."""
        self._constants = (torch.zeros((), dtype=torch.float64, device=device),
                           torch.ones((), dtype=torch.float64, device=device))
        self._pending: Optional[tuple] = None
        """measure()'s all-reduce in flight: (its work, the numbers it sums: loss sum, ranks computing one, squared
        gradient norm, ranks asked to exit), until decide()."""
        self.exit_requested: Callable[[], bool] = lambda: False
        """Whether this rank was asked to stop (the training loop's SIGTERM/SIGUSR1 flag), read by measure() and
        reduced with the step's numbers."""
        self._agreed: Optional[Tuple[bool, bool]] = None
        """decide()'s (an exit asked for on some rank, the loss not finite on some rank), the same on every rank,
        until take_agreed()."""
        self.suspicious: Optional[dict] = None
        """After a reproducible fault (training/rerun.py): the iteration, rank and host, saved in the checkpoint."""

    @property
    def active(self) -> bool:
        """Whether check() has anything to do: a check, a rule or a fault."""
        g = self.g
        return bool(g.check_for_nan_in_loss_and_grad or g.check_for_spiky_loss or g.check_for_large_grads
                    or g.skip_update_sigma is not None or g.inject_fault)

    def check(self, loss_sum: Optional[torch.Tensor], micro_batches: int, grads: List[torch.Tensor]) -> None:
        """measure() and decide() at once."""
        self.measure(loss_sum, micro_batches, grads)
        self.decide()

    def measure(self, loss_sum: Optional[torch.Tensor], micro_batches: int, grads: List[torch.Tensor]) -> None:
        """This rank's step numbers, before any reduction, and their all-reduce started; decide() waits for it.
        loss_sum: the sum of this rank's micro-batch losses (None where it computes none); grads: its
        accumulated gradients (none checked with check_gradients False)."""
        self._drop_pending()
        self.injector.gradients(grads, self.iteration)
        grads = grads if self.check_gradients else []
        # Few tensor operations: each costs a dispatch on the step's critical path (tens of us on a CPU core). The
        # flags come from the reduced sums on the host (a NaN/Inf on any rank makes the sum NaN/Inf; sums of
        # fp32-range numbers in float64 cannot overflow), this rank's own from local_numbers(), when asked.
        zero, one = self._constants
        loss = zero if loss_sum is None else loss_sum.detach().reshape(()).to(torch.float64, copy=True)
        square = zero if not grads else torch.stack(torch._foreach_norm(grads)).double().square().sum()
        self._mine = (loss, loss_sum is not None, square, micro_batches)
        exiting = one if self.exit_requested() else zero
        numbers = torch.stack((loss, zero if loss_sum is None else one, square, exiting))
        self._pending = (dist.all_reduce(numbers, async_op=True), numbers)

    def take_local_numbers(self) -> torch.Tensor:
        """local_numbers(), then forgotten (the rerun takes them once per run of a step)."""
        local = self.local_numbers()
        self._mine = None
        return local

    def local_numbers(self) -> torch.Tensor:
        """This rank's numbers of the last measure(), before the reduction: [bad loss, bad gradient, loss, computes
        a loss, squared gradient norm] (the rerun compares them between a step's runs)."""
        loss, computes_loss, square, micro_batches = self._mine
        zero, one = self._constants
        loss = loss / micro_batches
        bad = (~torch.isfinite(torch.stack((loss, square)))).double()
        return torch.cat((bad, torch.stack((loss, one if computes_loss else zero, square))))

    def _drop_pending(self) -> None:
        """A step whose decision was never asked for (an exception between measure and decide): its all-reduce
        completed, so that every rank's collectives stay in the same order, and forgotten."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def decide(self) -> bool:
        """skip_update for the step measure() took: raise NumericalFault on every rank, or set skip_update the
        same on every rank. Asked again, the same answer."""
        if self._pending is None:
            return self.skip_update
        work, numbers = self._pending
        self._pending = None
        work.wait()
        loss_total, loss_count, grad_square, exits = numbers.tolist()
        bad_loss, bad_grad = not math.isfinite(loss_total), not math.isfinite(grad_square)
        self._agreed = (exits > 0, bad_loss)
        self.skip_update, self.skip_reason = False, None
        if self.phase == NUMBERS_ONLY:
            self.skip_update = True
            return True
        if bad_loss or bad_grad:
            if self.g.check_for_nan_in_loss_and_grad and self.phase == FIRST:  # replayed next (training/rerun.py)
                line = self._fault_line()
                self.rejection = Rejection(True, line, loss_fault=bad_loss)
                self.skip_update, self.skip_reason = True, line
                return True
            if self.g.check_for_nan_in_loss_and_grad:
                local = self.local_numbers()
                if local[0] or local[1]:  # this rank found it: the scheduler's side learns its node (fault_log.py)
                    fault_log.record(EXIT_NUMERICAL_FAULT, "numerical", rank=self.coordinates.rank,
                                     iteration=self.iteration, detail="loss" if local[0] else "gradients")
                raise NumericalFault(self._fault_line())
            self._mine = None
            return False  # unchecked: DeepSpeed does what it does, and the rules' statistics stay finite
        loss_mean = loss_total / self._mine[3] / loss_count if loss_count else None
        grad_norm = math.sqrt(grad_square) if self.check_gradients else None
        self.skip_reason = self.rules.reason_to_skip(loss_mean, grad_norm)
        self.skip_update = self.skip_reason is not None
        if self.skip_update and self.phase == FIRST:
            self.rejection = Rejection(False, self.skip_reason, loss_fault=self.skip_reason.startswith("loss"))
        else:  # nobody will ask for this rank's own numbers: no tensor held between steps
            self._mine = None
        return self.skip_update

    def take_agreed(self) -> Optional[Tuple[bool, bool]]:
        """What the training loop agrees on after each step (an exit asked for on any rank, the loss not finite on
        any rank), as the last decide() reduced it, then forgotten; None when no decide() ran since (the guard
        off). Why: the loop's own all-reduce of these two flags was a blocking collective (and, on a GPU, a host
        sync) every step; carried in the guard's, it costs nothing more. A signal that arrives after this step's
        measure() is agreed at the next step's."""
        agreed, self._agreed = self._agreed, None
        return agreed

    def _fault_line(self) -> str:
        """The line every rank raises: which ranks found what (an all-gather of each rank's two flags and place;
        made only on a fault)."""
        local = self.local_numbers()
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
