"""The steps of the GPU check (run.py runs them). Each takes the Context and returns (status, summary, details,
numbers), or raises StepFailed / TimeoutError; each runs its work as subprocesses within the
step's budget (Context.run). --dry-run sizes are tiny and run on the CPU."""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
from statistics import mean
from typing import Dict, List, Tuple

from benchmarks.gpu_check.context import REPO, Context, OutOfTime, StepFailed, last_line
from megatron_lite.cpp_runtime import MARKER

TEST_DEVICE_VARIABLE = "MEGATRON_LITE_TEST_DEVICE"  # tests/device.py
FAILURE_LOG_VARIABLE = "MEGATRON_LITE_FAILURE_LOG"  # immediate_failures.py


def use_installed_wheels(ctx: Context) -> None:
    """Put the wheels installed by an earlier install step (this call or an earlier one) on the path."""
    site = os.path.join(ctx.work_dir, "site")
    if os.path.isdir(site):
        paths = [site, REPO] + [p for p in ctx.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        ctx.env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))


def environment_header(ctx: Context) -> str:
    use_installed_wheels(ctx)
    probe = ("import platform, torch; c = torch.cuda.is_available(); "
             "print(f'Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
             "' + (f'{torch.cuda.get_device_name()}, "
             "{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB' if c else 'no CUDA device'))")
    ctx.deadline = float("inf")
    done = ctx.run([ctx.python, "-c", probe], budget=120)
    mode = "dry run on the CPU (tiny sizes)" if ctx.dry_run else "full run"
    return f"{mode}; {last_line(done.output)}"


def env(ctx: Context):
    lines = []
    for cmd in (["nvidia-smi", "-L"], ["nvcc", "--version"]):
        try:
            lines.append(last_line(ctx.run(cmd, budget=30).output))
        except FileNotFoundError:
            lines.append(f"{cmd[0]}: not found")
    probe = ctx.run([ctx.python, "-c", "import torch; print(torch.cuda.is_available())"], budget=60, check=True)
    has_cuda = last_line(probe.output) == "True"
    if not ctx.dry_run and not has_cuda:
        raise StepFailed("torch sees no CUDA device; " + "; ".join(lines))
    return "pass", "; ".join(lines), "", {"cuda": has_cuda}


def install(ctx: Context):
    if ctx.dry_run:
        return "skip", "dry run: uses the DeepSpeed installed here", "", {}
    wheels = sorted(glob.glob(os.path.join(REPO, ".whl", "*.whl")))
    if not wheels:
        raise StepFailed("no wheels in .whl/: run `bash scripts/gpu_wheels.sh` where PyPI is reachable and carry .whl")
    site = os.path.join(ctx.work_dir, "site")
    ctx.run([ctx.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
             "--upgrade", "--target", site, *wheels], check=True)
    use_installed_wheels(ctx)
    probe = ("import importlib.metadata as m; import deepspeed, pydantic, zstandard, typing_extensions; "
             "print(', '.join(f'{n} {m.version(n)}' for n in ('deepspeed', 'pydantic', 'zstandard', "
             "'typing_extensions')))")
    versions = last_line(ctx.run([ctx.python, "-c", probe], check=True).output)
    return "pass", f"{len(wheels)} wheels into {os.path.relpath(site, REPO)}: {versions}", "", {}


EXTENSION_PROBE = "import torch; from megatron_lite import _C; print(_C.with_cuda)"


def extension_has_cuda(ctx: Context) -> bool:
    ctx.deadline = float("inf")
    done = ctx.run([ctx.python, "-c", EXTENSION_PROBE], budget=120)
    return done.returncode == 0 and last_line(done.output) == "True"


def build(ctx: Context):
    probe = [ctx.python, "-c", EXTENSION_PROBE]
    if ctx.dry_run:
        with_cuda = last_line(ctx.run(probe, check=True).output)
        return "pass", f"dry run: the CPU build from scripts/test.sh imports (CUDA kernels: {with_cuda})", "", {}
    # setup.py builds the CUDA sources when torch has CUDA and nvcc is found; for the visible GPU's
    # architecture unless TORCH_CUDA_ARCH_LIST says otherwise.
    command, env = [ctx.python, "setup.py", "build_ext", "--inplace"], {"MAX_JOBS": str(os.cpu_count() or 4)}
    done = ctx.run(command, env=env)
    compiler_note = ""
    if done.returncode != 0 and MARKER in done.output and os.path.exists("/usr/bin/g++"):
        # The H100 image's CXX (a wrapper) linked libstdc++ statically, which setup.py refuses
        # (megatron_lite/cpp_runtime.py); the system compiler links the shared one.
        compiler_note = f" (CXX={os.environ.get('CXX')} linked libstdc++ statically: built with /usr/bin/g++)"
        done = ctx.run(command, env={**env, "CXX": "/usr/bin/g++", "CC": "/usr/bin/gcc"})
    if done.returncode != 0:
        raise StepFailed(f"`{' '.join(command[:4])} ...` exited {done.returncode}: {last_line(done.output)}")
    if last_line(ctx.run(probe, check=True).output) != "True":
        raise StepFailed("megatron_lite._C was built without CUDA kernels (is nvcc on PATH? CUDA_HOME?)")
    return ("pass", f"megatron_lite._C with CUDA kernels in {done.seconds:.0f}s{compiler_note}", "",
            {"build_seconds": done.seconds})


def pytest_counts(output: str) -> Dict[str, int]:
    """The counts of pytest's closing line; of a run killed before it, the PASSED/FAILED/... lines
    that -v printed so far."""
    summary = next((line for line in reversed(output.splitlines())
                    if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)", line) and " in " in line), "")
    if summary:
        return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
    words = re.findall(r"\b(PASSED|FAILED|SKIPPED|ERROR)\b", output)
    return {w.lower(): words.count(w) for w in set(words)}


def failed_tests(output: str) -> List[str]:
    lines = [line[:200] for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    if lines:
        return lines
    # "tests/x.py::t FAILED" without pytest-xdist, "[gw3] [ 4%] FAILED tests/x.py::t" with it.
    found = re.finditer(r"(tests/\S+::\S+) (?:FAILED|ERROR)|(?:FAILED|ERROR) (tests/\S+::\S+)", output)
    return sorted({(m.group(1) or m.group(2))[:200] for m in found})


def run_pytest(ctx: Context, args: List[str], env: Dict[str, str] = None, budget: float = None):
    """(counts, failed test lines, passed cleanly, note). Running out of time is a note with the
    counts so far (-v names every test as it ends), not the end of the step."""
    command = [ctx.python, "-m", "pytest", "-v", "--tb=short", "-rfE", "-p", "no:cacheprovider",
               "-p", "benchmarks.gpu_check.immediate_failures", *args]
    os.makedirs(ctx.report_dir, exist_ok=True)
    env = {**(env or {}), FAILURE_LOG_VARIABLE: os.path.join(ctx.report_dir, "gpu_check_failures.log")}
    try:
        done = ctx.run(command, env=env, budget=budget)
    except OutOfTime as e:
        keep_output(ctx, command, e.output)
        counts = pytest_counts(e.output)
        return counts, failed_tests(e.output), False, f"{e}; so far {counts}"
    keep_output(ctx, command, done.output)
    return pytest_counts(done.output), failed_tests(done.output), done.returncode == 0, ""


def keep_output(ctx: Context, command: List[str], output: str) -> None:
    """The whole pytest output into gpu_check_tests.log in the report folder (the step log keeps a
    tail; the first GPU run lost its failures' tracebacks that way)."""
    if not ctx.report_dir:
        return
    os.makedirs(ctx.report_dir, exist_ok=True)
    with open(os.path.join(ctx.report_dir, "gpu_check_tests.log"), "a") as f:
        f.write(f"$ {' '.join(command)}\n{output}\n")


def parallel_workers(ctx: Context) -> List[str]:
    """pytest-xdist's -n 4 where it is installed (the GPU image has it) and not in a dry run: the
    model and parallel tests spawn their own gloo worlds, which share the GPU."""
    if ctx.dry_run:
        return []
    probe = ctx.run([ctx.python, "-c", "import xdist"], budget=60)
    if probe.returncode != 0:
        return []
    workers = ["-n", os.environ.get("MEGATRON_LITE_GPU_CHECK_WORKERS", "4")]
    # One test that hangs (a collective one rank never joins) must not eat the step's whole budget.
    timeout = ctx.run([ctx.python, "-c", "import pytest_timeout"], budget=60)
    return workers + (["--timeout", "180"] if timeout.returncode == 0 else [])


def tests(ctx: Context):
    # The modules that mark tests `cuda` (collecting the whole tree for -m cuda costs a minute).
    marked = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "tests", "**", "test_*.py"),
                                                                 recursive=True)
                    if "mark.cuda" in open(p).read())
    c1, f1, ok1, note1 = run_pytest(ctx, ["-m", "cuda", *marked], budget=ctx.remaining() * 0.3)
    device = "cpu" if ctx.dry_run else "cuda"
    # A dry run checks the plumbing (the device variable, the counts read from pytest's output): one quick
    # module is enough; test_mappings.py cost the suite half a minute here.
    targets = ["tests/model/test_reference_gpt.py"] if ctx.dry_run else ["tests/model", "tests/parallel"]
    c2, f2, ok2, note2 = run_pytest(ctx, [*parallel_workers(ctx), "-m", "not slow and not cuda", *targets],
                                    env={TEST_DEVICE_VARIABLE: device})
    details = (f"a1 `pytest -m cuda {' '.join(marked)}`: {c1 or note1}\n\n"
               f"a2 `{TEST_DEVICE_VARIABLE}={device} pytest -m 'not slow and not cuda' {' '.join(targets)}`: "
               f"{c2 or note2}\n")
    if f1 + f2:
        details += "\nFailed:\n\n" + "\n".join(f"- `{f}`" for f in f1 + f2) + "\n"
    ok = ok1 and ok2 and (ctx.dry_run or c1.get("passed", 0) > 0)

    def counts(c, note):
        failed = c.get("failed", 0) + c.get("error", 0) + c.get("errors", 0)
        return note or f"{c.get('passed', 0)} passed, {failed} failed, {c.get('skipped', 0)} skipped"

    summary = f"a1 (CUDA-only tests): {counts(c1, note1)}; a2 (model/parallel tests on {device}): {counts(c2, note2)}"
    return ("pass" if ok else "fail"), summary, details, {"a1": c1, "a2": c2, "failed": f1 + f2}


def softmax(ctx: Context):
    out = os.path.join(ctx.work_dir, "softmax.json")
    if ctx.dry_run:
        sizes = ["--device", "cpu", "--dtype", "bf16", "--seq", "64", "128", "--batch", "1", "--heads", "2",
                 "--repeats", "1"]
    else:
        sizes = ["--device", "cuda", "--dtype", "fp16", "bf16", "--seq", "512", "1024", "2048", "4096", "8192",
                 "--batch", "1", "--heads", "16", "--repeats", "5"]
    if os.path.exists(out):
        os.remove(out)
    timed_out = ""
    try:
        output = ctx.run([ctx.python, "benchmarks/bench_fused_softmax.py", *sizes, "--mask", "causal", "padding",
                          "--compile", "--attention", "--json", out]).output
    except OutOfTime as e:  # the rows measured so far are in the JSON (written after every row)
        timed_out, output = str(e), e.output
    rows = []
    if os.path.exists(out):
        with open(out) as f:
            rows = json.load(f)
    table = softmax_table(rows)
    good = [r for r in rows if "error" not in r]
    if not good:
        first = rows[0].get("error") if rows else last_line(output)
        raise StepFailed(timed_out or f"every configuration failed: {first}")
    auto_now = json.loads(last_line(ctx.run([ctx.python, "-c", (
        "import json; from megatron_lite.model.attention import AUTO_ATTENTION_BACKEND as A; print(json.dumps(A))")],
        check=True).output))["cpu" if ctx.dry_run else "cuda"]
    # GPT training is causal: the backend that wins whole attention in most causal rows is what auto should take.
    causal = [r for r in good if r["mask"] == "causal"]
    wins = {b: sum(r["attention_winner"] == b for r in causal) for b in ("fused", "sdpa")}
    measured = max(wins, key=wins.get)
    winners = ", ".join(f"{r['dtype']} s={r['seq']}: {r['attention_winner']}" for r in causal)
    speedup = [r["eager_fwd_bwd"] / r["kernel_fwd_bwd"] for r in good]
    floor = [r["kernel_fwd"] / r["copy"] for r in good]
    compiled = [r["compiled_fwd_bwd"] / r["kernel_fwd_bwd"] for r in good]
    summary = (f"fused fwd+bwd {min(speedup):.2f}-{max(speedup):.2f}x eager, {min(compiled):.2f}-{max(compiled):.2f}x "
               f"torch.compile; fwd {min(floor):.2f}-{max(floor):.2f}x the copy floor; whole causal attention: "
               f"{measured} wins {wins[measured]}/{len(causal)}; auto picks {auto_now}")
    failed = len(rows) - len(good)
    # The dry run's sizes say nothing about the CPU rule (measured in whole training steps).
    agree = ctx.dry_run or auto_now == measured
    if not agree:
        summary += f" -> set AUTO_ATTENTION_BACKEND['cuda'] = {measured!r}"
    if failed:
        summary += f"; {failed} configurations failed (see the table)"
    if timed_out:
        summary += f"; {timed_out} after {len(rows)} configurations"
        return "timeout", summary, details_for(table, winners, auto_now, measured), {"rows": rows}
    return (("pass" if agree and not failed else "fail"), summary, details_for(table, winners, auto_now, measured),
            {"rows": rows, "auto": auto_now, "measured_winner": measured})


def softmax_table(rows: List[dict]) -> str:
    """Milliseconds per row of benchmarks/bench_fused_softmax.py's JSON, and the ratios that matter."""
    lines = ["| s | dtype | mask | copy (floor) ms | copy GB/s | fused fwd ms | fwd / floor | fused fwd+bwd ms "
             "| eager fwd+bwd ms | torch.compile fwd+bwd ms | attention: fused ms | attention: SDPA ms | winner |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['seq']} | {r['dtype']} | {r['mask']} | failed: {r['error'][:120]} |")
            continue
        lines.append(f"| {r['seq']} | {r['dtype']} | {r['mask']} | {r['copy']:.3f} | {r['copy_gb_per_s']:.0f} "
                     f"| {r['kernel_fwd']:.3f} | {r['kernel_fwd'] / r['copy']:.2f}x | {r['kernel_fwd_bwd']:.3f} "
                     f"| {r['eager_fwd_bwd']:.3f} | {r['compiled_fwd_bwd']:.3f} | {r['attention_fused_fwd_bwd']:.3f} "
                     f"| {r['attention_sdpa_fwd_bwd']:.3f} | {r['attention_winner']} |")
    return "\n".join(lines)


def details_for(table: str, winners: str, auto_now: str, measured: str) -> str:
    return (f"{table}\n\nWhole causal attention, faster backend per row: {winners}.\n"
            f"`--attention-backend auto` takes `{auto_now}` here "
            f"(megatron_lite/model/attention.py AUTO_ATTENTION_BACKEND); measured: `{measured}`.\n")


def training_numbers(records: List[dict]) -> Dict[str, list]:
    """A run's metrics.jsonl records (megatron_lite.training.records) -> the numbers the steps report:
    each log interval's, and each stage's estimated and measured peak memory."""
    iterations = []
    for r in records:
        if r["kind"] != "interval":
            continue
        numbers = {"iteration": r["iteration"], "loss": r.get("loss"), "ms_per_iteration": r.get("ms_per_iteration"),
                   "tokens_per_s": r.get("tokens_per_s"), "tflops": r.get("tflops_per_rank"),
                   "mem_peak_gib": r.get("mem_peak_gib", r.get("mem_peak_rss_gib"))}
        if r.get("mfu") is not None:
            numbers["mfu_percent"] = 100 * r["mfu"]
        iterations.append({k: v for k, v in numbers.items() if v is not None})
    from megatron_lite.training.records import stage_memory_gib

    memory = [{"stage": stage, **gib} for stage, gib in (stage_memory_gib(records) or {}).items()]
    return {"iterations": iterations, "memory": memory}


def train(ctx: Context, name: str, argv: List[str], budget: float) -> Dict[str, list]:
    """pretrain_gpt.py with argv; its numbers come from the metrics.jsonl it writes next to its
    TensorBoard events (a fresh folder per run `name`)."""
    from megatron_lite.training.records import FILE_NAME, read_records

    records = os.path.join(ctx.work_dir, "runs", name)
    shutil.rmtree(records, ignore_errors=True)
    done = ctx.run([ctx.python, "pretrain_gpt.py", *argv, "--tensorboard-dir", records], budget=budget)
    parsed = training_numbers(read_records(os.path.join(records, FILE_NAME)))
    if done.returncode != 0 or not parsed["iterations"]:
        raise StepFailed(f"pretrain_gpt.py exited {done.returncode}: {last_line(done.output)}")
    return parsed


# (name, flags) of each recompute mode, with Megatron-LM's flags. Full recompute with the uniform
# method and 1 layer per chunk recomputes every layer from its own input: the least memory.
RECOMPUTE_MODES = [
    ("none", []),
    ("selective", ["--recompute-granularity", "selective"]),
    ("full", ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
]


def gpu_count(ctx: Context) -> int:
    probe = ctx.run([ctx.python, "-c", "import torch; print(torch.cuda.device_count())"], budget=60, check=True)
    return int(last_line(probe.output))


def calibrate(ctx: Context):
    """tune_parallelism.py calibrate on this machine: the profile `plan --profile` prices layouts with
    (issue 31). One GPU measures compute and memory only (NCCL takes one rank per GPU)."""
    profile = os.path.join(ctx.work_dir, "profile.json")
    if ctx.dry_run:
        sizes = ["--device", "cpu", "--world-size", "2", "--gemm-tokens", "64", "256", "--gemm-hidden", "128",
                 "--copy-megabytes", "16", "--message-bytes", "4096", "65536", "--iters", "3", "--min-seconds", "0.1"]
    else:
        gpus = gpu_count(ctx)
        world = 1 << (gpus.bit_length() - 1) if gpus >= 2 else 1
        sizes = ["--device", "cuda", "--world-size", str(world), "--gemm-tokens", "512", "2048", "8192",
                 "--gemm-hidden", "2048", "--copy-megabytes", "1024", "--min-seconds", "0.5"]
    if os.path.exists(profile):
        os.remove(profile)
    ctx.run([ctx.python, "tools/tune_parallelism.py", "calibrate", *sizes, "--output", profile], check=True)
    with open(profile) as f:
        measured = json.load(f)
    gemm = ", ".join(f"m={g['tokens']} {g['flops_per_s'] / 1e12:.1f}" for g in measured["gemm"])
    groups = sorted({int(g) for fits in measured["collectives"].values() for g in fits})
    collectives = (f"collectives at {', '.join(map(str, groups))} ranks ({measured['backend']})" if groups
                   else "no collectives (one GPU)")
    k, n = measured["gemm"][0]["k"], measured["gemm"][0]["n"]
    summary = (f"{measured['dtype']} GEMM TFLOP/s (k={k}, n={n}): {gemm}; copy {measured['memory_gbps']:.0f} GB/s; "
               f"{collectives}; profile in the JSON report (numbers)")
    details = "```\n" + json.dumps(measured, indent=1)[:6000] + "\n```\n"
    return "pass", summary, details, measured


def predicted_step(ctx: Context, model_argv: List[str], micro: int, profile: str = None) -> float:
    """The plan's predicted step seconds for this machine (one GPU) at `micro` and no recompute, priced
    by the calibrated profile, else by the constants (--peak-tflops of the GPU)."""
    out = os.path.join(ctx.work_dir, f"plan-{'calibrated' if profile else 'constants'}.json")
    flags = ["--profile", profile] if profile else ["--peak-tflops", "989"]
    memory = "8" if ctx.dry_run else "80"
    ctx.run([ctx.python, "tools/tune_parallelism.py", "plan", "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb",
             memory, "--max-micro-batch", str(micro), "--order", "throughput",
             "--device", "cpu" if ctx.dry_run else "cuda", *flags, "--output", out, "--overwrite", *model_argv],
            budget=120,
            check=True)
    with open(out) as f:
        candidates = json.load(f)["candidates"]
    for c in candidates:
        if c["micro_batch_size"] == micro and not c["recompute_granularity"]:
            return c["predicted_step_seconds"]
    raise StepFailed(f"the plan has no micro batch {micro} candidate without recompute")


def random_data(ctx: Context) -> Tuple[int, str]:
    """(vocabulary, dataset prefix) of random ids made by tools/synthetic_data.py, tokenized by our tools: the
    data of the training steps (c, moe)."""
    vocab = 512 if ctx.dry_run else 50304
    made = ctx.run([ctx.python, "tools/synthetic_data.py", "--output-dir", os.path.join(ctx.work_dir, f"random-{vocab}"),
                    "--vocab-size", str(vocab), "--num-tokens", str(200_000 if ctx.dry_run else 2_000_000)], check=True)
    return vocab, last_line(made.output)  # the tool prints the dataset prefix


def training_flags(ctx: Context, vocab: int, data: str, iters: int, log_interval: int, warmup: int) -> List[str]:
    """pretrain_gpt.py's flags the training steps share besides the model's and the micro batch: the random data,
    global batch 16, bf16, ZeRO 1, no evaluation."""
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab), "--data-path", data,
            "--split", "100,0,0", "--data-cache-path", os.path.join(ctx.work_dir, "index-cache"),
            "--global-batch-size", "16", "--bf16", "--zero-stage", "1", "--train-iters", str(iters),
            "--log-interval", str(log_interval), "--eval-iters", "0", "--eval-interval", "1000000",
            "--lr", "1e-4", "--lr-warmup-iters", str(warmup), "--num-workers", "2"]


def run_numbers(parsed: Dict[str, list]) -> Dict[str, float]:
    """A run's reported numbers: its last log interval's (past the first steps' warm-up) and its first stage's
    measured and estimated peak memory (memory_*)."""
    memory = parsed["memory"][0] if parsed["memory"] else {}
    return {**parsed["iterations"][-1], **{f"memory_{k}": v for k, v in memory.items()}}


def run_cells(n: Dict[str, float]) -> str:
    """A run's table cells: tokens/s, TFLOP/s, MFU %, peak and estimated GiB."""
    nan = float("nan")
    return (f"{n.get('tokens_per_s', 0):.0f} | {n.get('tflops', 0):.1f} | {n.get('mfu_percent', nan):.1f} | "
            f"{n.get('memory_measured_gib', nan):.2f} | {n.get('memory_estimated_gib', nan):.2f} |")


def runs_summary(numbers: Dict[str, Dict[str, float]]) -> str:
    return "; ".join(f"{name}: {n.get('tokens_per_s', 0):.0f} tokens/s, {n.get('tflops', 0):.1f} TFLOP/s, MFU "
                     + (f"{n['mfu_percent']:.1f}%" if "mfu_percent" in n else "n/a")
                     + f", peak {n.get('memory_measured_gib', 0):.2f} GiB (estimate "
                     f"{n.get('memory_estimated_gib', 0):.2f})" for name, n in numbers.items())


def gpt_1_3b(ctx: Context):
    vocab, data = random_data(ctx)
    if ctx.dry_run:
        model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64"]
        micro, iters, log_interval, warmup = 2, 4, 2, 1
    else:
        model = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048"]
        micro, iters, log_interval, warmup = 2, 30, 10, 5
    common = model + training_flags(ctx, vocab, data, iters, log_interval, warmup)
    # A dry run trains without and with full recompute (the mode the report's numbers need both of).
    modes = [m for m in RECOMPUTE_MODES if m[0] != "selective"] if ctx.dry_run else RECOMPUTE_MODES
    rows, numbers, failures = [], {}, []
    for i, (name, flags) in enumerate(modes):
        budget = ctx.remaining() / (len(modes) - i)
        try:
            try:
                parsed = train(ctx, f"c-{name}", common + flags + ["--micro-batch-size", str(micro)], budget)
                used_micro = micro
            except StepFailed as e:
                if "out of memory" not in str(e).lower():
                    raise
                parsed = train(ctx, f"c-{name}", common + flags + ["--micro-batch-size", "1"],
                               ctx.remaining() / (len(modes) - i))
                used_micro = 1
        except StepFailed as e:
            failures.append(f"{name}: {e}")
            rows.append(f"| {name} | failed: {str(e)[:150]} | | | | | |")
            continue
        numbers[name] = {"micro_batch_size": used_micro, **run_numbers(parsed)}
        rows.append(f"| {name} | {used_micro} | {run_cells(numbers[name])}")
    details = ("| recompute | micro batch | tokens/s | TFLOP/s | MFU % | peak GiB (torch.cuda.max_memory_allocated, "
               "on CPU peak RSS) | estimated GiB |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    summary = "; ".join(filter(None, [runs_summary(numbers)] + failures))
    measured = numbers.get("none", {})
    if measured.get("ms_per_iteration"):
        # The planner's prediction of the no-recompute run, calibrated (when the calibrate step ran) and not.
        step = measured["ms_per_iteration"] / 1000
        profile = os.path.join(ctx.work_dir, "profile.json")
        ratios = {}
        for label, path in (("calibrated", profile if os.path.exists(profile) else None), ("constants", None)):
            if label == "calibrated" and path is None:
                continue
            try:
                ratios[label] = predicted_step(ctx, common, measured["micro_batch_size"], path) / step
            except (StepFailed, OutOfTime) as e:
                ratios[label] = f"not planned: {str(e)[:120]}"
        numbers["predicted_over_measured"] = ratios
        summary += "; plan's predicted / measured step (no recompute): " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in ratios.items())
    return ("fail" if failures else "pass"), summary, details, numbers


def moe_training(ctx: Context):
    """A ~1B-parameter Mixture-of-Experts GPT (12 layers of 8 experts, top-2), bf16, ZeRO 1, on one GPU:
    tokens/s, TFLOP/s and MFU (FLOPs of the k experts a token passes through), peak memory against our
    estimate; with the per-expert GEMM loop and with --moe-grouped-gemm (torch._grouped_mm)."""
    vocab, data = random_data(ctx)
    if ctx.dry_run:
        model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                 "--num-experts", "4", "--moe-ffn-hidden-size", "128"]
        micro, iters, log_interval, warmup, variants = 2, 4, 2, 1, [("loop", [])]
    else:
        model = ["--num-layers", "12", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
                 "--num-experts", "8", "--moe-ffn-hidden-size", "4096"]
        micro, iters, log_interval, warmup = 4, 30, 10, 5
        variants = [("loop", []), ("grouped", ["--moe-grouped-gemm"])]
    common = model + ["--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--micro-batch-size", str(micro),
                      *training_flags(ctx, vocab, data, iters, log_interval, warmup)]
    rows, numbers, failures = [], {}, []
    for i, (name, flags) in enumerate(variants):
        try:
            parsed = train(ctx, f"moe-{name}", common + flags, ctx.remaining() / (len(variants) - i))
        except StepFailed as e:
            failures.append(f"{name}: {e}")
            rows.append(f"| {name} | failed: {str(e)[:150]} | | | | |")
            continue
        numbers[name] = run_numbers(parsed)
        rows.append(f"| {name} | {run_cells(numbers[name])}")
    details = ("| expert GEMMs | tokens/s | TFLOP/s | MFU % | peak GiB | estimated GiB |\n|---|---|---|---|---|---|\n"
               + "\n".join(rows) + "\n")
    summary = runs_summary(numbers)
    if numbers.get("loop", {}).get("tokens_per_s") and numbers.get("grouped", {}).get("tokens_per_s"):
        numbers["grouped_over_loop"] = numbers["grouped"]["tokens_per_s"] / numbers["loop"]["tokens_per_s"]
        summary += f"; grouped GEMM / loop tokens/s {numbers['grouped_over_loop']:.3f}"
    return ("fail" if failures else "pass"), "; ".join(filter(None, [summary] + failures)), details, numbers


def deepseek_training(ctx: Context):
    """A DeepSeek-V3-shaped GPT (Multi-head Latent Attention, DeepSeek's router with groups, the expert bias and a
    shared expert after one dense layer, one Multi-Token Prediction depth), bf16, ZeRO 1, on one GPU: tokens/s,
    TFLOP/s and MFU (FLOPs of the k experts a token passes through and of the depth), peak memory against our
    estimate (issue 56)."""
    vocab, data = random_data(ctx)
    mla = ["--multi-latent-attention", "--qk-layernorm", "--position-embedding-type", "rope", "--swiglu",
           "--normalization", "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
           "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
           "--moe-router-topk-scaling-factor", "2.5", "--mtp-num-layers", "1"]
    if ctx.dry_run:
        model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                 "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
                 "--v-head-dim", "16", "--num-experts", "4", "--moe-ffn-hidden-size", "64",
                 "--moe-shared-expert-intermediate-size", "64", "--moe-layer-freq", "([0]*1+[1]*1)",
                 "--ffn-hidden-size", "128"]
        micro, iters, log_interval, warmup = 2, 4, 2, 1
    else:  # DeepSeek-V3's head widths, 16 heads of 2048; 8 experts top-2 in 4 groups (best 2)
        model = ["--num-layers", "12", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "4096",
                 "--q-lora-rank", "1536", "--kv-lora-rank", "512", "--qk-head-dim", "128", "--qk-pos-emb-head-dim",
                 "64", "--v-head-dim", "128", "--num-experts", "8", "--moe-ffn-hidden-size", "1408",
                 "--moe-shared-expert-intermediate-size", "1408", "--moe-layer-freq", "([0]*1+[1]*11)",
                 "--ffn-hidden-size", "5632", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2"]
        micro, iters, log_interval, warmup = 1, 30, 10, 5
    argv = model + mla + ["--moe-router-topk", "2", "--micro-batch-size", str(micro),
                          *training_flags(ctx, vocab, data, iters, log_interval, warmup)]
    parsed = train(ctx, "deepseek", argv, ctx.remaining())
    numbers = {"mla-moe-mtp": run_numbers(parsed)}
    details = ("| model | tokens/s | TFLOP/s | MFU % | peak GiB | estimated GiB |\n|---|---|---|---|---|---|\n"
               f"| MLA + MoE + MTP | {run_cells(numbers['mla-moe-mtp'])}\n")
    return "pass", runs_summary(numbers), details, numbers


def gpt_oss_training(ctx: Context):
    """A gpt-oss-shaped GPT (learned attention sinks, 128-token windows on every other layer, YaRN, biases, experts
    top-4 with the clamped quick-GeGLU), bf16, ZeRO 1, on one GPU, under both attention backends (SDPA with the sink
    as one more key; our fused softmax, whose CUDA kernel takes the sinks): tokens/s, TFLOP/s, MFU, peak memory
    against our estimate (issue 57)."""
    vocab, data = random_data(ctx)
    gpt_oss = ["--normalization", "RMSNorm", "--untie-embeddings-and-output-weights", "--group-query-attention",
               "--softmax-type", "learnable", "--quick-geglu", "--glu-linear-offset", "1",
               "--activation-func-clamp-value", "7", "--window-size", "127,0", "--window-attn-skip-freq", "2",
               "--position-embedding-type", "yarn", "--rotary-base", "150000", "--rotary-scaling-factor", "32",
               "--yarn-original-max-position-embeddings", "4096", "--no-yarn-correction-range-round-to-int",
               "--moe-router-score-function", "softmax", "--moe-router-topk", "4"]
    if ctx.dry_run:
        model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
                 "--kv-channels", "8", "--seq-length", "64", "--num-experts", "4", "--moe-ffn-hidden-size", "64",
                 "--ffn-hidden-size", "64"]
        micro, iters, log_interval, warmup = 2, 4, 2, 1
    else:  # gpt-oss-20b's widths (hidden 2880, 64 heads of 64 in 8 groups, experts of 2880), 8 layers, 8 experts
        model = ["--num-layers", "8", "--hidden-size", "2880", "--num-attention-heads", "64", "--num-query-groups", "8",
                 "--kv-channels", "64", "--seq-length", "2048", "--num-experts", "8", "--moe-ffn-hidden-size", "2880",
                 "--ffn-hidden-size", "2880"]
        micro, iters, log_interval, warmup = 1, 30, 10, 5
    numbers, rows, failures = {}, [], []
    backends = ("sdpa",) if ctx.dry_run else ("sdpa", "fused")  # a dry run checks the step, not the two kernels
    for i, backend in enumerate(backends):
        argv = model + gpt_oss + ["--attention-backend", backend, "--micro-batch-size", str(micro),
                                  *training_flags(ctx, vocab, data, iters, log_interval, warmup)]
        try:
            parsed = train(ctx, f"gpt-oss-{backend}", argv, ctx.remaining() / (len(backends) - i))
        except StepFailed as e:
            failures.append(f"{backend}: {e}")
            rows.append(f"| {backend} | failed: {str(e)[:150]} | | | | |")
            continue
        numbers[backend] = run_numbers(parsed)
        rows.append(f"| {backend} | {run_cells(numbers[backend])}")
    details = ("| attention | tokens/s | TFLOP/s | MFU % | peak GiB | estimated GiB |\n|---|---|---|---|---|---|\n"
               + "\n".join(rows) + "\n")
    return ("fail" if failures else "pass"), "; ".join(filter(None, [runs_summary(numbers)] + failures)), details, \
        numbers


# (name, compile?, recompute mode, micro-batch multiple) of step `compile`'s runs per model: compile off and on
# without recompute, then compiled with each recompute mode, full recompute at twice the micro batch (the memory
# it frees, spent on bigger GEMMs).
COMPILE_GRID = [("eager", False, "none", 1), ("compiled", True, "none", 1), ("compiled+selective", True, "selective", 1),
                ("compiled+full 2x micro", True, "full", 2)]


def compile_ab(ctx: Context):
    """--compile on and off, each recompute mode and the micro batch, for the ~1.3B dense GPT (step c's) and the
    ~1B MoE (step moe's, grouped GEMM), bf16, ZeRO 1, on one GPU: tokens/s, TFLOP/s, MFU, peak memory against the
    estimate, and the compiled / eager tokens/s (issue 58). Without dropout, as models are pretrained now (a dropout
    that draws runs eagerly between compiled parts: model/compile.py). The first steps (compiling) are left out of
    the numbers, which come from the last log interval."""
    vocab, data = random_data(ctx)
    recompute = dict(RECOMPUTE_MODES)
    if ctx.dry_run:  # the step's plumbing, quickly: one model, traced by aot_eager (no code generation on the CPU)
        models = [("dense", ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                             "64"], 2)]
        grid, backend, iters, log_interval, warmup = COMPILE_GRID[:2], "aot_eager", 4, 2, 1
    else:
        models = [("1.3B dense", ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
                                  "--seq-length", "2048"], 2),
                  ("~1B MoE", ["--num-layers", "12", "--hidden-size", "1024", "--num-attention-heads", "16",
                               "--seq-length", "2048", "--num-experts", "8", "--moe-ffn-hidden-size", "4096",
                               "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-grouped-gemm"], 4)]
        grid, backend, iters, log_interval, warmup = COMPILE_GRID, "inductor", 20, 10, 5
    runs = [(m, model, micro, g) for m, model, micro in models for g in grid]
    rows, numbers, failures = [], {}, []
    for i, (m, model, micro, (name, compiled, mode, times)) in enumerate(runs):
        argv = (model + recompute[mode] + ["--micro-batch-size", str(micro * times), "--hidden-dropout", "0",
                                            "--attention-dropout", "0"]
                + (["--compile", "--compile-backend", backend] if compiled else [])
                + training_flags(ctx, vocab, data, iters, log_interval, warmup))
        key = f"{m} {name}"
        try:
            parsed = train(ctx, f"compile-{i}", argv, ctx.remaining() / (len(runs) - i))
        except (StepFailed, OutOfTime) as e:
            failures.append(f"{key}: {e}")
            rows.append(f"| {m} | {name} | {micro * times} | failed: {str(e)[:150]} | | | | |")
            continue
        numbers[key] = {"micro_batch_size": micro * times, **run_numbers(parsed)}
        rows.append(f"| {m} | {name} | {micro * times} | {run_cells(numbers[key])}")
    details = ("| model | run | micro batch | tokens/s | TFLOP/s | MFU % | peak GiB | estimated GiB |\n"
               "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    summary = runs_summary(numbers)
    for m, *_ in models:
        eager, compiled = numbers.get(f"{m} eager", {}), numbers.get(f"{m} compiled", {})
        if eager.get("tokens_per_s") and compiled.get("tokens_per_s"):
            numbers[f"{m} compiled_over_eager"] = compiled["tokens_per_s"] / eager["tokens_per_s"]
            summary += f"; {m}: compiled / eager tokens/s {numbers[f'{m} compiled_over_eager']:.3f}"
    return ("fail" if failures else "pass"), "; ".join(filter(None, [summary] + failures)), details, numbers


def text_corpus(ctx: Context, docs: int, vocab: int) -> Tuple[str, str]:
    """(dataset prefix, tokenizer model) from the Python standard library's sources, by our tools."""
    folder = os.path.join(ctx.work_dir, f"corpus-{docs}-{vocab}")
    prefix, model = os.path.join(folder, "corpus"), os.path.join(folder, "spm")
    if not os.path.exists(prefix + "_text_document.idx"):
        os.makedirs(folder, exist_ok=True)
        corpus = os.path.join(folder, "corpus.jsonl")
        # --overwrite: what an interrupted earlier call left in this scratch folder is made again
        ctx.run([ctx.python, "tools/make_corpus.py", "--output", corpus, "--max-docs", str(docs), "--overwrite"],
                check=True)
        ctx.run([ctx.python, "tools/train_tokenizer.py", "--input", corpus, "--vocab-size", str(vocab),
                 "--model-prefix", model, "--overwrite"], check=True)
        ctx.run([ctx.python, "tools/preprocess_data.py", "--input", corpus, "--output-prefix", prefix,
                 "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model + ".model", "--append-eod",
                 "--workers", "2", "--overwrite"], check=True)
    return prefix + "_text_document", model + ".model"


def bf16_vs_fp32(ctx: Context):
    docs, vocab = (60, 500) if ctx.dry_run else (600, 2000)
    data, tokenizer = text_corpus(ctx, docs, vocab)
    if ctx.dry_run:
        shape, steps, tolerance = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                   "--seq-length", "64", "--micro-batch-size", "4"], 10, 0.05
    else:
        shape, steps, tolerance = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8",
                                   "--seq-length", "512", "--micro-batch-size", "8"], 100, 0.02
    common = shape + ["--global-batch-size", "32" if not ctx.dry_run else "8", "--data-path", data,
                      "--tokenizer-model", tokenizer, "--split", "98,2,0", "--train-iters", str(steps),
                      "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000", "--lr", "6e-4",
                      "--lr-warmup-iters", str(steps // 10), "--hidden-dropout", "0", "--attention-dropout", "0",
                      "--data-cache-path", os.path.join(ctx.work_dir, "index-cache"), "--seed", "1234"]
    curves = {}
    for i, (name, flags) in enumerate((("fp32", []), ("bf16", ["--bf16"]))):
        parsed = train(ctx, f"d-{name}", common + flags, ctx.remaining() / (2 - i))
        curves[name] = [r["loss"] for r in parsed["iterations"]]
    fp32, bf16 = curves["fp32"], curves["bf16"]
    n = min(len(fp32), len(bf16))
    if n < steps:
        raise StepFailed(f"only {n} of {steps} logged losses")
    tail_n = max(1, n // 10)
    end32, end16 = mean(fp32[n - tail_n:n]), mean(bf16[n - tail_n:n])
    relative = abs(end16 - end32) / end32
    largest = max(abs(a - b) for a, b in zip(fp32, bf16))
    every = max(1, n // 10)
    table = "| iteration | fp32 loss | bf16 loss |\n|---|---|---|\n" + "\n".join(
        f"| {i + 1} | {fp32[i]:.4f} | {bf16[i]:.4f} |" for i in list(range(0, n, every)) + [n - 1])
    ok = relative <= tolerance and end32 < fp32[0] and end16 < bf16[0]
    summary = (f"{steps} steps: loss {fp32[0]:.3f} -> {end32:.3f} (fp32) and {bf16[0]:.3f} -> {end16:.3f} (bf16, mean "
               f"of the last {tail_n}); relative difference {100 * relative:.2f}% (limit {100 * tolerance:.0f}%), "
               f"largest per-step difference {largest:.4f}")
    return ("pass" if ok else "fail"), summary, table + "\n", {"fp32": fp32, "bf16": bf16, "relative": relative}


# (key, title, budget seconds on a GPU, budget seconds in a dry run, function)
STEPS = (
    ("env", "machine", 60, 60, env),
    ("install", "carried wheels (.whl)", 180, 10, install),
    ("build", "megatron_lite._C with CUDA kernels", 480, 60, build),
    ("a", "CUDA-only tests; model/parallel tests on the GPU", 420, 240, tests),
    ("b", "fused softmax vs eager, torch.compile, SDPA, HBM floor", 420, 180, softmax),
    ("calibrate", "tune_parallelism.py calibrate: GEMM, copy, collectives", 90, 90, calibrate),
    ("c", "~1.3B GPT, bf16, ZeRO 1, 30 iterations, each recompute mode", 540, 240, gpt_1_3b),
    ("d", "bf16 vs fp32 loss curve, 100 steps", 300, 180, bf16_vs_fp32),
    ("moe", "~1B MoE GPT (8 experts, top-2), bf16, ZeRO 1: per-expert loop vs grouped GEMM", 300, 120, moe_training),
    ("mla", "DeepSeek-V3-shaped GPT (MLA, MoE with groups, one MTP depth), bf16, ZeRO 1", 300, 120, deepseek_training),
    ("gptoss", "gpt-oss-shaped GPT (sinks, alternating windows, MoE top-4, biases), bf16, ZeRO 1, both backends", 360,
     150, gpt_oss_training),
    ("compile", "--compile on/off x recompute x micro batch: ~1.3B dense and ~1B MoE, bf16, ZeRO 1", 560, 90,
     compile_ab),
)
