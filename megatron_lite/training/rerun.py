"""--rerun-mode: Megatron-LM's rerun state machine, in place, around one step of DeepSpeed's pipeline engine.

validate_results (the default). The step runs once with the guard (training/numerical_guard.py) rejecting instead
of raising: a NaN/Inf (fatal) or a spike (not fatal) leaves the update out on every rank. Only then is the step
replayed in place: every rank's random generators (Python, numpy, torch, the TP tracker's streams) set back to
the step's start, the same micro-batches read again from a buffer, the engine's step counters wound back, and
the guard's numbers of each rank compared with the first run's (the loss exactly, the gradient norm within
Megatron-LM's 1e-3 relative; NaN equals NaN). The replay is never applied either. Then, the same on every rank
(each compares the same all-gathered numbers):
  fatal, reproducible      the weights are still the step's start: save them (the suspicious host in the
                           checkpoint's numerical_guard metadata) and exit 16: resume on other hardware
  fatal, not reproducible  a transient fault: exit 17 without saving; the last checkpoint stays
  not fatal                the update stays out and the run goes on, with a line saying which it was
report_stats. Every step runs twice from the same state, the first run left out; the loss's relative difference
between the two is reported every log interval (how deterministic the run is). disabled: no replay.

Megatron-LM's --rerun-mode report_stats raises (its enum value is report_determinism_stats); it works here.
"""
from __future__ import annotations

import datetime
import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional

import torch
import torch.distributed as dist

from megatron_lite import fault_log
from megatron_lite.config.numerical_guard import NumericalGuardConfig
from megatron_lite.deepspeed_compat import step_guard
from megatron_lite.exit_codes import EXIT_FAILED_ON_RESULT_VALIDATION, EXIT_RESUME_TO_DISAMBIGUATE
from megatron_lite.training.numerical_guard import FIRST, NUMBERS_ONLY, APPLY, NumericalGuard
from megatron_lite.training.rng_state import rng_state, set_rng_state

GRAD_TOLERANCE = 1e-3
"""Megatron-LM's tolerance for a gradient norm's replay (a GPU's backward need not be deterministic)."""
LOSS_TOLERANCE = 0.0
"""Megatron-LM's for the loss: the forward is deterministic."""
REPRODUCIBLE, NOT_REPRODUCIBLE = "FIRST_RERUN_REPRODUCIBLE", "FIRST_RERUN_NOT_REPRODUCIBLE"
"""The tracker file's statuses, Megatron-LM's RerunValidationStatus names."""


class RerunStop(Exception):
    """A fatal fault judged by the replay, raised on every rank at once: exit_code 16 (save first) or 17
    (nothing saved); str() is the line to print."""

    def __init__(self, line: str, exit_code: int):
        super().__init__(line)
        self.exit_code = exit_code

    @property
    def save(self) -> bool:
        return self.exit_code == EXIT_RESUME_TO_DISAMBIGUATE


class ReplayableIterator:
    """The step's micro-batches as the engine reads them, kept for a replay (Megatron-LM's RerunDataIterator). A
    pipeline engine reads on its first and last stages only; the others' buffers stay empty."""

    def __init__(self, source: Iterator):
        self.source = source
        self.read: List[object] = []
        self.position: Optional[int] = None

    def __iter__(self):
        return self

    def __next__(self):
        if self.position is None:
            item = next(self.source)
            self.read.append(item)
            return item
        if self.position == len(self.read):  # a deterministic step reads what it read the first time
            raise RuntimeError(f"the replay read more than the step's {len(self.read)} micro-batches")
        self.position += 1
        return self.read[self.position - 1]

    def rewind(self) -> None:
        self.position = 0


def relative_difference(a: float, b: float) -> float:
    """Megatron-LM's _compare_floats: 0 for equal values (NaN equals NaN), inf when only one is finite, else
    |a - b| over their mean magnitude."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / ((abs(a) + abs(b)) / 2)


@dataclass
class Attempt:
    """Every rank's guard numbers of one run of the step, rows in rank order: [bad loss, bad gradient, loss,
    computes a loss, squared gradient norm] (NumericalGuard.local_numbers)."""
    numbers: List[List[float]]

    def loss(self, rank: int) -> Optional[float]:
        row = self.numbers[rank]
        return row[2] if row[3] else None

    def grad_norm(self, rank: int) -> float:
        return math.sqrt(self.numbers[rank][4]) if self.numbers[rank][4] >= 0 else math.nan

    def matches(self, other: "Attempt", rank: int) -> bool:
        a, b = self.numbers[rank], other.numbers[rank]
        return (a[:2] == b[:2] and a[3] == b[3]
                and (not a[3] or relative_difference(a[2], b[2]) <= LOSS_TOLERANCE)
                and relative_difference(self.grad_norm(rank), other.grad_norm(rank)) <= GRAD_TOLERANCE)


class RerunStateMachine:
    """One engine's rerun: `train_step(data_iter, train_batch)` runs train_batch(iterator) once, twice or stops
    the run, as --rerun-mode says. `engine` is DeepSpeed's (its step counters are wound back for a replay)."""

    def __init__(self, g: NumericalGuardConfig, guard: NumericalGuard, engine, log_interval: int, train_iters: int):
        self.g = g
        self.guard = guard
        self.engine = engine
        self.log_interval = log_interval
        self.train_iters = train_iters
        self.differences: List[float] = []
        """report_stats: the loss's relative difference of each step since the last report."""
        self.hosts: Optional[List[str]] = None

    def train_step(self, data_iter: Iterator, train_batch: Callable[[Iterator], float]) -> float:
        if self.g.rerun_mode == "disabled":
            return train_batch(data_iter)
        data = ReplayableIterator(data_iter)
        start = rng_state()  # copies: the generators' states are replaced, never changed in place
        counters = step_guard.step_counters(self.engine)
        if self.g.rerun_mode == "report_stats":
            return self._twice(data, start, counters, train_batch)
        guard = self.guard
        guard.phase, guard.rejection = FIRST, None
        try:
            loss = train_batch(data)
        finally:
            guard.phase = APPLY
        rejection = guard.rejection
        if rejection is None:
            return loss
        first = self._gather()
        self._replay(data, start, counters, train_batch)
        replay = self._gather()
        self._judge(rejection, first, replay, start, counters)
        return loss  # the step stays skipped: the first run's (rejected) loss is the one reported

    def _replay(self, data: ReplayableIterator, start: dict, counters, train_batch) -> float:
        """The step again from its start, its numbers taken and its update left out."""
        step_guard.restore_step_counters(self.engine, counters)
        set_rng_state(start)
        data.rewind()
        self.guard.phase, self.guard.injector.attempt = NUMBERS_ONLY, 1
        try:
            return train_batch(data)
        finally:
            self.guard.phase, self.guard.injector.attempt = APPLY, 0

    def _twice(self, data: ReplayableIterator, start: dict, counters, train_batch) -> float:
        """report_stats: a first run left out, then the step from the same state, applied as usual."""
        self.guard.phase = NUMBERS_ONLY
        try:
            first = train_batch(data)
        finally:
            self.guard.phase = APPLY
        step_guard.restore_step_counters(self.engine, counters)
        set_rng_state(start)
        data.rewind()
        self.guard.injector.attempt = 1
        try:
            loss = train_batch(data)
        finally:
            self.guard.injector.attempt = 0
        self.differences.append(relative_difference(first, loss))
        iteration = self.guard.iteration
        if iteration % self.log_interval == 0 or iteration == self.train_iters:
            d, self.differences = self.differences, []
            finite = [x for x in d if math.isfinite(x)]
            _print_rank0(f"rerun report_stats at iteration {iteration}: each of the last {len(d)} steps run twice, "
                         f"loss relative difference max {max(d):.3e}, mean "
                         f"{(sum(finite) / len(finite) if finite else math.inf):.3e}, "
                         f"{sum(x == 0 for x in d)} of {len(d)} identical")
        return loss

    def _gather(self) -> Attempt:
        """Every rank's numbers of the run just made: one all-gather of five numbers per rank, so every rank
        judges from the same values and takes the same branch."""
        local = self.guard.take_local_numbers()
        rows = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, local)
        return Attempt([row.tolist() for row in rows])

    def _judge(self, rejection, first: Attempt, replay: Attempt, start: dict, counters) -> None:
        world = len(first.numbers)
        reproduced = all(first.matches(replay, rank) for rank in range(world))
        if self.hosts is None:  # once, at the first rejection: which host each rank is on
            self.hosts = [None] * world
            dist.all_gather_object(self.hosts, self.guard.coordinates.host)
        rank = _suspect(rejection, first)
        iteration = self.guard.iteration
        loss, norm = first.loss(rank), first.grad_norm(rank)
        again = (f"rank {rank} (host {self.hosts[rank]}): loss {_show(loss)} -> {_show(replay.loss(rank))}, "
                 f"gradient norm {_show(norm)} -> {_show(replay.grad_norm(rank))}")
        verdict = "reproducible" if reproduced else "transient"
        result = loss if rejection.loss_fault else norm
        self._track(rank, iteration, REPRODUCIBLE if reproduced else NOT_REPRODUCIBLE, verdict, rejection.fatal,
                    result, rejection.message)
        if rejection.fatal and dist.get_rank() == rank:  # the scheduler's side learns the node (fault_log.py)
            fault_log.record(EXIT_RESUME_TO_DISAMBIGUATE if reproduced else EXIT_FAILED_ON_RESULT_VALIDATION,
                             "rerun_reproducible" if reproduced else "rerun_transient", rank=rank,
                             iteration=iteration, detail="loss" if rejection.loss_fault else "gradients")
        if not rejection.fatal:
            _print_rank0(f"iteration {iteration}: update skipped: {rejection.message}; replayed in place, "
                         f"{'it reproduced' if reproduced else 'it did not reproduce'} ({verdict}: {again}); the "
                         f"run goes on")
            return
        if reproduced:
            # The checkpoint is the step's start: its counters and generators as they were, so a resume redoes it.
            step_guard.restore_step_counters(self.engine, counters)
            set_rng_state(start)
            self.guard.suspicious = {"iteration": iteration, "rank": rank, "host": self.hosts[rank],
                                     "message": rejection.message}
            raise RerunStop(f"{rejection.message}; replayed in place, it reproduced ({again}); exit "
                            f"{EXIT_RESUME_TO_DISAMBIGUATE}: resume on other hardware than host {self.hosts[rank]}",
                            EXIT_RESUME_TO_DISAMBIGUATE)
        raise RerunStop(f"{rejection.message}; replayed in place, it did not reproduce ({again}): a transient fault "
                        f"at iteration {iteration} on rank {rank}; exit {EXIT_FAILED_ON_RESULT_VALIDATION} without "
                        f"saving", EXIT_FAILED_ON_RESULT_VALIDATION)

    def _track(self, rank: int, iteration: int, status: str, verdict: str, fatal: bool, result, message: str) -> None:
        """One JSON line in --result-rejected-tracker-filename, appended by rank 0 (Megatron-LM's fields, the
        faulty rank's host as node)."""
        path = self.g.result_rejected_tracker_filename
        if path is None or dist.get_rank() != 0:
            return
        record = {"ts": datetime.datetime.now().isoformat(timespec="seconds"), "node": self.hosts[rank],
                  "job_id": os.environ.get("SLURM_JOB_ID"), "rank": rank, "iteration": iteration, "status": status,
                  "result": _json_number(result), "diagnosis": verdict, "fatal": fatal, "message": message}
        try:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # the record is a help for the next start, not worth stopping the run for
            print(f"warning: could not append to --result-rejected-tracker-filename {path}: {e}", flush=True)


def _suspect(rejection, first: Attempt) -> int:
    """The rank the rejection names: the first with a NaN/Inf, else the one with the largest loss (a loss
    spike) or gradient norm."""
    world = range(len(first.numbers))
    bad = [rank for rank in world if first.numbers[rank][0] or first.numbers[rank][1]]
    if bad:
        return bad[0]
    if rejection.loss_fault:
        return max((rank for rank in world if first.numbers[rank][3]), key=lambda rank: first.numbers[rank][2])
    return max(world, key=lambda rank: first.numbers[rank][4])


def _show(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.6g}"


def _json_number(value: Optional[float]):
    """JSON has no NaN or Inf: those as their names."""
    return value if value is None or math.isfinite(value) else str(value)


def _print_rank0(line: str) -> None:
    if dist.get_rank() == 0:
        print(line, flush=True)


def stop_run(run, stop: RerunStop) -> None:
    """A fatal replay's end, on every rank (collective when it saves): exit 16 saves the step's start with
    training/checkpointing.py's save, waiting for it to be written; 17 saves nothing. The line grows by what
    was saved."""
    from megatron_lite.training import checkpointing

    t = run.config.training
    if not stop.save:
        kept = checkpointing.latest_tag(t.save) if t.save else None
        stop.args = (f"{stop}; the last checkpoint ({kept or 'none'}) is kept",)
        return
    if run.save_folder is None:
        stop.args = (f"{stop}; no --save: nothing saved",)
        return
    tag = checkpointing.save(run.engine, run.config, run.iteration, run.consumed_samples, run.save_folder)
    run.save_folder.wait()
    stop.args = (f"{stop}; saved checkpoint {tag} in {t.save} (the step's start; its metadata names the host)",)
