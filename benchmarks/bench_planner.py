"""Does the planner's speed prediction hold? Calibrate, plan, sweep and report on this machine, and score it.

One round: `calibrate` measures this machine (GEMMs, copy, collectives) and the model's own steps at each
world size (tuning/measure_model.py); then at each world size `plan --all-savers` prices every layout and
memory saver with that profile, and once more from the constants (no profile); the ZeRO 0 candidates with
no saver, sequence parallelism, selective or full recompute (at most --max-runs, spread over the layouts)
run as a real `sweep` (torchrun, pretrain_gpt.py, a null-tokenizer corpus made here); `report` scores
the calibrated predictions against the measured runs, and the same measurements score the constants'.
Rounds are separate: each calibrates afresh and sweeps again.

Printed per round and world size: the runs, Spearman rank correlation of predicted and measured tokens/s,
the measured tokens/s of the layout predicted fastest over the measured best, predicted / measured step
time (median and worst error), calibrated and from the constants; --json writes every row.

    python benchmarks/bench_planner.py                      # 2 rounds, world sizes 2 and 4 (~25 min here)
    python benchmarks/bench_planner.py --rounds 1 --worlds 2 --max-runs 4 --train-iters 4
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
         "--vocab-size", "1024", "--make-vocab-size-divisible-by", "16", "--global-batch-size", "16"]
SAVERS = ("none", "sequence parallel", "selective recompute", "sequence parallel + selective recompute",
          "full recompute", "sequence parallel + full recompute")
"""The savers swept: those the model times price (ZeRO 0), whole layers recomputed only as every layer."""


def make_corpus(folder: str, vocab: int) -> str:
    from megatron_lite.data.indexed_dataset import IndexedDatasetWriter

    prefix = os.path.join(folder, "null_text_document")
    rng = np.random.RandomState(0)
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for _ in range(2000):
            writer.add_document(np.append(rng.randint(0, vocab - 1, size=rng.randint(50, 400)), vocab - 1))
    return prefix


def _spread(items, n):
    """n of items, evenly spaced over their order, the first always."""
    if n >= len(items):
        return list(items)
    return [items[round(i * (len(items) - 1) / max(n - 1, 1))] for i in range(n)]


def pick(candidates, max_runs: int):
    """ZeRO 0 candidates with a swept saver: about a quarter with a saver (SP, recompute) and the rest without,
    each group spread evenly over the plan's predicted order (fast and slow ones both run), the layout predicted
    fastest always."""
    swept = [c for c in candidates if c.zero_stage == 0 and not c.cpu_offload and c.saver in SAVERS]
    plain = [c for c in swept if c.saver == "none"]
    others = [c for c in swept if c.saver != "none"]
    without = min(len(plain), max_runs - min(len(others), max(2, max_runs // 4)))
    chosen = _spread(plain, without) + _spread(others, min(len(others), max_runs - without))
    if swept and swept[0] not in chosen:
        chosen[0] = swept[0]
    return sorted(chosen, key=candidates.index)


def scored(rows, predictions):
    """prediction_accuracy of the rows with `predictions` (name -> (step seconds, tokens/s)) put in."""
    from megatron_lite.tuning.report import prediction_accuracy

    copies = []
    for r in rows:
        c = dict(r)
        if r["name"] in predictions:
            c["predicted_step_seconds"], c["predicted_tokens_per_s"], c["predicted_from"] = predictions[r["name"]]
        copies.append(c)
    return prediction_accuracy(copies)


def one_world(world: int, profile, profile_path: str, corpus: str, out: str, args) -> dict:
    from megatron_lite.tuning import recipe, report, sweep

    kw = dict(nodes=1, gpus_per_node=world, gpu_memory_gb=args.memory_gb, max_micro_batch=args.max_micro_batch,
              device="cpu", max_context_parallel=1, order="throughput", all_savers=True)
    planned = recipe.plan(args.model, workdir=out, profile=profile, **kw)
    constants = recipe.plan(args.model, workdir=os.path.join(out, "constants"), **kw)
    chosen = pick(planned.candidates, args.max_runs)
    plan = planned.to_dict()
    names = {c.name for c in chosen}
    plan["candidates"] = [c for c in plan["candidates"] if c["name"] in names]
    fixed = ["--data-path", corpus, "--tokenizer-type", "NullTokenizer", "--split", "100,0,0", "--num-workers", "0"]
    launcher = (f"{sys.executable} -m torch.distributed.run --nproc_per_node {{nproc_per_node}} "
                f"--master_addr 127.0.0.1 --master_port {{port}}")
    results = os.path.join(out, "sweep")
    start = time.time()
    counts = sweep.sweep(plan, results, launcher, fixed, train_iters=args.train_iters, warmup_iters=args.warmup_iters,
                         time_limit=600, log=lambda s: print(f"  {s}", flush=True))
    written = report.write_report(results)
    # The constants' predictions of the same candidates (same layout and saver), scored on the same runs.
    by_key = {(c.layout, c.saver): c for c in constants.candidates}
    rename = {c.name: by_key[(c.layout, c.saver)] for c in chosen if (c.layout, c.saver) in by_key}
    uncalibrated = scored(written["rows"], {n: (c.predicted_step_seconds, c.predicted_tokens_per_s, "constants")
                                            for n, c in rename.items()})
    return {"world": world, "counts": counts, "sweep_seconds": time.time() - start, "calibrated": written["accuracy"],
            "constants": uncalibrated, "report": written["markdown"],
            "rows": [{k: r.get(k) for k in ("name", "status", "ms_per_iteration", "predicted_ms_per_iteration",
                                            "predicted_over_measured", "tokens_per_s", "predicted_tokens_per_s",
                                            "predicted_from")} for r in written["rows"]]}


def calibrate(path: str, worlds, args):
    from megatron_lite.tuning.measure import measure
    from megatron_lite.tuning.measure_model import measure_model

    start = time.time()
    profile = measure("cpu", max(worlds), gemm_tokens=(128, 512, 2048), gemm_hidden=args.gemm_hidden,
                      copy_megabytes=64, message_bytes=(2 ** 12, 2 ** 16, 2 ** 20, 2 ** 22), iters=10,
                      min_seconds=0.3)
    for world in worlds:
        profile.models.append(measure_model(args.model, world, args.micro_batches, args.model_reps,
                                            progress=lambda line: print(f"  {line}", flush=True)))
    profile.save(path)
    print(f"  calibrated in {time.time() - start:.0f}s: {path}", flush=True)
    return profile


def line(world: int, label: str, a) -> str:
    if not a:
        return f"world {world} {label:>10}: fewer than 2 completed runs"
    return (f"world {world} {label:>10}: {a['runs']} runs, Spearman {a['spearman']:.3f}, predicted best "
            f"{a['predicted_best_name']} at {a['predicted_best_over_measured_best']:.3f} of the measured best, step "
            f"predicted/measured median {a['median_predicted_over_measured']:.3g}, median error "
            f"{a['median_step_error']:.1%}, worst {a['worst_step_error']:.1%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="separate calibrate + sweep rounds")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes swept")
    parser.add_argument("--max-runs", type=int, default=11, help="candidates swept per world size")
    parser.add_argument("--train-iters", type=int, default=12)
    parser.add_argument("--warmup-iters", type=int, default=3)
    parser.add_argument("--max-micro-batch", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2], help="calibrated micro batches")
    parser.add_argument("--model-reps", type=int, default=5)
    parser.add_argument("--gemm-hidden", type=int, default=128)
    parser.add_argument("--memory-gb", type=float, default=8.0, help="memory per rank the plan may use")
    parser.add_argument("--output", default=None, help="folder for profiles, sweeps and reports (default: temporary)")
    parser.add_argument("--json", default=None, help="write every round's numbers here")
    parser.add_argument("model", nargs="*", help="pretrain_gpt.py model flags after -- (default: a 4-layer, "
                                                 "128-wide GPT at sequence 128, global batch 16)")
    args = parser.parse_args()
    args.model = args.model or MODEL
    out = args.output or tempfile.mkdtemp(prefix="bench_planner_")
    os.makedirs(out, exist_ok=True)
    corpus = make_corpus(out, 1024)
    rounds = []
    for r in range(1, args.rounds + 1):
        print(f"round {r}: calibrate", flush=True)
        profile_path = os.path.join(out, f"round{r}", "profile.json")
        os.makedirs(os.path.dirname(profile_path), exist_ok=True)
        profile = calibrate(profile_path, args.worlds, args)
        worlds = []
        for world in args.worlds:
            print(f"round {r}: world {world}: plan and sweep", flush=True)
            worlds.append(one_world(world, profile, profile_path, corpus, os.path.join(out, f"round{r}",
                                                                                     f"world{world}"), args))
        rounds.append({"round": r, "profile": profile_path, "worlds": worlds})
        for w in worlds:
            print(line(w["world"], "calibrated", w["calibrated"]))
            print(line(w["world"], "constants", w["constants"]))
    if args.json:
        from megatron_lite.atomic import write_text

        write_text(args.json, json.dumps({"model": args.model, "rounds": rounds}, indent=1))
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
