"""Which rank is slow: `--log-straggler` (Megatron-LM's flag), and the drill that makes one slow.

Every rank adds up, between two log lines, where its training steps went: waiting for data (LoadMicroBatch),
forward and backward, blocked on the other pipeline stages (sends, receives, the loss broadcast that ends a
step), in the data-parallel gradient reduction, in the optimizer step, and the rest ("other"). Host clocks
only: the pipeline engine's instructions are timed as --timing-breakdown times them
(deepspeed_compat.pipeline.time_pipeline_instructions) but without waiting for the device, so no step gains a
CUDA synchronisation and none gains a collective. At each log line one small gather brings every rank's sums
to rank 0 (host names and places were gathered once, at start-up); it is waited for, and the line printed,
after the next step, so that its latency hides behind that step.

The ranks of a synchronous step all take about as long: a slow rank makes the others wait for it in their
receives and all-reduces. So ranks are ranked by their *work*, the step time less the time blocked on other
ranks (pipeline waits and the gradient reduction): the slow rank has the most work, the ranks waiting for it
the least. On a GPU the host clocks see where the host blocks, so kernels still running when their
instruction returns are counted where the host next waits; the ranking holds for a rank that is slow on the
host (data, Python, a sleep) and for one whose device is slow enough to make its host wait at its own sends.

MEGATRON_LITE_INJECT_SLOW=RANK:SECONDS (validation/stragglers.py) is a drill hook: that global rank sleeps
SECONDS per training step, spread over its forward passes, as a slow GPU would be.
"""
from __future__ import annotations

import socket
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_lite.deepspeed_compat import pipeline
from megatron_lite.parallel import state
from megatron_lite.validation.stragglers import inject_slow

PHASE = {
    "LoadMicroBatch": "data", "ForwardPass": "forward_backward", "BackwardPass": "forward_backward",
    "SendActivation": "pipeline_wait", "SendGrad": "pipeline_wait", "RecvActivation": "pipeline_wait",
    "RecvGrad": "pipeline_wait", "CommitP2P": "pipeline_wait", "AggregateLoss": "pipeline_wait",
    "ReduceGrads": "reduce", "ReduceTiedGrads": "reduce", "OptimizerStep": "optimizer",
}
PHASES = ("data", "forward_backward", "pipeline_wait", "reduce", "optimizer", "other")
WAITS = ("pipeline_wait", "reduce")
"""Time blocked on other ranks: not this rank's own work."""


@dataclass
class RankTimes:
    """One rank's interval, in milliseconds per iteration."""
    rank: int
    host: str
    place: Dict[str, int]
    """tp, pp, dp (and cp under context parallelism) coordinates."""
    step: float
    phases: Dict[str, float]

    @property
    def work(self) -> float:
        return self.step - sum(self.phases[w] for w in WAITS)

    def name(self) -> str:
        return f"rank {self.rank} ({' '.join(f'{k}{v}' for k, v in self.place.items())} on {self.host})"

    def record(self) -> dict:
        return {"rank": self.rank, "host": self.host, **self.place, "work_ms": self.work, "step_ms": self.step,
                **{f"{p}_ms": self.phases[p] for p in PHASES}}


@dataclass
class Selection:
    slowest: List[RankTimes]
    """By work, slowest first."""
    fastest: List[RankTimes]
    """By work, fastest first."""
    phase: str
    """The phase whose time differs most between ranks."""
    phase_high: RankTimes
    phase_low: RankTimes
    step_range: Tuple[float, float] = field(default=(0.0, 0.0))


def select(ranks: Sequence[RankTimes], count: int) -> Selection:
    """The `count` slowest and fastest ranks by work, and the phase with the widest spread (ties: lower rank)."""
    by_work = sorted(ranks, key=lambda r: (-r.work, r.rank))
    count = min(count, len(ranks))
    phase = max(PHASES, key=lambda p: (max(r.phases[p] for r in ranks) - min(r.phases[p] for r in ranks),
                                       -PHASES.index(p)))
    high = min(ranks, key=lambda r: (-r.phases[phase], r.rank))
    low = min(ranks, key=lambda r: (r.phases[phase], r.rank))
    steps = [r.step for r in ranks]
    return Selection(by_work[:count], sorted(ranks, key=lambda r: (r.work, r.rank))[:count], phase, high, low,
                     (min(steps), max(steps)))


def format_line(iteration: int, chosen: Selection) -> str:
    """One console line; worded unlike the "iteration N/M | ..." lines that scripts grep for."""
    def ranks(times: List[RankTimes]) -> str:
        return ", ".join(f"{r.name()} {r.work:.1f}" for r in times)

    low, high = chosen.step_range
    return (f"stragglers at iteration {iteration} | work ms per iteration (step less waits on other ranks): "
            f"slowest {ranks(chosen.slowest)} | fastest {ranks(chosen.fastest)} | step {low:.1f}-{high:.1f} | "
            f"widest phase {chosen.phase}: {chosen.phase_high.name()} {chosen.phase_high.phases[chosen.phase]:.1f}, "
            f"{chosen.phase_low.name()} {chosen.phase_low.phases[chosen.phase]:.1f}")


def scalars(chosen: Selection, ranks: Sequence[RankTimes]) -> Dict[str, float]:
    """TensorBoard's straggler/...: the spread of work, step and each phase, and who is slowest and fastest."""
    out = {"slowest_rank": chosen.slowest[0].rank, "fastest_rank": chosen.fastest[0].rank,
           "work_ms_max": chosen.slowest[0].work, "work_ms_min": chosen.fastest[0].work,
           "step_ms_max": chosen.step_range[1], "step_ms_min": chosen.step_range[0]}
    for p in PHASES:
        values = [r.phases[p] for r in ranks]
        out[f"{p}_ms_max"], out[f"{p}_ms_min"] = max(values), min(values)
    return out


class PhaseClock:
    """This rank's seconds per phase since the last take(); training instructions only (evaluation runs the
    same instructions with the module in eval mode)."""

    def __init__(self, pipeline_engine, module: torch.nn.Module):
        self.module = module
        self.seconds: Dict[str, float] = defaultdict(float)
        pipeline.time_pipeline_instructions(pipeline_engine, self._record, lambda: None)

    def _record(self, instruction: str, seconds: float) -> None:
        if self.module.training:
            self.seconds[PHASE.get(instruction, "other")] += seconds

    def take(self, step_seconds: float) -> List[float]:
        """[step, *PHASES] in seconds, "other" being the step time no instruction accounts for; then zeros."""
        sums = [self.seconds.get(p, 0.0) for p in PHASES[:-1]]
        self.seconds = defaultdict(float)
        return [step_seconds, *sums, max(step_seconds - sum(sums), 0.0)]


class StragglerReport:
    def __init__(self, engine, count: int):
        """engine: training/engine.py's Engine (its pipeline engine, module and device)."""
        self.clock = PhaseClock(engine.engine, engine.module)
        self.count = count
        self.device = engine.device
        place = {"tp": state.get_tensor_model_parallel_rank(), "pp": state.get_pipeline_model_parallel_rank(),
                 "dp": state.get_data_parallel_rank()}
        if state.get_context_parallel_world_size() > 1:
            place["cp"] = state.get_context_parallel_rank()
        everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object((socket.gethostname(), place), everyone, dst=0)  # once: hosts do not change
        self.places = everyone
        self._pending: Optional[tuple] = None
        """report()'s gather in flight (its work, this rank's sums, which it must keep alive until it completes,
        rank 0's receiving tensors, the iteration and how many it covers), until finish()."""

    def report(self, iteration: int, iterations: int, step_seconds: float, tb, records) -> None:
        """A collective at the log line, started and not waited for: every rank sends its sums to rank 0, and
        finish() (after the next step) prints them. Why: the gather waits for the slowest rank to reach it and
        for rank 0 to receive from every rank (0.7-1.0 ms on gloo between two processes on this project's VM,
        benchmarks/bench_straggler_overhead.py); started here, that latency passes behind the next step's work."""
        self.finish(tb, records)  # one still pending (the loop finishes each after the next step)
        mine = torch.tensor(self.clock.take(step_seconds), dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
        self._pending = (dist.gather(mine, gathered, dst=0, async_op=True), mine, gathered, iteration, iterations)

    def finish(self, tb, records) -> Optional[str]:
        """On every rank: the pending report's gather waited for; on rank 0 its line printed, TensorBoard's
        straggler/... and a `straggler` record written (at the iteration of its log line), and the line returned."""
        if self._pending is None:
            return None
        work, _, gathered, iteration, iterations = self._pending
        self._pending = None
        work.wait()
        if gathered is None:
            return None
        ranks = [RankTimes(rank, host, place, 1e3 * values[0] / iterations,
                           {p: 1e3 * v / iterations for p, v in zip(PHASES, values[1:])})
                 for rank, ((host, place), values) in enumerate(zip(self.places, (g.tolist() for g in gathered)))]
        chosen = select(ranks, self.count)
        line = format_line(iteration, chosen)
        print(line, flush=True)
        tb.write("straggler", scalars(chosen, ranks), iteration)
        records.write("straggler", iteration=iteration, iterations=iterations, widest_phase=chosen.phase,
                      slowest=[r.record() for r in chosen.slowest], fastest=[r.record() for r in chosen.fastest],
                      widest_phase_high=chosen.phase_high.record(), widest_phase_low=chosen.phase_low.record())
        return line


def slow_down(engine, seconds: float) -> None:
    """The drill: `seconds` of sleep per training step, a share in each forward pass (not in evaluation's)."""
    def wrap(forward):
        def slept(self, **kwargs):
            if engine.module.training:
                time.sleep(seconds / self.gradient_accumulation_steps())
            return forward(self, **kwargs)
        return slept

    pipeline.wrap_instruction(engine.engine, "ForwardPass", wrap)


def start(config, engine) -> Optional[StragglerReport]:
    """At set-up, on every rank: the drill's sleep where MEGATRON_LITE_INJECT_SLOW asks for it (before the
    clocks, so that they count it), then the report when --log-straggler asks for it."""
    slow = inject_slow(dist.get_world_size())
    if slow is not None and slow[0] == dist.get_rank():
        slow_down(engine, slow[1])
    if not config.logging.log_straggler:
        return None
    return StragglerReport(engine, config.logging.straggler_minmax_count)
