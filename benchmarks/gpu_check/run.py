"""GPU validation in one command (scripts/gpu_check.sh runs this): install, build, check, report.

Steps, in order (steps.py has each one):
  env      what the machine is: Python, torch, CUDA, the GPU, nvcc
  install  the wheels scripts/gpu_wheels.sh put in .whl/ (DeepSpeed, ...) into .gpu_site/ (PYTHONPATH)
  build    megatron_lite._C with its CUDA kernels (setup.py build_ext --inplace)
  a        a1: the tests CPU runs skip (pytest -m cuda); a2: tests/model and tests/parallel with
           their tensors on the GPU (MEGATRON_LITE_TEST_DEVICE=cuda, tests/device.py)
  b        the fused softmax (fp16/bf16, causal/padding, s = 512..8192): fwd+bwd vs eager and
           torch.compile, whole attention vs SDPA, against the copy (HBM) floor; which backend
           `--attention-backend auto` should take
  calibrate  tune_parallelism.py calibrate: the profile `plan --profile` uses (one GPU: GEMM and copy only)
  c        a ~1.3B GPT (24 x 2048, 16 heads, seq 2048, vocabulary 50304, bf16, ZeRO 1) for 30
           iterations: tokens/s, TFLOP/s, MFU, peak memory vs our estimate; with each recompute
           mode pretrain_gpt.py offers; and the plan's predicted step of the no-recompute run, priced
           by the calibrated profile and by the constants, over the measured one
  d        a small model's bf16 loss curve against its fp32 curve, 100 steps
  moe      a ~1B Mixture-of-Experts GPT (12 layers of 8 experts, top-2), bf16, ZeRO 1, 30 iterations:
           tokens/s, TFLOP/s, MFU, peak memory vs our estimate, per-expert GEMM loop vs --moe-grouped-gemm
Every step has a time budget; a step that fails or runs out of time is recorded and the next one
runs. The report (markdown, a summary table at the top, and JSON) is rewritten after every step
into --report-dir (default: $OUT when set, else gpu_check_report/), and results accumulate there
across calls, so the steps can be spread over several shorter commands (--steps a,b --resume).

    bash scripts/gpu_check.sh                          # everything (about 20 minutes on one H100)
    bash scripts/gpu_check.sh --steps env,install,build,a --total-budget 540   # under a 10-minute limit
    bash scripts/gpu_check.sh --steps b,c --resume --total-budget 540     # adds to the first call's report
    bash scripts/gpu_check.sh --steps d --resume --total-budget 540
    bash scripts/gpu_check.sh --dry-run                # on the CPU, tiny sizes (CI runs this)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Callable, List

# The checkout, for this package and megatron_lite.training.records (stdlib only: runs' numbers come from their
# metrics.jsonl), also when this file is run by its path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.gpu_check.context import REPO, Context, Result, StepFailed, tail  # noqa: E402


def run_step(ctx: Context, key: str, title: str, budget: float, fn: Callable[[Context], tuple]) -> Result:
    ctx.deadline = time.monotonic() + budget
    ctx.log.append(f"\n===== step {key}: {title} (budget {budget:.0f}s) =====\n")
    start = time.monotonic()
    try:
        status, summary, details, numbers = fn(ctx)
    except TimeoutError as e:
        status, summary, details, numbers = "timeout", str(e), "", {}
    except StepFailed as e:
        status, summary, details, numbers = "fail", str(e), "", {}
    except Exception as e:  # noqa: BLE001 - a broken step must not stop the others
        status, summary, details, numbers = "fail", f"{type(e).__name__}: {e}", "", {}
    result = Result(key, title, status, time.monotonic() - start, budget, summary, details, numbers)
    print(f"gpu_check: {key} {status} in {result.seconds:.0f}s: {summary}", flush=True)
    return result


def write_report(results: List[Result], report_dir: str, header: str, log: List[str]) -> None:
    """gpu_check.md (summary table first), gpu_check.json (every number), gpu_check.log (commands
    and output tails). Rewritten after every step, so a killed run still leaves its report."""
    os.makedirs(report_dir, exist_ok=True)
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "timeout", "skip")}
    lines = [f"# megatron_lite GPU check\n\n{header}\n",
             f"**{counts['pass']} passed, {counts['fail']} failed, {counts['timeout']} out of time, "
             f"{counts['skip']} skipped**\n",
             "| step | what | status | seconds (budget) | result |", "|---|---|---|---|---|"]
    for r in results:
        summary = r.summary.replace("|", "/").replace("\n", " ")
        lines.append(f"| {r.step} | {r.title} | {r.status} | {r.seconds:.0f} ({r.budget:.0f}) | {summary} |")
    for r in results:
        if r.details:
            lines.append(f"\n## {r.step}: {r.title}\n\n{r.details}")
    with open(os.path.join(report_dir, "gpu_check.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(report_dir, "gpu_check.json"), "w") as f:
        json.dump({"header": header, "results": [asdict(r) for r in results]}, f, indent=1)
    with open(os.path.join(report_dir, "gpu_check.log"), "w") as f:
        f.write(tail("".join(log), 4_000_000))


def load_previous(report_dir: str) -> List[Result]:
    path = os.path.join(report_dir, "gpu_check.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [Result(**r) for r in json.load(f)["results"]]


EXTRA_WHAT = {"install": "installed wheels", "build": "CUDA build of megatron_lite._C"}


def missing_prerequisites(ctx: Context, wanted: List[str]) -> List[str]:
    """install and build, when a later step is wanted and a fresh machine lacks what they leave
    (a machine given back between calls keeps nothing)."""
    from benchmarks.gpu_check.steps import extension_has_cuda

    if ctx.dry_run or not set(wanted) & {"a", "b", "c", "d"}:
        return []
    extra = []
    if "install" not in wanted and not os.path.isdir(os.path.join(ctx.work_dir, "site")):
        extra.append("install")
    if "build" not in wanted and not extension_has_cuda(ctx):
        extra.append("build")
    if extra:
        print(f"gpu_check: this machine has no {' and no '.join(EXTRA_WHAT[e] for e in extra)} yet: running "
              f"{' and '.join(extra)} first", flush=True)
    return extra


def main(argv=None) -> int:
    from benchmarks.gpu_check.steps import STEPS, environment_header

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="on the CPU with tiny sizes, installing nothing")
    parser.add_argument("--steps", default=",".join(key for key, *_ in STEPS),
                        help="comma-separated steps to run, in the order above (default: all)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the results of earlier calls in the report (a step run again replaces its row)")
    parser.add_argument("--previous", default=None,
                        help="a folder holding an earlier call's gpu_check.json (from a machine since given back) "
                             "whose results the report keeps, as --resume does for this machine's own")
    parser.add_argument("--report-dir", default=None, help="default: $OUT when set, else gpu_check_report/")
    parser.add_argument("--work-dir", default=os.path.join(REPO, "gpu_check_work"),
                        help="data, installed wheels and step scratch; kept between calls")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every step's budget")
    parser.add_argument("--budget", action="append", default=[], metavar="STEP=SECONDS",
                        help="this step's budget instead of its default (repeatable), e.g. --budget a=150")
    parser.add_argument("--total-budget", type=float, default=None,
                        help="seconds for this whole call: a step gets at most what is left, and steps that would "
                             "start with under 30 s left are recorded as skipped (fit a per-command time limit)")
    args = parser.parse_args(argv)

    report_dir = args.report_dir or os.environ.get("OUT") or os.path.join(REPO, "gpu_check_report")
    state_dir = os.path.join(args.work_dir, "report")  # what --resume reads ($OUT is emptied per call)
    wanted = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(wanted) - {key for key, *_ in STEPS})
    if unknown:
        parser.error(f"--steps: unknown {', '.join(unknown)}; the steps are {', '.join(k for k, *_ in STEPS)}")
    budgets = {}
    for item in args.budget:
        key, _, seconds = item.partition("=")
        try:
            budgets[key] = float(seconds)
        except ValueError:
            parser.error(f"--budget {item}: expected STEP=SECONDS, e.g. --budget a=150")
        if key not in {k for k, *_ in STEPS}:
            parser.error(f"--budget {item}: unknown step {key}; the steps are {', '.join(k for k, *_ in STEPS)}")
    ctx = Context(dry_run=args.dry_run, work_dir=args.work_dir, report_dir=report_dir)
    os.makedirs(ctx.work_dir, exist_ok=True)
    wanted += missing_prerequisites(ctx, wanted)
    results = load_previous(args.previous or state_dir) if args.resume or args.previous else []
    if args.resume and os.path.exists(os.path.join(state_dir, "gpu_check.log")):
        with open(os.path.join(state_dir, "gpu_check.log")) as f:
            ctx.log.append(f.read())
    call_deadline = time.monotonic() + (args.total_budget or float("inf"))
    header = environment_header(ctx)
    for key, title, budget, dry_budget, fn in STEPS:
        if key not in wanted:
            continue
        budget = budgets.get(key, (dry_budget if args.dry_run else budget) * args.time_scale)
        budget = min(budget, call_deadline - time.monotonic())
        if budget < 30:
            result = Result(key, title, "skip", 0.0, 0.0, "not started: --total-budget spent; run it with --steps "
                            f"{key} --resume")
        else:
            result = run_step(ctx, key, title, budget, fn)
        results = [r for r in results if r.step != key] + [result]
        order = [k for k, *_ in STEPS]
        results.sort(key=lambda r: order.index(r.step))
        for folder in (state_dir, report_dir):
            write_report(results, folder, header, ctx.log)
    bad = [r.step for r in results if r.status in ("fail", "timeout")]
    print(f"gpu_check: report in {os.path.join(report_dir, 'gpu_check.md')}; "
          f"{len(results) - len(bad)} of {len(results)} steps passed or skipped" + (f"; failed: {', '.join(bad)}"
                                                                                     if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
