"""Does the planner's speed prediction hold? Calibrate, plan, sweep and report on this machine, and score it.

One round: `calibrate` measures this machine (GEMMs, copy, collectives) and the model's own steps at each
world size and layout kind, context parallelism included (tuning/measure_model.py); at each world size `plan
--all-savers` prices every layout and memory saver with that profile (--no-savers: `plan` as the recipe runs it,
the fastest saver of each layout); the ZeRO 0 candidates with no saver, sequence parallelism, selective or full
recompute (CP or not; at most --max-runs, spread over the layouts, the CP and the other layouts in proportion)
run as a real `sweep` (torchrun, pretrain_gpt.py, a null-tokenizer corpus made here). Calibration and sweep run in --passes interleaved passes: the model times
again, then every swept layout again (in the opposite order), each run keeping its fastest of all passes
(calibrate --model-passes, sweep --repeats). This 2-core VM has slow spells that only ever lengthen a
measurement, and it drifts over minutes: calibrated before sweeping (2026-11-26, two rounds), the two
calibrations, half an hour apart, timed the same runs 0.82x-1.57x of each other, and the second round's
world-4 predictions came out 1.11x the measured steps at the median where the first round's were 1.02x;
interleaved, calibration and sweep see the same spells. Then the round's final profile (every pass) prices the swept layouts, `report` scores those
predictions against the measured runs, and the constants' plan (no profile) is scored on the same runs.
Rounds are separate: each calibrates afresh and sweeps again.

Printed per round and world size: the runs, Spearman rank correlation of predicted and measured tokens/s,
the measured tokens/s of the layout predicted fastest over the measured best, predicted / measured step
time (median and worst error), calibrated and from the constants, over all runs and apart for the layouts
with and without context parallelism; --json writes every row. After two or
more rounds (or with --spread over earlier --json files, without measuring): each layout's measured step in
every round and their spread (slowest / fastest), the bound on how close any prediction made at another
time can come to it on this machine.

    python benchmarks/bench_planner.py                      # 2 rounds, world sizes 2 and 4 (~60 min here)
    python benchmarks/bench_planner.py --rounds 1 --no-savers --micro-batches 1 2 4 --max-micro-batch 4 \
        --max-runs 12                                       # issue 48's recipe: every world-2 layout
    python benchmarks/bench_planner.py --rounds 1 --worlds 2 --max-runs 4 --train-iters 4 --passes 1
    python benchmarks/bench_planner.py --spread a.json b.json   # the spread over earlier runs' rounds
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


def swept_saver(c) -> str:
    """The candidate's saver without its context parallelism ('context parallel 2 + full recompute' -> 'full
    recompute'): CP is a layout the sweep runs like the others."""
    parts = [p for p in c.saver.split(" + ") if not p.startswith("context parallel")]
    return " + ".join(parts) or "none"


def _pick_among(swept, max_runs: int):
    """About a quarter with a saver (SP, recompute) and the rest without, each group spread evenly over the
    plan's predicted order (fast and slow ones both run)."""
    plain = [c for c in swept if swept_saver(c) == "none"]
    others = [c for c in swept if swept_saver(c) != "none"]
    without = min(len(plain), max_runs - min(len(others), max(2, max_runs // 4)))
    return _spread(plain, without) + _spread(others, min(len(others), max_runs - without))


def pick(candidates, max_runs: int):
    """ZeRO 0 candidates with a swept saver, the CP layouts and the others in proportion to their numbers (at
    least 2 of each kind where there are), each as _pick_among; the layout predicted fastest always."""
    swept = [c for c in candidates if c.zero_stage == 0 and not c.cpu_offload and swept_saver(c) in SAVERS]
    cp = [c for c in swept if c.context_parallel_size > 1]
    rest = [c for c in swept if c.context_parallel_size == 1]
    runs_cp = min(len(cp), max(min(2, max_runs // 2), round(max_runs * len(cp) / max(len(swept), 1))))
    chosen = _pick_among(rest, max_runs - runs_cp) + _pick_among(cp, runs_cp)
    fastest = min(swept, key=lambda c: c.throughput_rank, default=None)
    if fastest is not None and fastest not in chosen:
        chosen[0] = fastest
    return sorted(chosen, key=candidates.index)


KINDS = (("all", lambda r: True), ("no CP", lambda r: (r.get("context_parallel_size") or 1) == 1),
         ("CP", lambda r: (r.get("context_parallel_size") or 1) > 1))
"""The runs scored together and apart: the layouts with context parallelism and the others."""


def by_kind(rows, score):
    """score(rows of a kind) for each of KINDS."""
    return {kind: score([r for r in rows if keep(r)]) for kind, keep in KINDS}


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


def prepare(world: int, profile, out: str, args):
    """The plan priced by `profile` and the candidates to sweep (pick), as the plan JSON sweep takes."""
    from megatron_lite.tuning import recipe

    planned = recipe.plan(args.model, workdir=out, profile=profile, **plan_kwargs(world, args))
    chosen = {c.name for c in pick(planned.candidates, args.max_runs)}
    plan = planned.to_dict()
    plan["candidates"] = [c for c in plan["candidates"] if c["name"] in chosen]
    return plan


def plan_kwargs(world: int, args) -> dict:
    return dict(nodes=1, gpus_per_node=world, gpu_memory_gb=args.memory_gb, max_micro_batch=args.max_micro_batch,
                device="cpu", max_context_parallel=args.max_context_parallel, order="throughput",
                all_savers=not args.no_savers)


def sweep_pass(plan, corpus: str, results: str, passes_done: int, args) -> dict:
    """The sweep's pass `passes_done` (sweep --repeats: the earlier passes' runs are kept, the new pass runs
    every completed candidate once more, in the order opposite to the pass before)."""
    from megatron_lite.tuning import sweep

    fixed = ["--data-path", corpus, "--tokenizer-type", "NullTokenizer", "--split", "100,0,0", "--num-workers", "0"]
    launcher = (f"{sys.executable} -m torch.distributed.run --nproc_per_node {{nproc_per_node}} "
                f"--master_addr 127.0.0.1 --master_port {{port}}")
    return sweep.sweep(plan, results, launcher, fixed, train_iters=args.train_iters, warmup_iters=args.warmup_iters,
                       time_limit=600, log=lambda s: print(f"  {s}", flush=True), repeats=passes_done)


def score(world: int, profile, results: str, out: str, args) -> dict:
    """The swept runs scored against the plan priced by the round's final profile (every pass's fastest runs)
    and against the constants' plan, each candidate matched by layout and saver. The final profile's
    predictions are written into each run's result.json before `report` reads them."""
    from megatron_lite.atomic import write_text
    from megatron_lite.tuning import recipe, report
    from megatron_lite.tuning.sweep import collect

    final = recipe.plan(args.model, workdir=os.path.join(out, "final"), profile=profile, **plan_kwargs(world, args))
    constants = recipe.plan(args.model, workdir=os.path.join(out, "constants"), **plan_kwargs(world, args))
    by_layout = {(c.layout, c.saver): c for c in final.candidates}
    for row in collect(results):
        c = by_layout.get((row["layout"], row["saver"]))
        row.update(predicted_step_seconds=c and c.predicted_step_seconds,
                   predicted_tokens_per_s=c and c.predicted_tokens_per_s, predicted_from=c and c.predicted_from)
        write_text(os.path.join(results, row["name"], "result.json"), json.dumps(row, indent=1))
    written = report.write_report(results)
    by_key = {(c.layout, c.saver): c for c in constants.candidates}
    constant_prices = {r["name"]: (by_key[k].predicted_step_seconds, by_key[k].predicted_tokens_per_s, "constants")
                       for r in written["rows"] if (k := (r["layout"], r["saver"])) in by_key}
    return {"world": world, "calibrated": by_kind(written["rows"], lambda rows: scored(rows, {})),
            "constants": by_kind(written["rows"], lambda rows: scored(rows, constant_prices)),
            "report": written["markdown"],
            "rows": [{k: r.get(k) for k in ("name", "status", "ms_per_iteration", "predicted_ms_per_iteration",
                                            "predicted_over_measured", "tokens_per_s", "predicted_tokens_per_s",
                                            "predicted_from", "repeats")} for r in written["rows"]]}


def measure_machine(worlds, args):
    """GEMMs, copy and collectives (once a round: the model times price the step, these scale its reduction)."""
    from megatron_lite.tuning.measure import measure

    return measure("cpu", max(worlds), gemm_tokens=(128, 512, 2048), gemm_hidden=args.gemm_hidden,
                   copy_megabytes=64, message_bytes=(2 ** 12, 2 ** 16, 2 ** 20, 2 ** 22), iters=10, min_seconds=0.3)


def calibration_pass(worlds, models, args) -> None:
    """One more pass of the model times at each world size, merged into `models` (world -> ModelTimes)."""
    from megatron_lite.tuning.measure_model import measure_model, merge_model_times

    start = time.time()
    for world in worlds:
        times = measure_model(args.model, world, args.micro_batches, args.model_reps,
                              max_context_parallel=args.max_context_parallel)
        models[world] = merge_model_times(models[world], times) if world in models else times
    print(f"  model times at world {', '.join(map(str, worlds))} in {time.time() - start:.0f}s", flush=True)


def one_round(r: int, corpus: str, out: str, args) -> dict:
    """Calibrate and sweep in --passes interleaved passes (module docstring); score against the final profile."""
    start = time.time()
    base = os.path.join(out, f"round{r}")
    os.makedirs(base, exist_ok=True)
    profile = measure_machine(args.worlds, args)
    models, plans = {}, {}
    for n in range(1, args.passes + 1):
        print(f"round {r}: calibration pass {n}/{args.passes}", flush=True)
        calibration_pass(args.worlds, models, args)
        profile.models = [models[w] for w in args.worlds]
        profile.save(os.path.join(base, f"profile_pass{n}.json"))
        for world in args.worlds:
            if world not in plans:  # the runs are chosen by the first pass's plan
                plans[world] = prepare(world, profile, os.path.join(base, f"world{world}"), args)
            print(f"round {r}: world {world}: sweep pass {n}/{args.passes}", flush=True)
            sweep_pass(plans[world], corpus, os.path.join(base, f"world{world}", "sweep"), n, args)
    profile_path = os.path.join(base, "profile.json")
    profile.save(profile_path)
    worlds = [score(w, profile, os.path.join(base, f"world{w}", "sweep"), os.path.join(base, f"world{w}"), args)
              for w in args.worlds]
    return {"round": r, "profile": profile_path, "seconds": time.time() - start, "worlds": worlds}


def line(world: int, label: str, a) -> str:
    if not a:
        return f"world {world} {label:>16}: fewer than 2 completed runs"
    return (f"world {world} {label:>16}: {a['runs']} runs, Spearman {a['spearman']:.3f}, predicted best "
            f"{a['predicted_best_name']} at {a['predicted_best_over_measured_best']:.3f} of the measured best, step "
            f"predicted/measured median {a['median_predicted_over_measured']:.3g}, median error "
            f"{a['median_step_error']:.1%}, worst {a['worst_step_error']:.1%}")


def measured_spread(rounds) -> list:
    """Each (world, layout) measured in two or more rounds: its step times (ms) and slowest / fastest."""
    seen = {}
    for r in rounds:
        for w in r["worlds"]:
            for row in w["rows"]:
                if row["status"] == "completed":
                    layout = row["name"].split("_", 1)[1]  # the sweep's run number differs between plans
                    seen.setdefault((w["world"], layout), []).append(row["ms_per_iteration"])
    return [{"world": world, "layout": layout, "ms_per_iteration": times, "spread": max(times) / min(times)}
            for (world, layout), times in sorted(seen.items()) if len(times) > 1]


def spread_lines(spread) -> list:
    if not spread:
        return ["no layout completed in two rounds"]
    lines = [f"world {s['world']} {s['layout']:<52} {' '.join(f'{t:7.0f}' for t in s['ms_per_iteration'])} ms, "
             f"spread {s['spread']:.2f}" for s in spread]
    ratios = sorted(s["spread"] for s in spread)
    lines.append(f"the same layout across rounds: median spread {float(np.median(ratios)):.2f}, largest "
                 f"{ratios[-1]:.2f}, {sum(r > 1.25 for r in ratios)} of {len(ratios)} over 1.25")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="separate calibrate + sweep rounds")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes swept")
    parser.add_argument("--max-runs", type=int, default=11, help="candidates swept per world size")
    parser.add_argument("--train-iters", type=int, default=10)
    parser.add_argument("--warmup-iters", type=int, default=3)
    parser.add_argument("--max-micro-batch", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2], help="calibrated micro batches")
    parser.add_argument("--model-reps", type=int, default=4)
    parser.add_argument("--passes", type=int, default=2,
                        help="calibration passes, each followed by a sweep pass (calibrate --model-passes, sweep "
                             "--repeats)")
    parser.add_argument("--gemm-hidden", type=int, default=128)
    parser.add_argument("--memory-gb", type=float, default=8.0, help="memory per rank the plan may use")
    parser.add_argument("--max-context-parallel", type=int, default=None,
                        help="largest CP planned and calibrated (default: as plan, up to the heads per TP rank; 1: "
                             "no CP layouts)")
    parser.add_argument("--no-savers", action="store_true",
                        help="plan as the recipe does, the fastest saver of each layout (not --all-savers)")
    parser.add_argument("--output", default=None, help="folder for profiles, sweeps and reports (default: temporary)")
    parser.add_argument("--json", default=None, help="write every round's numbers here")
    parser.add_argument("--spread", nargs="+", default=None, metavar="JSON",
                        help="measure nothing: print each layout's measured spread over the rounds of these "
                             "--json files")
    parser.add_argument("model", nargs="*", help="pretrain_gpt.py model flags after -- (default: a 4-layer, "
                                                 "128-wide GPT at sequence 128, global batch 16)")
    args = parser.parse_args()
    if args.spread:
        rounds = []
        for path in args.spread:
            try:
                with open(path) as f:
                    rounds += json.load(f)["rounds"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                parser.error(f"--spread {path}: not a bench_planner --json file ({type(e).__name__}: {e})")
        print("\n".join(spread_lines(measured_spread(rounds))))
        return 0
    args.model = args.model or MODEL
    out = args.output or tempfile.mkdtemp(prefix="bench_planner_")
    os.makedirs(out, exist_ok=True)
    corpus = make_corpus(out, 1024)
    rounds = []
    for r in range(1, args.rounds + 1):
        rounds.append(one_round(r, corpus, out, args))
        for w in rounds[-1]["worlds"]:
            for priced in ("calibrated", "constants"):
                for kind, _ in KINDS:
                    print(line(w["world"], f"{priced} {kind}", w[priced][kind]))
    if len(rounds) > 1:
        print("\n".join(spread_lines(measured_spread(rounds))))
    if args.json:
        from megatron_lite.atomic import write_text

        write_text(args.json, json.dumps({"model": args.model, "rounds": rounds}, indent=1))
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
