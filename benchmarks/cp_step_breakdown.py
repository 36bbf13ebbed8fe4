"""A context-parallel step, part by part, against what the planner's generic terms predict for each part.

Issue 48: priced from the profile's GEMM and collective fits, CP layouts came out 2.6-2.9x faster than they
ran, while TP / PP / DP layouts priced from calibrate's timed steps of the model were right. This script
finds which terms miss. It measures this machine's profile as `calibrate` does (GEMMs, copy, collectives on
2 gloo ranks; no model times, so the plan prices every layout from the generic terms), plans the planner
bench's model (4 layers, hidden 128, 4 heads, sequence 128, global batch 16: benchmarks/bench_planner.py) on 2
ranks, and runs the same layouts as engines on 2 spawned ranks (one thread each), CP 2 and, for comparison, DP
2, at each --micro-batches, in interleaved rounds (this VM drifts 10-40% within minutes). Per layout:

  measured, the slower rank's, median over rounds:
    fwd+bwd     forward + backward per micro-batch (the engine's timed pipeline instructions, as calibrate times
                them), split into the CP all-to-alls (parallel/context_parallel.py counts their seconds, the
                waits for the peer included) and the rest ("compute")
    reduce, optimizer, engine   per step: the gradient all-reduce, the optimizer step, the engine between
                instructions
    profile     one profiled step's self CPU time by kind (matmuls, attention, copies, collectives, other)
  predicted, tuning/throughput.py with the profile (the terms of the candidate's `predicted_parts`):
    compute     3 x forward FLOPs x the rank's tokens at the GEMM rate measured at that many rows
    a2a         the CP all-to-alls: 2 per layer forward, 2 backward, from the all-to-all fit
    dp_comm     the gradient all-reduce; the generic terms have no optimizer or engine part

    OMP_NUM_THREADS=1 python benchmarks/cp_step_breakdown.py                  # micro batches 1 2 4, 5 rounds
    python benchmarks/cp_step_breakdown.py --micro-batches 2 --rounds 3 --json cp.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from bench_context_parallel import _profile as profiled_step  # noqa: E402
from bench_planner import MODEL  # noqa: E402
from bench_training import join_gloo_world, run_ranks  # noqa: E402

LAYOUTS = {"cp2": (1, 2), "dp2": (1, 1)}
"""name: (TP, CP) on 2 ranks (DP = 2 / (TP CP))."""
KINDS = ("matmuls", "attention", "copies", "collectives", "other")


def _worker(rank, port, args, results):
    import torch.distributed as dist

    from megatron_lite.deepspeed_compat import pipeline
    from megatron_lite.parallel import context_parallel, state
    from megatron_lite.training.engine import Engine
    from megatron_lite.tuning.measure_model import model_base, random_batches, run_config

    join_gloo_world(rank, 2, port)
    base = model_base(MODEL)
    layers, gbs = base.model.num_layers, base.batch.global_batch_size
    engines, data, groups, timers = {}, {}, {}, {}
    for name, (tp, cp) in LAYOUTS.items():
        for micro in args.micro_batches:
            dp = 2 // (tp * cp)
            config = run_config(base, 2, tp, micro, layers, gbs // (micro * dp), {}, cp)
            state.initialize(tp, 1, context_parallel_size=cp)
            key = (name, micro)
            groups[key] = state.current()
            engines[key] = Engine(config, with_scheduler=False)
            data[key] = random_batches(config, state.get_data_parallel_rank(), state.get_context_parallel_rank())
            seconds = timers[key] = {}
            pipeline.time_pipeline_instructions(
                engines[key].engine, lambda n, s, seconds=seconds: seconds.__setitem__(n, seconds.get(n, 0.0) + s),
                lambda: None)
            state.destroy()
    keys = list(engines)
    for key in keys:  # warm-up: allocations, the pipe buffers' shapes
        state.activate(groups[key])
        engines[key].train_step(data[key])
        engines[key].train_step(data[key])
    rounds = []
    for r in range(args.rounds):
        parts = {}
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            state.activate(groups[key])
            gas = engines[key].engine.gradient_accumulation_steps()
            dist.barrier()
            timers[key].clear()
            a2a = context_parallel.seconds()
            start = time.perf_counter()
            engines[key].train_step(data[key])
            step = time.perf_counter() - start
            t = timers[key]
            micro = sum(t.get(n, 0.0) for n in ("LoadMicroBatch", "ForwardPass", "BackwardPass")) / gas
            values = [step, micro, (context_parallel.seconds() - a2a) / gas,
                      sum(t.get(n, 0.0) for n in ("ReduceGrads", "ReduceTiedGrads")), t.get("OptimizerStep", 0.0),
                      step - sum(t.values())]
            slowest = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            parts[key] = slowest.tolist()
        rounds.append(parts)
    profiles = {}
    for key in keys:
        state.activate(groups[key])
        dist.barrier()
        profiles[key] = profiled_step(engines[key], data[key])
    results.put((rank, rounds, profiles))
    dist.destroy_process_group()


def predictions(profile, micro_batches, workdir):
    """layout name, micro -> the generic terms' candidate (no model times: the plan prices from the fits)."""
    from megatron_lite.tuning import recipe

    plan = recipe.plan(MODEL, nodes=1, gpus_per_node=2, gpu_memory_gb=8, max_micro_batch=max(micro_batches),
                       device="cpu", workdir=workdir, profile=profile, order="throughput")
    out = {}
    for c in plan.candidates:
        for name, (tp, cp) in LAYOUTS.items():
            if ((c.tensor_model_parallel_size, c.context_parallel_size, c.pipeline_model_parallel_size) == (tp, cp, 1)
                    and c.micro_batch_size in micro_batches and c.predicted_from == "profile"):
                out[(name, c.micro_batch_size)] = c
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="write every number here")
    args = parser.parse_args()

    from megatron_lite.tuning.measure import measure
    from megatron_lite.tuning.measure_model import model_base

    profile = measure("cpu", 2, gemm_tokens=(128, 512, 2048), gemm_hidden=128, copy_megabytes=64,
                      message_bytes=(2 ** 12, 2 ** 16, 2 ** 20, 2 ** 22), iters=10, min_seconds=0.3)
    predicted = predictions(profile, args.micro_batches, tempfile.mkdtemp(prefix="cp_breakdown_"))
    out = run_ranks(_worker, 2, args)
    rounds, profiles = out[0][1], out[0][2]
    names = ("step", "fwd+bwd", "a2a", "reduce", "optimizer", "engine")
    rows = []
    print(f"2 gloo ranks, one thread each; model {' '.join(MODEL)}; median of {args.rounds} interleaved rounds, the "
          f"slower rank's; ms")
    print(f"{'layout':<10} {'':>9} {'step':>8} {'compute':>9} {'a2a':>8} {'reduce':>8} {'optim':>8} {'engine':>8}"
          f"  per micro-batch: compute, a2a; per step: the rest")
    seq = model_base(MODEL).model.seq_length
    for key in rounds[0]:
        med = {n: statistics.median(r[key][i] for r in rounds) for i, n in enumerate(names)}
        c = predicted[key]
        parts = c.predicted_parts
        gas = c.gradient_accumulation_steps
        stage, a2a = parts["stage_seconds"], parts.get("cp_comm_seconds", 0.0)
        pred = {"step": parts["step_seconds"], "compute": stage - a2a, "a2a": a2a, "reduce": parts["dp_comm_seconds"],
                "optimizer": 0.0, "engine": 0.0}
        meas = {"step": med["step"], "compute": med["fwd+bwd"] - med["a2a"], "a2a": med["a2a"],
                "reduce": med["reduce"], "optimizer": med["optimizer"], "engine": med["engine"]}
        label = f"{key[0]} mb{key[1]}"
        for what, v in (("measured", meas), ("predicted", pred)):
            print(f"{label:<10} {what:>9} " + " ".join(f"{v[k] * 1e3:>{8 if k != 'compute' else 9}.1f}"
                                                      for k in ("step", "compute", "a2a", "reduce", "optimizer",
                                                                "engine")) + f"  gas {gas}")
        ratio = {k: meas[k] / pred[k] for k in pred if pred[k] > 0}
        print(f"{label:<10} {'meas/pred':>9} " + "  ".join(f"{k} {r:.2f}" for k, r in ratio.items()))
        rows.append({"layout": key[0], "micro": key[1], "gas": gas, "measured_s": meas, "predicted_s": pred,
                     "profile_ms": profiles[key]})
    print("\ncompute per micro-batch against the tokens a rank holds (least squares over the micro batches):")
    for name, (tp, cp) in LAYOUTS.items():
        points = [(r["micro"] * seq // cp, r["measured_s"]["compute"] * 1e3) for r in rows if r["layout"] == name]
        if len(points) > 1:
            fit = statistics.linear_regression([t for t, _ in points], [ms for _, ms in points])
            tokens = ", ".join(str(t) for t, _ in points)
            print(f"{name}: {fit.intercept:.1f} ms + {fit.slope:.3f} ms x tokens ({tokens})")
    print("\none profiled step, rank 0, self CPU ms by kind:")
    print(f"{'layout':<10} " + " ".join(f"{k:>12}" for k in KINDS))
    for key, sums in profiles.items():
        print(f"{key[0] + ' mb' + str(key[1]):<10} " + " ".join(f"{sums.get(k, 0.0):>12.1f}" for k in KINDS))
    if args.json:
        from megatron_lite.atomic import write_text

        write_text(args.json, json.dumps({"model": MODEL, "rounds": args.rounds, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
