"""The pipeline bubble of --pipeline-schedule dualpipev against 1f1b, measured with the engines' instruction timings.

PP processes (one thread each, gloo on loopback, DP 1) hold four engines of the same GPT: 1f1b and dualpipev,
each at gas 2 PP and 4 PP (micro batch fixed, so the global batch follows gas). They run in interleaved rounds,
the order rotating (this VM drifts 10-25% within a minute). Every instruction of every engine is timed
(deepspeed_compat.pipeline.time_pipeline_instructions). Per rank and step:
  compute  its ForwardPass + BackwardPass time
  idle     the step's wall time less compute, LoadMicroBatch and OptimizerStep: time blocked in sends,
           receives and CommitP2P, in the gradient reductions and the loss broadcast waiting for other ranks
           (the bubble), plus the engine's own overhead
  bubble   idle / (compute + idle), averaged over the ranks
Printed per PP and gas: each schedule's median step, compute and bubble, the dualpipev / 1f1b ratios of step
time and idle time (median over rounds, and their range), and the bubble the model predicts
(cost/pipeline_efficiency.py) next to a replay of DeepSpeed's instruction streams with the forward and backward
times measured per stage (cost/schedule_replay.py).

    OMP_NUM_THREADS=1 python benchmarks/bench_pipeline_schedules.py                 # PP 2 and 4, CPU-sized
    python benchmarks/bench_pipeline_schedules.py --pp 2 --rounds 5 --hidden-size 512
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from bench_training import join_gloo_world, run_ranks  # noqa: E402

SCHEDULES = ("1f1b", "dualpipev")
OWN_WORK = ("ForwardPass", "BackwardPass", "LoadMicroBatch", "OptimizerStep")


def model_argv(args, pp, gas, schedule):
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(args.seq_length),
            "--vocab-size", str(args.vocab_size), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size",
            str(args.micro_batch_size * gas), "--pipeline-model-parallel-size", str(pp),
            "--pipeline-schedule", schedule, "--position-embedding-type", "rope", "--lr", "1e-4"]


def batches(config):
    g = torch.Generator().manual_seed(0)
    micro, seq = config.batch.micro_batch_size, config.model.seq_length
    positions = torch.arange(seq).expand(micro, seq).contiguous()
    while True:
        sample = torch.randint(0, config.model.vocab_size, (micro, seq + 1), generator=g)
        yield (sample[:, :-1].contiguous(), positions), (sample[:, 1:].contiguous(), torch.ones(micro, seq))


def _worker(rank, port, pp, args, results):
    import torch.distributed as dist

    from megatron_lite.arguments import parse_args
    from megatron_lite.deepspeed_compat import pipeline
    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine

    join_gloo_world(rank, pp, port)
    names = [(gas, schedule) for gas in (2 * pp, 4 * pp) for schedule in SCHEDULES]
    engines, data, groups, sums, stages = {}, {}, {}, {}, {}
    for name in names:
        config = parse_args(model_argv(args, pp, *name), world_size=pp)[0]
        state.initialize(1, pp)
        groups[name] = state.current()
        engines[name] = Engine(config, with_scheduler=False)
        data[name] = batches(config)
        sums[name] = defaultdict(float)
        # forward and backward per stage: the phase-1 stage of a DualPipeV rank is 2 PP - 1 - rank
        per_stage = stages[name] = defaultdict(float)

        def record(instruction, seconds, sums=sums[name]):
            sums[instruction] += seconds

        def stage_of(kwargs, schedule=name[1]):
            return 2 * pp - 1 - rank if schedule == "dualpipev" and kwargs.get("phase") == 1 else rank

        pipeline.time_pipeline_instructions(engines[name].engine, record, lambda: None)
        for instruction in ("ForwardPass", "BackwardPass"):  # per stage as well: the replay's durations
            def wrap(method, instruction=instruction, per_stage=per_stage, stage_of=stage_of):
                def timed(self, **kwargs):
                    start = time.perf_counter()
                    out = method(self, **kwargs)
                    per_stage[(instruction, stage_of(kwargs))] += time.perf_counter() - start
                    return out
                return timed
            pipeline.wrap_instruction(engines[name].engine, instruction, wrap)
        state.destroy()
    for name in names:  # warm-up: allocations, the activation shapes sent once
        state.activate(groups[name])
        engines[name].train_step(data[name])
        sums[name].clear()
        stages[name].clear()
    rounds = []
    for r in range(args.rounds):
        seconds, detail = {}, {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            state.activate(groups[name])
            sums[name].clear()
            stages[name].clear()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                engines[name].train_step(data[name])
            seconds[name] = (time.perf_counter() - start) / args.steps
            detail[name] = ({k: v / args.steps for k, v in sums[name].items()},
                            {k: v / args.steps for k, v in stages[name].items()})
        rounds.append((seconds, detail))
        if rank == 0:
            print(f"PP {pp} round {r + 1}/{args.rounds}: " + ", ".join(
                f"gas {g} {s} {seconds[(g, s)] * 1e3:.0f} ms" for g, s in names), flush=True)
    results.put((rank, rounds))
    dist.destroy_process_group()


def _predicted(pp, gas, schedule, per_stage_seconds):
    """(model bubble with B = 2F, replayed bubble with the measured per-stage forward and backward times)."""
    from megatron_lite.cost.pipeline_efficiency import bubble_efficiency, dualpipev_bubble_efficiency
    from megatron_lite.cost.schedule_replay import replay
    from megatron_lite.deepspeed_compat.dualpipev import instruction_streams, timed_streams

    model = 1 - (dualpipev_bubble_efficiency(pp, gas) if schedule == "dualpipev" else bubble_efficiency(pp, gas))
    kind = {"forward": "ForwardPass", "backward": "BackwardPass"}
    streams = timed_streams(instruction_streams(pp, gas, schedule),
                            lambda k, stage: per_stage_seconds.get((kind[k], stage), 0.0) / gas)
    end = max(replay(streams))
    work = [sum(v for (_, s), v in per_stage_seconds.items() if s in stages)
            for stages in ([(r, 2 * pp - 1 - r) if schedule == "dualpipev" else (r,) for r in range(pp)])]
    return model, statistics.mean(1 - w / end for w in work)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes (processes) to run")
    parser.add_argument("--num-layers", type=int, default=8, help="transformer layers (at least 2 x the largest PP)")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps per engine per round")
    args = parser.parse_args()
    if args.num_layers < 2 * max(args.pp):
        parser.error(f"--num-layers {args.num_layers}: dualpipev cuts 2 x PP stages of a layer at least; use "
                     f"--num-layers {2 * max(args.pp)} or more")

    summary = []
    for pp in args.pp:
        out = run_ranks(_worker, pp, pp, args)
        for gas in (2 * pp, 4 * pp):
            row = {}
            for schedule in SCHEDULES:
                name = (gas, schedule)
                steps, computes, idles, bubbles, replayed = [], [], [], [], []
                for i in range(args.rounds):
                    # the slowest rank's wall time is the step (it ends in the loss broadcast anyway)
                    step = max(rank_rounds[i][0][name] for _, rank_rounds in out)
                    per_rank = [rank_rounds[i][1][name] for _, rank_rounds in out]
                    compute = [s.get("ForwardPass", 0.0) + s.get("BackwardPass", 0.0) for s, _ in per_rank]
                    idle = [step - sum(s.get(k, 0.0) for k in OWN_WORK) for s, _ in per_rank]
                    steps.append(step)
                    computes.append(statistics.mean(compute))
                    idles.append(statistics.mean(idle))
                    bubbles.append(statistics.mean(i_ / (c + i_) for c, i_ in zip(compute, idle)))
                    stage_seconds = {k: v for _, st in per_rank for k, v in st.items()}
                    replayed.append(_predicted(pp, gas, schedule, stage_seconds))
                row[schedule] = (steps, computes, idles, bubbles, replayed)
            summary.append((pp, gas, row))

    print(f"\n{args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads, seq "
          f"{args.seq_length}, vocabulary {args.vocab_size}, micro batch {args.micro_batch_size}, DP 1, fp32 on CPU, "
          f"{args.rounds} interleaved rounds of {args.steps} step(s)")
    print(f"{'PP':>3} {'gas':>4} {'schedule':<10} {'step ms':>8} {'compute':>8} {'idle':>7} {'bubble':>7} "
          f"{'model':>6} {'replay':>7}")
    for pp, gas, row in summary:
        for schedule in SCHEDULES:
            steps, computes, idles, bubbles, replayed = row[schedule]
            model = replayed[0][0]
            print(f"{pp:>3} {gas:>4} {schedule:<10} {statistics.median(steps) * 1e3:>8.1f} "
                  f"{statistics.median(computes) * 1e3:>8.1f} {statistics.median(idles) * 1e3:>7.1f} "
                  f"{statistics.median(bubbles):>7.3f} {model:>6.3f} "
                  f"{statistics.median(r for _, r in replayed):>7.3f}")
    print(f"\n{'PP':>3} {'gas':>4} {'dualpipev/1f1b step':>20} {'rounds':>13} {'idle ratio':>11} {'rounds':>13}")
    for pp, gas, row in summary:
        step_ratio = [d / o for d, o in zip(row["dualpipev"][0], row["1f1b"][0])]
        idle_ratio = [d / o for d, o in zip(row["dualpipev"][2], row["1f1b"][2])]
        print(f"{pp:>3} {gas:>4} {statistics.median(step_ratio):>20.3f} {min(step_ratio):>6.3f}..{max(step_ratio):.3f} "
              f"{statistics.median(idle_ratio):>11.3f} {min(idle_ratio):>6.3f}..{max(idle_ratio):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
