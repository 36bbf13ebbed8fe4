"""The whole-step memory census (issue 31): real DeepSpeed engines, every live tensor storage counted
through a training step, against cost/memory.py's estimate, per pipeline stage.

For each cell of precision x ZeRO stage x DP x TP (ZeRO 0/1 at PP 1 and 2, ZeRO 2/3 at PP 1 only, as the
engine allows), GPT-2's block and the Llama block, it runs two steps and measures steps 3 and 4 on every
rank (tests/cost/peak_census.py: the storages alive at the step's start plus the highest running sum of
those the step's operators create), and prints measured / estimated for
  peak     the whole step's peak (backward, the gradient reduction, the optimizer step)
  between  the storages alive between steps, against the booked model states + communication buffers
           (weights, gradients, optimizer states; ZeRO 1/2's buckets)
as a markdown table, and writes every number with --json. CPU, gloo, hidden 128, vocabulary 2048,
micro batch 4, seq 64: model states large next to the activations, so both halves of the estimate show.

    python benchmarks/memory_census.py --precision fp32 bf16 --zero 0 1 --dp 1 2 --tp 1 --json census.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MODEL = ("--hidden-size", "128", "--vocab-size", "2048", "--micro-batch-size", "4", "--global-batch-size", "16",
         "--seq-length", "64")
LLAMA = ("--swiglu", "--normalization", "RMSNorm", "--group-query-attention", "--num-query-groups", "2",
         "--disable-bias-linear", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights")
# fp16 with a static loss scale: from 2^32 a dynamic scale overflows through the census's first steps, which
# DeepSpeed then skips, so no optimizer states would exist yet.
# bf16-gradients: bf16 with --no-accumulate-allreduce-grads-in-fp32 (DeepSpeedZeroOptimizer at ZeRO 1).
PRECISION = {"fp32": (), "bf16": ("--bf16",), "bf16-gradients": ("--bf16", "--no-accumulate-allreduce-grads-in-fp32"),
             "fp16": ("--fp16", "--loss-scale", "1024")}


def cells(precisions, zeros, dps, tps, pps, blocks):
    for precision, zero, dp, tp, pp, block in itertools.product(precisions, zeros, dps, tps, pps, blocks):
        if zero >= 2 and pp > 1:
            continue  # DeepSpeed's pipeline engine takes ZeRO 0/1 only
        if precision == "fp16" and zero == 0:
            continue
        if precision == "bf16-gradients" and zero != 1:
            continue  # the same optimizer as bf16 everywhere but ZeRO 1  # refused by validation (DeepSpeed's ZeRO-0 fp16 optimizer does not scale the loss)
        yield precision, zero, dp, tp, pp, block


def _flags(precision, zero, block):
    return list(MODEL) + list(PRECISION[precision]) + ["--zero-stage", str(zero)] + (list(LLAMA) if block == "llama"
                                                                                     else [])


def _measure(tp, pp, dp, extra, ds_json):
    from deepspeed.accelerator import get_accelerator

    from tests.cost.peak_census import engine_peak

    # DeepSpeed's CPU accelerator refuses fp16 at initialize; the bytes do not depend on the device.
    get_accelerator().is_fp16_supported = lambda: True
    return engine_peak(tp, pp, dp, extra, ds_json, phases=True)


def census_cell(precision, zero, dp, tp, pp, block, ds_json, extra=()):
    """One cell's measured and estimated bytes per rank; extra: more pretrain_gpt.py flags (--optimizer muon)."""
    from megatron_lite.deepspeed_config import deepspeed_config, deepspeed_optimizer
    from megatron_lite.cost import memory
    from tests.harness import run_distributed, shutdown_pools

    extra = _flags(precision, zero, block) + list(extra)
    shutdown_pools()  # a fresh pool: no engine of an earlier cell still holds memory
    results = run_distributed(_measure, tp * pp * dp, tp, pp, dp, extra, ds_json)
    shutdown_pools()
    config = results[0]["config"]
    stages = memory.estimate(config, deepspeed_config(config), device="cpu")
    rows = []
    for r in results:
        s = stages[r["stage"]]
        booked = s.between_steps
        rows.append({"rank": r["rank"], "stage": r["stage"], "peak": r["peak"], "estimated_peak": s.peak,
                     "between_steps": r["between_steps"], "estimated_between_steps": booked,
                     "peak_ratio": r["peak"] / s.peak, "between_ratio": r["between_steps"] / booked,
                     "measured_phases": r["phases"],
                     "estimated_phases": {"backward": booked + s.step_gradients + s.activations + s.transient
                                                       + s.gathered,
                                          "reduction": booked + s.step_gradients + s.reduction_transient,
                                          "step": booked + s.step_gradients + s.step_transient}})
    return {"precision": precision, "zero": zero, "dp": dp, "tp": tp, "pp": pp, "block": block,
            "optimizer": deepspeed_optimizer(config), "ranks": rows}


def table(results) -> str:
    lines = ["| block | precision | ZeRO | TP | PP | DP | DeepSpeed optimizer | peak: measured / estimated "
             "| between steps: measured / estimated |", "|---|---|---|---|---|---|---|---|---|"]
    for c in results:
        peak = [r["peak_ratio"] for r in c["ranks"]]
        between = [r["between_ratio"] for r in c["ranks"]]
        span = lambda v: f"{min(v):.3f}" if max(v) - min(v) < 0.0005 else f"{min(v):.3f}-{max(v):.3f}"  # noqa: E731
        lines.append(f"| {c['block']} | {c['precision']} | {c['zero']} | {c['tp']} | {c['pp']} | {c['dp']} "
                     f"| {c['optimizer']} | {span(peak)} | {span(between)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from megatron_lite.atomic import write_text

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", nargs="+", choices=sorted(PRECISION), default=["fp32", "bf16", "fp16"],
                        help="bf16-gradients: --bf16 --no-accumulate-allreduce-grads-in-fp32 (ZeRO 1 only)")
    parser.add_argument("--zero", nargs="+", type=int, choices=(0, 1, 2, 3), default=[0, 1, 2, 3])
    parser.add_argument("--dp", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--pp", nargs="+", type=int, default=[1])
    parser.add_argument("--block", nargs="+", choices=("gpt2", "llama"), default=["gpt2"])
    parser.add_argument("--json", default=None, help="write every rank's numbers here")
    args = parser.parse_args(argv)
    if any(v < 1 for v in args.dp + args.tp + args.pp):
        parser.error("--dp, --tp and --pp take sizes of at least 1")
    ds_json = os.path.join(tempfile.mkdtemp(prefix="census_"), "ds.json")
    with open(ds_json, "w") as f:  # small buckets: the tiny model's ZeRO buckets at a realistic proportion
        json.dump({"zero_optimization": {"reduce_bucket_size": 2000}}, f)
    results = []
    for cell in cells(args.precision, args.zero, args.dp, args.tp, args.pp, args.block):
        start = time.time()
        results.append(census_cell(*cell, ds_json))
        worst = max(abs(r["peak_ratio"] - 1) for r in results[-1]["ranks"])
        print(f"census: {' '.join(map(str, cell))}: worst peak ratio off by {100 * worst:.1f}% "
              f"({time.time() - start:.0f}s)", flush=True)
        if args.json:  # rewritten after every cell, whole or not at all
            write_text(args.json, json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
