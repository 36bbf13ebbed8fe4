"""What --log-straggler and the numerical guard cost a training step: the same GPT with and without them, in the
same processes.

PP x DP processes (one thread each, gloo on loopback) hold one engine of a GPT and its batches, and two sets of
its hooks: "with" has the straggler report installed as the training loop installs it (training/stragglers.py:
every pipeline instruction timed on the host, and the report's gather every --log-interval steps, waited for
after the next step, with its line formatted and printed to a discarded buffer on rank 0) and the numerical
guard on as by default (the NaN/Inf check before the reduction, the rerun state machine), "without" neither
(--measure picks one of them). Each step is made as the training loop makes it: the engine's step, then every
rank's agreement on stopping, by the loop's own all-reduce or, where the guard ran, read from the guard's. They
run in interleaved rounds, the order alternating (this VM drifts 10-40% within minutes); per round the ratio
with/without of the mean step time.
Printed: each round's times and ratio, then the median ratio with a 95% bootstrap interval, the per-round
range and the ratio of the fastest rounds; and, measured directly (free of the drift), the time rank 0 spent in
the report per step, the timed instructions per step times what one timing costs, the guard's two calls, the
loop's own all-reduce on each side, and the instructions after each step's last backward, each with and
without. Target: <= 1.01.

    OMP_NUM_THREADS=1 python benchmarks/bench_straggler_overhead.py                # PP 2, CPU-sized
    python benchmarks/bench_straggler_overhead.py --pp 1 --dp 2
    python benchmarks/bench_straggler_overhead.py --measure guard  # the guard alone
    python benchmarks/bench_straggler_overhead.py --control      # A/A: the same hooks on both sides
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_pipeline_schedules import batches  # noqa: E402
from bench_training import add_model_arguments, join_gloo_world, run_ranks  # noqa: E402

NAMES = ("without", "with")


def model_argv(args):
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(args.seq_length),
            "--vocab-size", str(args.vocab_size), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", str(args.micro_batch_size),
            "--global-batch-size", str(args.micro_batch_size * args.gas * args.dp),
            "--pipeline-model-parallel-size", str(args.pp), "--lr", "1e-4",
            "--log-interval", str(args.log_interval), "--log-straggler"]


GUARD_OFF = ("--no-check-for-nan-in-loss-and-grad", "--rerun-mode", "disabled")
"""The numerical guard off: no check before the reduction, no rerun state machine (no buffered micro-batches).
The engine is built so, then given the guard as by default ("with") when the guard is measured."""


def _worker(rank, port, args, results):
    import torch.distributed as dist

    from megatron_lite.arguments import parse_args
    from megatron_lite.deepspeed_compat.pipeline import instruction_hooks, use_instruction_hooks
    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine
    from megatron_lite.training.metrics import TensorBoardWriter
    from megatron_lite.training.records import RecordWriter
    from megatron_lite.training import stragglers

    class CountingClock(stragglers.PhaseClock):
        """Counts the timed instructions (a conservative extra on the "with" side)."""
        calls = 0

        def _record(self, instruction, seconds):
            CountingClock.calls += 1
            super()._record(instruction, seconds)

    stragglers.PhaseClock = CountingClock

    world = args.pp * args.dp
    join_gloo_world(rank, world, port)
    # One engine: "without" and "with" are two sets of its hooks (the pipeline's instruction map and the rerun
    # state machine), switched between rounds. Two engines built one after the other differed by 1.06% with
    # nothing different between them (the A/A control, 200 rounds): as much as the target.
    measuring_guard = not args.control and args.measure in ("guard", "both")
    guard_off = list(GUARD_OFF) if args.measure != "straggler" else []  # else the guard is on in both
    config = parse_args(model_argv(args) + guard_off, world_size=world)[0]
    state.initialize(1, args.pp)
    engine = Engine(config, with_scheduler=False)
    data = batches(config)
    setups = {"without": (instruction_hooks(engine.engine), engine.rerun)}
    if measuring_guard:  # the guard as a run has it by default, installed as the engine installs it
        engine.install_guard(parse_args(model_argv(args), world_size=world)[0])
    report = None
    if not args.control and args.measure in ("straggler", "both"):
        report = stragglers.StragglerReport(engine, config.logging.straggler_minmax_count)
    setups["with"] = (instruction_hooks(engine.engine), engine.rerun)
    ends = {name: [0.0] * len(STEP_END) for name in NAMES}
    for name in NAMES:
        use_instruction_hooks(engine.engine, setups[name][0])
        _time_step_end(engine.engine, ends[name])
        setups[name] = (instruction_hooks(engine.engine), setups[name][1])

    def use(name):
        use_instruction_hooks(engine.engine, setups[name][0])
        engine.rerun = setups[name][1]

    in_guard = [0.0, 0.0]  # seconds in guard.measure, in guard.decide
    if measuring_guard:
        # The hooks call guard.measure (before the reduction) and guard.decide (at the optimizer step) at each
        # step: both timed here, the all-reduce and any wait for it within.
        for index, method in enumerate(("measure", "decide")):
            setattr(engine.guard, method, _timed(getattr(engine.guard, method), in_guard, index))
    sink = io.StringIO()
    tb, records = TensorBoardWriter(None), RecordWriter(None)
    for name in NAMES:  # warm-up: allocations, the activation shapes sent once
        use(name)
        loop_step(engine, data)
    if report is not None:
        report.clock.take(0.0)
    rounds, in_report = [], 0.0
    in_agree = {name: 0.0 for name in NAMES}  # seconds in the loop's agreement after each step
    for r in range(args.rounds):
        seconds = {}
        for name in NAMES if r % 2 == 0 else NAMES[::-1]:
            use(name)
            reporting = report is not None and name == "with"
            dist.barrier()
            start = interval_start = time.perf_counter()
            for step in range(1, args.steps + 1):
                in_agree[name] += loop_step(engine, data)
                if not reporting:
                    continue
                now = time.perf_counter()
                with contextlib.redirect_stdout(sink):
                    # As the training loop: the last report's gather waited for and its line printed after the
                    # step that follows it, and a report every --log-interval steps, here in the middle of the
                    # round's steps, so that a step follows it within the round.
                    report.finish(tb, records)
                    if (step - 1) % args.log_interval == args.log_interval // 2:
                        report.report(step, args.log_interval, now - interval_start, tb, records)
                        interval_start = time.perf_counter()
                    if step == args.steps:  # the round's last report, waited for within the round
                        report.finish(tb, records)
                in_report += time.perf_counter() - now
            seconds[name] = (time.perf_counter() - start) / args.steps
        rounds.append(seconds)
        if r == 0:
            CountingClock.calls = 0  # from here: the rounds' steps alone
            for name in NAMES:
                ends[name][:] = [0.0] * len(STEP_END)
        if rank == 0:
            print(f"round {r + 1}/{args.rounds}: without {seconds['without'] * 1e3:.1f} ms, with "
                  f"{seconds['with'] * 1e3:.1f} ms per step, ratio {seconds['with'] / seconds['without']:.4f}",
                  flush=True)
    measured_steps = (args.rounds - 1) * args.steps
    use("with")
    snapshot = _snapshot_seconds(engine) if measuring_guard else 0.0
    pieces = _guard_pieces(engine) if measuring_guard else (0.0, 0.0)
    results.put((rank, rounds, in_report / args.rounds / args.steps, CountingClock.calls / max(measured_steps, 1),
                 _timer_seconds(), [t / (args.rounds * args.steps + 1) for t in in_guard],  # + 1: the warm-up step
                 snapshot, pieces, {name: [t / measured_steps for t in ends[name]] for name in NAMES},
                 {name: t / (args.rounds * args.steps) for name, t in in_agree.items()}))
    state.destroy()
    dist.destroy_process_group()


def loop_step(engine, data) -> float:
    """A step as the training loop makes it (training/loop.py train): the engine's step, then every rank's
    agreement on stopping (loop.agree_after_step: the guard's all-reduce where it ran, else the loop's own).
    Returns the seconds of that agreement."""
    from megatron_lite.training.loop import agree_after_step

    loss = engine.train_step(data).loss
    start = time.perf_counter()
    agree_after_step(engine, False, loss)
    return time.perf_counter() - start


STEP_END = ("ReduceTiedGrads", "ReduceGrads", "OptimizerStep")
"""The pipeline instructions after a step's last backward: the guard measures at the first, decides at the last."""


def _time_step_end(engine, totals) -> None:
    """Each of STEP_END's instructions timed into totals (the guard's hooks within them, installed before)."""
    from megatron_lite.deepspeed_compat.pipeline import wrap_instruction

    for index, instruction in enumerate(STEP_END):
        wrap_instruction(engine, instruction, lambda run, index=index: _timed(run, totals, index))


def _timed(method, totals, index):
    """method, each call's seconds added to totals[index]."""
    def timed(*a, **k):
        start = time.perf_counter()
        try:
            return method(*a, **k)
        finally:
            totals[index] += time.perf_counter() - start
    return timed


def _guard_pieces(engine, calls: int = 200):
    """(seconds of the guard's all-reduce of its 4 numbers, waited for at once, with every rank in lockstep;
    seconds of its one pass over this rank's gradients)."""
    import torch
    import torch.distributed as dist

    numbers = torch.zeros(4, dtype=torch.float64)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(numbers)
    reduce_seconds = (time.perf_counter() - start) / calls
    # The parameters stand in for their gradients (the same shapes; cleared after the step).
    grads = [p.detach() for p in engine.module.parameters() if p.requires_grad]
    start = time.perf_counter()
    for _ in range(calls):
        torch.stack(torch._foreach_norm(grads)).double().square().sum()
    return reduce_seconds, (time.perf_counter() - start) / calls


def _snapshot_seconds(engine, calls: int = 200) -> float:
    """What --rerun-mode validate_results adds to a step that nothing rejects (training/rerun.py train_step): a
    copy of every generator's state and of DeepSpeed's step counters (the buffered micro-batches are references)."""
    from megatron_lite.deepspeed_compat import step_guard
    from megatron_lite.training.rerun import ReplayableIterator
    from megatron_lite.training.rng_state import rng_state

    start = time.perf_counter()
    for _ in range(calls):
        rng_state()
        step_guard.step_counters(engine.engine)
        ReplayableIterator(iter(()))
    return (time.perf_counter() - start) / calls


def _timer_seconds(calls: int = 200_000) -> float:
    """What one timed instruction adds: two perf_counter reads, the mode check and the sum, around a no-op."""
    from megatron_lite.training.stragglers import PHASE

    class Module:
        training = True

    sums, module = {}, Module()

    def record(instruction, seconds):
        if module.training:
            sums[PHASE.get(instruction, "other")] = sums.get(PHASE.get(instruction, "other"), 0.0) + seconds

    start = time.perf_counter()
    for _ in range(calls):
        t = time.perf_counter()
        record("ForwardPass", time.perf_counter() - t)
    return (time.perf_counter() - start) / calls


def median_interval(ratios, resamples: int = 4000, seed: int = 0):
    """A 95% bootstrap interval of the median ratio: how far the median could move with other rounds of the
    same run (the VM's drift and jitter), so that a median within the target is told from one within the noise."""
    import random

    draw = random.Random(seed)
    medians = sorted(statistics.median(draw.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser, seq_length=128, micro_batch_size=2)
    parser.set_defaults(hidden_size=128)
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--gas", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--rounds", type=int, default=60, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=5,
                        help="steps per engine per round (short rounds: the drift between the two halves of a round "
                             "stays small)")
    parser.add_argument("--log-interval", type=int, default=5, help="steps between two reports")
    parser.add_argument("--control", action="store_true",
                        help="no report on either engine: the ratios' spread when nothing differs (A/A)")
    parser.add_argument("--measure", choices=("straggler", "guard", "both"), default="both",
                        help="what the \"with\" engine adds: the straggler report, the numerical guard "
                             "(--check-for-nan-in-loss-and-grad with --rerun-mode validate_results, the defaults) "
                             "or both (default)")
    args = parser.parse_args()
    if args.steps % args.log_interval:
        parser.error(f"--steps {args.steps} must be a multiple of --log-interval {args.log_interval}")
    print(f"PP {args.pp} x DP {args.dp}, hidden {args.hidden_size}, {args.num_layers} layers, seq "
          f"{args.seq_length}, {args.gas} micro-batches of {args.micro_batch_size}; {args.rounds} rounds of "
          f"{args.steps} steps each, a report every {args.log_interval}", flush=True)
    every_rank = run_ranks(_worker, args.pp * args.dp, args)
    _, rounds, report_seconds, instructions, timer_seconds, (measure_seconds, decide_seconds), snapshot_seconds, \
        pieces, _, agree = every_rank[0]
    guard_seconds = measure_seconds + decide_seconds
    ratios = [r["with"] / r["without"] for r in rounds]
    median = statistics.median(ratios)
    low, high = median_interval(ratios)
    step = statistics.median(r["without"] for r in rounds)
    fastest = min(r["with"] for r in rounds) / min(r["without"] for r in rounds)
    what = {"straggler": "--log-straggler", "guard": "the numerical guard",
            "both": "--log-straggler and the numerical guard"}[args.measure]
    print(f"{what} overhead: median ratio {median:.4f} ({(median - 1) * 100:+.2f}%, 95% interval "
          f"{low:.4f}-{high:.4f}), per-round range {min(ratios):.4f}-{max(ratios):.4f}; fastest round with / fastest "
          f"without {fastest:.4f}; median step without {step * 1e3:.1f} ms; target <= 1.01: "
          f"{'met' if median <= 1.01 else 'NOT met'}")
    saved = agree["without"] - agree["with"]
    direct = report_seconds + instructions * timer_seconds + guard_seconds + snapshot_seconds - saved
    print(f"measured directly on rank 0: the report's gather (its start and its wait) and line "
          f"{report_seconds * 1e6:.0f} us per step, {instructions:.0f} timed instructions per step x "
          f"{timer_seconds * 1e9:.0f} ns = {instructions * timer_seconds * 1e6:.1f} us; the guard's measure and decide "
          f"(its all-reduce, what of it the gradient reductions between them did not hide, and any wait for the "
          f"other ranks) {guard_seconds * 1e6:.0f} us per step, the rerun's snapshot {snapshot_seconds * 1e6:.0f} us; "
          f"less the loop's agreement after each step, an all-reduce that the guard's carries "
          f"({agree['without'] * 1e6:.0f} us without, {agree['with'] * 1e6:.0f} us with): together {direct / step * 100:.3f}% of a step")
    for r in every_rank:
        print(f"rank {r[0]}'s step end per step, " + ", ".join(
            f"{instruction} {r[8]['without'][i] * 1e6:.0f} -> {r[8]['with'][i] * 1e6:.0f} us"
            for i, instruction in enumerate(STEP_END)) + " (without -> with)")
    if guard_seconds:
        end = every_rank[0][8]
        grown = sum(end["with"]) - sum(end["without"])
        print(f"the guard on rank 0's critical path (its stage runs the step's last backward): its step end grew by "
              f"{grown * 1e6:.0f} us per step, with the rerun's snapshot "
              f"{(grown + snapshot_seconds) / step * 100:.2f}% of a step")
        print("the guard per step, measure + decide: " + ", ".join(
            f"rank {r[0]} {r[5][0] * 1e6:.0f} + {r[5][1] * 1e6:.0f} us" for r in every_rank))
        print(f"the guard's pieces, each alone: its all-reduce of 4 numbers waited for at once "
              f"{pieces[0] * 1e6:.0f} us (the guard waits for it at the optimizer step), its pass over rank 0's "
              f"gradients {pieces[1] * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
