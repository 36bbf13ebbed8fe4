"""A sweep's results ranked by a named column: markdown, CSV, PNG plots and the best command line.

Columns are looked up by name, never by position (NeMo's AutoConfigurator once
sorted by the wrong column after one was added). Runs that did not complete are
listed after the ranked ones with their status.

Measured pipeline efficiency of a PP > 1 run = its tokens/s over that of the
completed PP = 1 run with the same TP, CP, EP and micro batch (one plan has one world
size, so this is the throughput per GPU lost to the pipeline); runs without
such a baseline have none.

Prediction check (`prediction_accuracy`): where the plan predicted step times, the
Spearman rank correlation of predicted and measured tokens/s, how far the layout
predicted fastest is from the measured fastest, and each run's predicted / measured
step time (report.md lists them with the median and worst error).

Plots (matplotlib, Agg backend): throughput per layout; predicted against
measured step time; predicted against measured peak memory (rank 0, i.e. stage 0, unless training logged per-stage
lines); predicted against measured pipeline efficiency.
"""
from __future__ import annotations

import argparse
import csv
import os
import shlex
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence

from megatron_lite.atomic import atomic_file, write_text
from megatron_lite.targets import OVERWRITE_HELP, target_problem
from megatron_lite.tuning.sweep import RESULTS_FILE, collect

REPORT_FILES = ("report.md", "report.csv")
"""What marks a folder as holding a report (its PNGs are written with them): replaced only with --overwrite."""

COLUMNS = ("rank_by_metric", "layout", "status", "tokens_per_s", "samples_per_s", "tflops_per_rank", "mfu",
           "ms_per_iteration", "predicted_ms_per_iteration", "predicted_over_measured", "predicted_from",
           "gradient_accumulation_steps", "saver", "predicted_relative_throughput",
           "predicted_pipeline_efficiency", "measured_pipeline_efficiency", "predicted_peak_gib_stage0",
           "predicted_peak_gib_max", "peak_memory_gib", "name")


def _measured_efficiency(rows: List[Dict[str, Any]]) -> None:
    def key(r):
        return (r["tensor_model_parallel_size"], r.get("context_parallel_size") or 1,
                r.get("expert_model_parallel_size") or 1, r["micro_batch_size"])

    base = {key(r): r for r in rows
            if r["status"] == "completed" and r["pipeline_model_parallel_size"] == 1 and r.get("tokens_per_s")}
    for r in rows:
        b = base.get(key(r))
        r["measured_pipeline_efficiency"] = None
        if r["status"] != "completed" or not r.get("tokens_per_s") or b is None:
            continue
        r["measured_pipeline_efficiency"] = (1.0 if r["pipeline_model_parallel_size"] == 1
                                             else r["tokens_per_s"] / b["tokens_per_s"])


def rank_rows(rows: List[Dict[str, Any]], sort_by: str) -> List[Dict[str, Any]]:
    if rows and all(sort_by not in r for r in rows):
        known = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float))})
        raise ValueError(f"--sort-by {sort_by}: no such column; numeric columns: {', '.join(known)}")
    for r in rows:
        peaks = r.get("predicted_peak_gib_per_stage") or []
        r["predicted_peak_gib_stage0"] = peaks[0] if peaks else None
        r["predicted_peak_gib_max"] = max(peaks) if peaks else None
    _measured_efficiency(rows)
    lower_is_better = sort_by in ("ms_per_iteration", "seconds", "peak_memory_gib")
    done = [r for r in rows if r["status"] == "completed" and isinstance(r.get(sort_by), (int, float))]
    done.sort(key=lambda r: r[sort_by], reverse=not lower_is_better)
    rest = [r for r in rows if r not in done]
    for i, r in enumerate(done, 1):
        r["rank_by_metric"] = i
    for r in rest:
        r["rank_by_metric"] = None
    return done + rest


def _ranks(values: Sequence[float]) -> List[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties get their mean rank)."""
    rx, ry = _ranks(x), _ranks(y)
    n = len(rx)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


def prediction_accuracy(rows: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """How the plan's predictions held for the completed runs that have one (None for fewer than 2): Spearman of
    predicted and measured tokens/s, the measured tokens/s of the layout predicted fastest over the measured
    best, and predicted / measured step time per run (also written into each row) with its median and worst
    |error|."""
    done = [r for r in rows if r["status"] == "completed" and r.get("tokens_per_s") and r.get("ms_per_iteration")
            and r.get("predicted_step_seconds")]
    for r in rows:
        r["predicted_ms_per_iteration"] = 1e3 * r["predicted_step_seconds"] if r.get("predicted_step_seconds") else None
        r["predicted_over_measured"] = (r["predicted_ms_per_iteration"] / r["ms_per_iteration"]
                                        if r in done else None)
    if len(done) < 2:
        return None
    predicted = [r["predicted_tokens_per_s"] for r in done]
    measured = [r["tokens_per_s"] for r in done]
    top = max(done, key=lambda r: r["predicted_tokens_per_s"])
    errors = sorted(abs(r["predicted_over_measured"] - 1) for r in done)
    median = statistics.median(errors)
    return {"runs": len(done), "spearman": spearman(predicted, measured),
            "predicted_best": top["layout"], "predicted_best_name": top.get("name"),
            "predicted_best_over_measured_best": top["tokens_per_s"] / max(measured),
            "median_step_error": median, "worst_step_error": errors[-1],
            "median_predicted_over_measured": statistics.median(r["predicted_over_measured"] for r in done),
            "predicted_from": sorted({r.get("predicted_from") or "" for r in done})}


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def best_command(row: Dict[str, Any]) -> str:
    """The fastest layout as a pretrain_gpt.py command (its launcher from the sweep; set your own
    --train-iters, --save and the evaluation flags)."""
    launcher = row.get("launcher_args") or ["torchrun", "--nproc_per_node", "<gpus per node>"]
    launcher = [("<port>" if prev == "--master_port" else tok) for prev, tok in zip([""] + launcher[:-1], launcher)]
    script = "pretrain_gpt.py"
    return shlex.join(launcher + [script] + list(row.get("pretrain_args") or row.get("argv") or []))


def _plots(rows: List[Dict[str, Any]], ranked: List[Dict[str, Any]], sort_by: str, out_dir: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {k: os.path.join(out_dir, f"{k}.png") for k in ("throughput", "speed", "memory", "efficiency")}
    series: Dict[str, List[str]] = {}

    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(ranked) + 2), 4))
    ax.bar([r["layout"] for r in ranked], [r[sort_by] for r in ranked], color="tab:blue")
    ax.set_ylabel(sort_by)
    ax.set_title(f"{sort_by} per layout (completed runs)")
    ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    with atomic_file(paths["throughput"]) as f:
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)
    series[paths["throughput"]] = [r["layout"] for r in ranked]

    fig, ax = plt.subplots(figsize=(5, 5))
    timed = [r for r in rows if r.get("predicted_over_measured")]
    for r in timed:
        ax.scatter(r["predicted_ms_per_iteration"], r["ms_per_iteration"], label=r.get("name") or r["layout"])
    if timed:
        lo = min(min(r["predicted_ms_per_iteration"], r["ms_per_iteration"]) for r in timed) / 1.3
        hi = max(max(r["predicted_ms_per_iteration"], r["ms_per_iteration"]) for r in timed) * 1.3
        ax.plot([lo, hi], [lo, hi], "k--", linewidth=0.8)
        ax.fill_between([lo, hi], [lo / 1.25, hi / 1.25], [lo * 1.25, hi * 1.25], color="0.9", label="within 25%")
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("predicted step (ms)")
    ax.set_ylabel("measured step (ms)")
    ax.set_title("step time: predicted vs measured")
    series[paths["speed"]] = _finish(plt, fig, ax, paths["speed"], timed)

    fig, ax = plt.subplots(figsize=(5, 5))
    mem = [r for r in rows if r.get("peak_memory_gib") and r.get("predicted_peak_gib_stage0")]
    for r in mem:
        ax.scatter(r["predicted_peak_gib_stage0"], r["peak_memory_gib"], label=r["layout"])
    top = max([1e-3] + [max(r["predicted_peak_gib_stage0"], r["peak_memory_gib"]) for r in mem]) * 1.1
    ax.plot([0, top], [0, top], "k--", linewidth=0.8)
    ax.set_xlabel("predicted peak, stage 0 (GiB)")
    ax.set_ylabel(f"measured peak, rank 0 (GiB; {mem[0].get('peak_memory_kind') if mem else 'none'})")
    ax.set_title("memory: predicted vs measured")
    series[paths["memory"]] = _finish(plt, fig, ax, paths["memory"], mem)

    fig, ax = plt.subplots(figsize=(5, 5))
    eff = [r for r in rows if r.get("measured_pipeline_efficiency") is not None]
    for r in eff:
        ax.scatter(r["predicted_pipeline_efficiency"], r["measured_pipeline_efficiency"], label=r["layout"])
    ax.plot([0, 1.2], [0, 1.2], "k--", linewidth=0.8)
    ax.set_xlabel("predicted pipeline efficiency (bubble x balance)")
    ax.set_ylabel("measured (tokens/s vs the PP = 1 run)")
    ax.set_title("pipeline efficiency: predicted vs measured")
    series[paths["efficiency"]] = _finish(plt, fig, ax, paths["efficiency"], eff)
    return paths, series


def write_report(results_dir: str, sort_by: str = "tokens_per_s", out_dir: Optional[str] = None) -> Dict[str, Any]:
    rows = rank_rows(collect(results_dir), sort_by)
    accuracy = prediction_accuracy(rows)
    out_dir = out_dir or results_dir
    os.makedirs(out_dir, exist_ok=True)
    ranked = [r for r in rows if r["rank_by_metric"] is not None]
    md_path, csv_path = (os.path.join(out_dir, name) for name in REPORT_FILES)
    with atomic_file(csv_path, "w", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS), extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in COLUMNS})
    command = best_command(ranked[0]) if ranked else ""
    lines = [f"# Sweep report: {len(ranked)} completed of {len(rows)} runs, ranked by {sort_by}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k in COLUMNS) + " |" for r in rows]
    repeated = sorted({len(r["repeats"]) for r in rows if len(r.get("repeats") or []) > 1})
    if repeated:
        lines += ["", f"Each measured number is its layout's fastest of {'/'.join(map(str, repeated))} runs "
                      f"(sweep --repeats)."]
    if accuracy:
        lines += ["", f"Predictions ({', '.join(accuracy['predicted_from'])}) against the {accuracy['runs']} completed "
                      f"runs: Spearman rank correlation of tokens/s {accuracy['spearman']:.3f}; the layout predicted "
                      f"fastest ({accuracy['predicted_best_name']}) measured "
                      f"{accuracy['predicted_best_over_measured_best']:.3f} of the measured best; step time predicted / "
                      f"measured: median {accuracy['median_predicted_over_measured']:.3g}, median error "
                      f"{accuracy['median_step_error']:.1%}, worst {accuracy['worst_step_error']:.1%} (column "
                      f"predicted_over_measured)."]
    if command:
        lines += ["", "Best layout:", "", "```", command, "```"]
    paths, series = _plots(rows, ranked, sort_by, out_dir)
    lines += ["", *(f"![{k}]({os.path.basename(p)})" for k, p in paths.items())]
    write_text(md_path, "\n".join(lines) + "\n")
    return {"rows": rows, "markdown": md_path, "csv": csv_path, "best_command": command,
            "plots": series, "plot_paths": paths, "accuracy": accuracy}


def swept(results_dir: str) -> bool:
    """Whether a sweep wrote into `results_dir`: its results.jsonl, or a run folder's status (a sweep stopped
    during its first run has only that)."""
    if os.path.isfile(os.path.join(results_dir, RESULTS_FILE)):
        return True
    return any(os.path.isfile(os.path.join(results_dir, name, "status")) for name in os.listdir(results_dir))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tune_parallelism.py report", allow_abbrev=False,
                                     description="Rank a sweep's runs; write report.md, report.csv and PNG plots.")
    parser.add_argument("--results", required=True, help="the sweep's results folder")
    parser.add_argument("--sort-by", default="tokens_per_s",
                        help="column to rank by (default tokens_per_s; ms_per_iteration ranks ascending)")
    parser.add_argument("--output", default=None, help="folder for the report (default: --results)")
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP + " (an earlier report's files)")
    return parser


def main(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    out_dir = args.output or args.results
    why = target_problem("--output" if args.output else "--results", out_dir,
                         [os.path.join(out_dir, name) for name in REPORT_FILES], args.overwrite)
    if why:
        parser.error(why)
    if not os.path.isdir(args.results):
        parser.error(f"--results {args.results}: no such folder; run `tune_parallelism.py sweep` first")
    if not swept(args.results):
        parser.error(f"--results {args.results} holds no sweep (no results.jsonl, no run folder with a status); give "
                     f"the folder `tune_parallelism.py sweep --results` wrote")
    start = time.time()
    try:
        out = write_report(args.results, args.sort_by, args.output)
    except ValueError as e:
        parser.error(str(e))
    with open(out["markdown"]) as f:
        print(f.read())
    ranked = [r for r in out["rows"] if r["rank_by_metric"] is not None]
    best = f"best {ranked[0]['layout']} at {ranked[0][args.sort_by]:.4g} {args.sort_by}" if ranked else "no completed run"
    print(f"report: {len(ranked)}/{len(out['rows'])} completed, {best}; wrote {out['markdown']}, {out['csv']}, "
          f"{len(out['plot_paths'])} PNGs in {time.time() - start:.1f}s")
    return 0


def _finish(plt, fig, ax, path: str, rows: List[dict]) -> List[str]:
    """Legend (when there is a point), save, close; the layouts plotted, for the test to check."""
    if rows:
        ax.legend(fontsize=6)
    fig.tight_layout()
    with atomic_file(path) as f:
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)
    return [r["layout"] for r in rows]
