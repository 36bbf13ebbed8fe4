"""Where --optimizer muon's step goes at each layout: Newton-Schulz, the TP gather, the all-reduces that assemble
ZeRO's partitions (and the small one TP peers agree with), against the whole optimizer step.

A 4-layer GPT of hidden 256 (fp32, one thread per rank) is built as training builds it (training/engine.Engine), its
gradients are random, and the optimizer step alone is timed: the mean of --steps after one warm-up step, with
time.perf_counter around training/muon.py's newton_schulz, gather_dense and its dist.all_reduce calls.

    python benchmarks/muon_step_breakdown.py                 # TP 1, TP 2, DP 2 at ZeRO 0 and 1
    python benchmarks/muon_step_breakdown.py --hidden-size 512 --steps 3
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

LAYOUTS = ((1, 1, 0), (2, 1, 0), (1, 2, 0), (1, 2, 1))
"""(TP, DP, ZeRO stage)."""


def _step_parts(tp: int, dp: int, zero: int, hidden: int, steps: int) -> dict:
    import torch.distributed as dist

    from megatron_lite.arguments import parse_args
    from megatron_lite.parallel import state
    from megatron_lite.training import muon
    from megatron_lite.training.engine import Engine

    torch.set_num_threads(1)
    argv = ["--num-layers", "4", "--hidden-size", str(hidden), "--num-attention-heads", "4", "--seq-length", "64",
            "--vocab-size", "2048", "--micro-batch-size", "1", "--global-batch-size", str(dp), "--train-iters", "10",
            "--lr", "1e-3", "--optimizer", "muon", "--zero-stage", str(zero), "--tensor-model-parallel-size", str(tp)]
    config = parse_args(argv, world_size=tp * dp)[0]
    state.initialize(tp, 1)
    engine = Engine(config, with_scheduler=False)
    spent = {"newton_schulz": 0.0, "tp_gather": 0.0, "all_reduce": 0.0}

    def timed(function, part):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - start
        return run

    class TimedDist:  # muon.dist with its all_reduce timed, the rest torch.distributed's
        all_reduce = staticmethod(timed(dist.all_reduce, "all_reduce"))

        def __getattr__(self, name):
            return getattr(dist, name)

    originals = muon.newton_schulz, muon.gather_dense, muon.dist
    muon.newton_schulz, muon.gather_dense = timed(muon.newton_schulz, "newton_schulz"), timed(muon.gather_dense,
                                                                                              "tp_gather")
    muon.dist = TimedDist()
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    tensors = [t for group in inner.param_groups for t in group["params"]]

    def step() -> float:
        for t in tensors:
            t.grad = torch.randn_like(t)
        dist.barrier()
        start = time.perf_counter()
        inner.step()
        dist.barrier()
        return time.perf_counter() - start

    try:
        step()  # warm-up: the buffers are made
        for part in spent:
            spent[part] = 0.0
        total = sum(step() for _ in range(steps)) / steps
    finally:
        muon.newton_schulz, muon.gather_dense, muon.dist = originals
    return {"step_ms": 1e3 * total, **{f"{part}_ms": 1e3 * seconds / steps for part, seconds in spent.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.steps < 1 or args.hidden_size < 4 or args.hidden_size % 4:
        parser.error("--steps at least 1, --hidden-size a positive multiple of 4 (4 heads)")
    from tests.harness import run_distributed

    print("TP DP ZeRO | step ms | Newton-Schulz ms | TP gather ms | all-reduce ms   (each rank)")
    for tp, dp, zero in LAYOUTS:
        for r in run_distributed(_step_parts, tp * dp, tp, dp, zero, args.hidden_size, args.steps):
            print(f"{tp:2d} {dp:2d} {zero:4d} | {r['step_ms']:7.1f} | {r['newton_schulz_ms']:16.1f} | "
                  f"{r['tp_gather_ms']:12.1f} | {r['all_reduce_ms']:13.1f}", flush=True)


if __name__ == "__main__":
    main()
