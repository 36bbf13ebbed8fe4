"""Step time of sequence parallelism and of selective recompute, against baselines in the same run.

Two processes (TP 2, one thread each, gloo on loopback) hold four engines of the same GPT:
  tp2         TP 2, no sequence parallelism, no recompute (the baseline of `sp`)
  sp          --sequence-parallel
  selective   --recompute-granularity selective
  full        --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
and time them in interleaved rounds (this VM drifts 10-25% within a minute): each round runs
--steps optimizer steps of every engine, in an order that rotates from round to round. Printed:
per engine the median seconds per step, the median of the per-round ratios sp/tp2 and
selective/full (with their range), and the activation bytes per micro-batch cost/memory.py
expects on each rank. The slower rank's time counts (a step ends with a collective anyway).

    OMP_NUM_THREADS=1 python benchmarks/bench_sequence_parallel.py                # CPU-sized defaults
    python benchmarks/bench_sequence_parallel.py --seq-length 1024 --rounds 9 --attention-backend fused
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_training import add_model_arguments, join_gloo_world, random_batches, run_ranks  # noqa: E402

VARIANTS = {
    "tp2": [],
    "sp": ["--sequence-parallel"],
    "selective": ["--recompute-granularity", "selective"],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
}
RATIOS = (("sp", "tp2"), ("selective", "full"), ("selective", "tp2"), ("full", "tp2"))


def model_argv(args):
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(args.seq_length),
            "--vocab-size", str(args.vocab_size), "--hidden-dropout", str(args.dropout),
            "--attention-dropout", str(args.dropout), "--micro-batch-size", str(args.micro_batch_size),
            "--global-batch-size", str(args.micro_batch_size * args.gas), "--tensor-model-parallel-size", "2",
            "--attention-backend", args.attention_backend, "--lr", "1e-4"]


def _worker(rank, port, args, results):
    import torch.distributed as dist

    from megatron_lite.arguments import parse_args
    from megatron_lite.cost import memory
    from megatron_lite.parallel import state
    from megatron_lite.deepspeed_config import deepspeed_config
    from megatron_lite.training.engine import Engine

    join_gloo_world(rank, 2, port)
    state.initialize(2, 1)
    engines, data, activations = {}, {}, {}
    for name, extra in VARIANTS.items():
        config = parse_args(model_argv(args) + extra, world_size=2)[0]
        engines[name], data[name] = Engine(config, with_scheduler=False), random_batches(config)
        stage = memory.estimate(config, deepspeed_config(config), device="cpu")[0]
        activations[name] = stage.activations_per_micro_batch
    names = list(VARIANTS)
    for name in names:  # warm-up: allocations, the pipe buffers' shapes
        engines[name].train_step(data[name])
    rounds = []
    for r in range(args.rounds):
        seconds = {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                engines[name].train_step(data[name])
            seconds[name] = (time.perf_counter() - start) / args.steps
        rounds.append(seconds)
        if rank == 0:
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {s * 1e3:.0f} ms" for n, s in seconds.items()),
                  flush=True)
    results.put((rank, rounds, activations))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser, seq_length=512, micro_batch_size=4)
    parser.add_argument("--gas", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout")
    parser.add_argument("--attention-backend", default="fused", choices=("sdpa", "fused"),
                        help="fused keeps the s x s scores that selective recompute drops (default)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per engine per round")
    args = parser.parse_args()

    out = run_ranks(_worker, 2, args)
    rounds = [{n: max(rank_rounds[i][n] for _, rank_rounds, _ in out) for n in VARIANTS}
              for i in range(args.rounds)]
    activations = out[0][2]
    print(f"\nTP 2 on CPU, {args.num_layers} layers, hidden {args.hidden_size}, seq {args.seq_length}, micro batch "
          f"{args.micro_batch_size} x {args.gas}, dropout {args.dropout}, "
          f"--attention-backend {args.attention_backend}, "
          f"{args.rounds} interleaved rounds of {args.steps} steps")
    print(f"{'engine':<10} {'ms/step (median)':>17} {'activations/micro-batch (estimate)':>36}")
    for n in VARIANTS:
        print(f"{n:<10} {statistics.median(r[n] for r in rounds) * 1e3:>17.1f} {activations[n] / 2 ** 20:>32.2f} MiB")
    print(f"\n{'ratio':<18} {'median':>7} {'rounds':>14}")
    for a, b in RATIOS:
        per_round = [r[a] / r[b] for r in rounds]
        print(f"{a + '/' + b:<18} {statistics.median(per_round):>7.3f} {min(per_round):>6.3f}..{max(per_round):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
