"""Step time of context parallelism against data and tensor parallelism on the same two processes.

Two processes (one thread each, gloo on loopback) hold three engines of the same GPT at the same
sequence length, each built under its own process groups:
  cp2   --context-parallel-size 2: each rank holds half of every sample's tokens, attention trades
        them for half of the heads by all-to-all (two per layer forward, two backward)
  dp2   data parallelism: each rank holds whole samples, half of the micro-batches
  tp2   --tensor-model-parallel-size 2: each rank holds half of every matrix, all-reduces per layer
The global batch is the same (micro x gas x DP), so every engine does the same work per step.
They run in interleaved rounds (this VM drifts 10-25% within a minute), in an order that rotates.
Printed: median ms per step of each, the per-round ratios cp2/dp2 and cp2/tp2 (median and range),
cp2's time inside its all-to-alls (parallel/context_parallel.py counts it), and with --profile one
profiled step per engine broken into matmuls, attention, collectives, copies and the rest (self CPU
time; a collective's wait for its peer shows in the all-to-all counter, not always in the profile).

    OMP_NUM_THREADS=1 python benchmarks/bench_context_parallel.py                 # CPU-sized defaults
    python benchmarks/bench_context_parallel.py --seq-length 4096 --rounds 5 --profile
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from bench_training import add_model_arguments, join_gloo_world, run_ranks  # noqa: E402

VARIANTS = {  # name: (TP, CP, DP)
    "cp2": (1, 2, 1),
    "dp2": (1, 1, 2),
    "tp2": (2, 1, 1),
}
RATIOS = (("cp2", "dp2"), ("cp2", "tp2"))
# Profiler event names -> where the time goes (self CPU time; the first matching bucket wins).
BUCKETS = (("collectives", ("c10d", "gloo", "all_to_all", "allreduce", "all_reduce", "broadcast", "recv", "send")),
           ("attention", ("scaled_dot_product", "softmax", "flash", "_efficient_attention")),
           ("copies", ("copy_", "cat", "clone", "contiguous", "repeat", "permute", "transpose", "empty")),
           ("matmuls", ("mm", "matmul", "linear", "bmm", "addmm")))


def model_argv(args, tp, cp, dp):
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(args.seq_length),
            "--vocab-size", str(args.vocab_size), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size",
            str(args.micro_batch_size * args.gas * 2), "--tensor-model-parallel-size", str(tp),
            "--context-parallel-size", str(cp), "--position-embedding-type", "rope", "--lr", "1e-4"]


def batches(config, cp_rank, cp):
    """Random micro-batches, this rank's part of each under CP."""
    from megatron_lite.data.context_parallel import context_parallel_part

    g = torch.Generator().manual_seed(0)
    micro, seq = config.batch.micro_batch_size, config.model.seq_length
    positions = torch.arange(seq).expand(micro, seq).contiguous()
    while True:
        sample = torch.randint(0, config.model.vocab_size, (micro, seq + 1), generator=g)
        arrays = (sample[:, :-1].contiguous(), positions, sample[:, 1:].contiguous(), torch.ones(micro, seq))
        if cp > 1:
            arrays = context_parallel_part(arrays, cp_rank, cp)
        yield (arrays[0], arrays[1]), (arrays[2], arrays[3])


def _bucket(name: str) -> str:
    lowered = name.lower()
    return next((bucket for bucket, keys in BUCKETS if any(k in lowered for k in keys)), "other")


def _profile(engine, data):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.train_step(data)
    sums = {}
    for event in prof.key_averages():
        sums[_bucket(event.key)] = sums.get(_bucket(event.key), 0.0) + event.self_cpu_time_total / 1e3
    return sums


def _worker(rank, port, args, results):
    import torch.distributed as dist

    from megatron_lite.arguments import parse_args
    from megatron_lite.parallel import context_parallel, state
    from megatron_lite.training.engine import Engine

    join_gloo_world(rank, 2, port)
    engines, data, groups = {}, {}, {}
    for name, (tp, cp, dp) in VARIANTS.items():
        config = parse_args(model_argv(args, tp, cp, dp), world_size=2)[0]
        state.initialize(tp, 1, context_parallel_size=cp)
        groups[name] = state.current()
        engines[name] = Engine(config, with_scheduler=False)
        data[name] = batches(config, state.get_context_parallel_rank(), cp)
        state.destroy()
    names = list(VARIANTS)
    for name in names:  # warm-up: allocations, the pipe buffers' shapes
        state.activate(groups[name])
        engines[name].train_step(data[name])
    rounds, a2a = [], []
    for r in range(args.rounds):
        seconds = {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            state.activate(groups[name])
            dist.barrier()
            before = context_parallel.seconds()
            start = time.perf_counter()
            for _ in range(args.steps):
                engines[name].train_step(data[name])
            seconds[name] = (time.perf_counter() - start) / args.steps
            if name == "cp2":
                a2a.append((context_parallel.seconds() - before) / args.steps)
        rounds.append(seconds)
        if rank == 0:
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {s * 1e3:.0f} ms" for n, s in seconds.items()),
                  flush=True)
    profiles = {}
    if args.profile:
        for name in names:
            state.activate(groups[name])
            dist.barrier()
            profiles[name] = _profile(engines[name], data[name])
    results.put((rank, rounds, a2a, profiles))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser, seq_length=2048, micro_batch_size=1)
    parser.add_argument("--gas", type=int, default=2, help="micro-batches per step per data-parallel rank of dp2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per engine per round")
    parser.add_argument("--profile", action="store_true", help="profile one step of each engine afterwards")
    args = parser.parse_args()

    out = run_ranks(_worker, 2, args)
    # The slower rank's time counts (a step ends with a collective anyway).
    rounds = [{n: max(rank_rounds[i][n] for _, rank_rounds, _, _ in out) for n in VARIANTS}
              for i in range(args.rounds)]
    a2a = statistics.median(max(rank_a2a[i] for _, _, rank_a2a, _ in out) for i in range(args.rounds))
    print(f"\n2 processes on CPU, {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} "
          f"heads, seq {args.seq_length}, global batch {args.micro_batch_size * args.gas * 2}, "
          f"{args.rounds} interleaved rounds of {args.steps} steps")
    print(f"{'engine':<8} {'ms/step (median)':>17}")
    for n in VARIANTS:
        print(f"{n:<8} {statistics.median(r[n] for r in rounds) * 1e3:>17.1f}")
    cp_step = statistics.median(r["cp2"] for r in rounds)
    print(f"cp2 all-to-alls: {a2a * 1e3:.1f} ms/step ({a2a / cp_step:.1%} of its step)")
    print(f"\n{'ratio':<10} {'median':>7} {'rounds':>14}")
    for a, b in RATIOS:
        per_round = [r[a] / r[b] for r in rounds]
        print(f"{a + '/' + b:<10} {statistics.median(per_round):>7.3f} {min(per_round):>6.3f}..{max(per_round):.3f}")
    if args.profile:
        print("\none profiled step, rank 0, self CPU ms by kind:")
        kinds = ("matmuls", "attention", "collectives", "copies", "other")
        print(f"{'engine':<8} " + " ".join(f"{k:>12}" for k in kinds))
        for n in VARIANTS:
            sums = out[0][3][n]
            print(f"{n:<8} " + " ".join(f"{sums.get(k, 0.0):>12.1f}" for k in kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
