"""Run a plan's candidates as short real pretrain_gpt.py runs: one folder per run, resumable.

    tune_parallelism.py sweep --plan plan.json --results sweep/ \\
        --launcher "torchrun --nproc_per_node {nproc_per_node} --nnodes {nodes} --master_port {port}" \\
        -- --data-path data/corpus_text_document --tokenizer-type NullTokenizer ...

Launcher placeholders (str.format): {nproc_per_node} (processes per node: the plan's GPUs per
node, or the world size when that is smaller), {gpus_per_node}, {nodes}, {world_size} (= TP x CP x PP x DP of
the candidate; its EP is taken out of DP x CP, so no rank more), {port} (a free TCP port on this host),
{name} (the run's folder name), {run_dir} (its absolute path), {script} (pretrain_gpt.py; appended
after the launcher when the template does not place it). Inside a Slurm allocation use e.g.
"srun --ntasks {world_size} --ntasks-per-node {gpus_per_node} python".

Each run folder holds command.txt, log.txt (stdout and stderr), status (pending, running,
completed, oom, timeout, refused, failed), tensorboard/ (the run's TensorBoard events and
metrics.jsonl, which the sweep reads its numbers from), repeat.json (this run's result) and result.json
(the candidate's: with `--repeats N` its fastest run of N, the later ones in repeat2/, repeat3/, ...).
results.jsonl in the results folder gets one line per run, rewritten after every run. A failing or hanging run is
recorded and the sweep goes on; a second invocation skips runs whose status is completed (and
those with another final status unless `--retry` names it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from typing import Any, Dict, List, Optional, Sequence

from megatron_lite.atomic import write_text
from megatron_lite.config import ConfigError
from megatron_lite.flag_numbers import add_number
from megatron_lite.reading import UnreadableFile, read_json
from megatron_lite.targets import blocking_file
from megatron_lite.training import records
from megatron_lite.training.distributed import free_port
from megatron_lite.tuning.candidates import LAYOUT_FLAGS

STATUSES = ("pending", "running", "completed", "oom", "timeout", "refused", "failed")
FINAL_FAILURES = ("oom", "timeout", "refused", "failed")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEP_OWNED = ("--train-iters", "--log-interval", "--eval-iters", "--eval-interval", "--save", "--load",
               "--save-interval", "--exit-interval", "--tensorboard-dir")
TENSORBOARD = "tensorboard"
RESULTS_FILE = "results.jsonl"
"""The results folder's one line per run, rewritten after every run (what marks a folder as a sweep's)."""
"""A run's --tensorboard-dir, inside its folder: its metrics.jsonl is what the sweep reads."""

# A crash leaves no record of why: its last words are the only evidence of running out of memory.
_OOM = re.compile(r"out of memory|OutOfMemoryError|CUDA error: out of memory|std::bad_alloc|Cannot allocate memory",
                  re.IGNORECASE)


def summarize_records(run_records: List[Dict[str, Any]], warmup_iters: int) -> Dict[str, Any]:
    """Throughput averaged over the intervals after `warmup_iters`, the peak memory, each stage's
    estimated and measured memory, and how the run ended, from its metrics.jsonl records."""
    intervals = [r for r in run_records if r["kind"] == "interval"]
    summary = next((r for r in reversed(run_records) if r["kind"] == "summary"), None)
    peak_key = "mem_peak_gib" if any("mem_peak_gib" in r for r in intervals) else "mem_peak_rss_gib"
    peaks = [r[peak_key] for r in intervals if peak_key in r]
    out: Dict[str, Any] = {
        "logged_iterations": len(intervals), "run_status": summary["status"] if summary else None,
        "peak_memory_gib": max(peaks) if peaks else None,
        "peak_memory_kind": None if not peaks else (
            "GPU max_memory_allocated (rank 0)" if peak_key == "mem_peak_gib" else "process peak RSS (rank 0)"),
        "stage_memory": records.stage_memory_gib(run_records),
    }
    timed = [r for r in intervals if r["iteration"] > warmup_iters] or intervals
    out["warmup_excluded"] = bool(intervals) and timed is not intervals
    if not timed:
        return out
    seconds = sum(r["seconds"] for r in timed)
    iterations = sum(r["iterations"] for r in timed)
    # Rates are per interval: weight each by its time (total work / total time), not a mean of rates.
    out.update(
        timed_iterations=iterations,
        ms_per_iteration=1e3 * seconds / iterations,
        samples_per_s=sum(r["samples_per_s"] * r["seconds"] for r in timed) / seconds,
        tokens_per_s=sum(r["tokens_per_s"] * r["seconds"] for r in timed) / seconds,
        tflops_per_rank=sum(r["tflops_per_rank"] * r["seconds"] for r in timed) / seconds,
    )
    if all("mfu" in r for r in timed):
        out["mfu"] = sum(r["mfu"] * r["seconds"] for r in timed) / seconds
    return out


def read_run(run_dir: str, warmup_iters: int) -> Dict[str, Any]:
    """summarize_records of the run in run_dir (its tensorboard/metrics.jsonl)."""
    return summarize_records(records.read_records(os.path.join(run_dir, TENSORBOARD, records.FILE_NAME)),
                             warmup_iters)


def classify(returncode: Optional[int], timed_out: bool, log_text: str, measured: Dict[str, Any]) -> str:
    """The run's status from its exit, its records (`summarize_records`) and, for a crash, its last words."""
    if timed_out:
        return "timeout"
    if returncode != 0 and (_OOM.search(log_text) or returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)):
        return "oom"  # the kernel's OOM killer leaves only SIGKILL
    if returncode == 2:
        return "refused"  # pretrain_gpt.py's configuration errors exit 2 with one line
    if returncode == 0 and measured.get("run_status") == "completed" and measured.get("timed_iterations"):
        return "completed"
    return "failed"


def _kill_tree(pid: int) -> None:
    """SIGKILL a launcher and everything under it (torchrun's workers run in sessions of their own)."""
    try:
        import psutil

        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except Exception:  # noqa: BLE001 - psutil missing or the process is gone
        procs = []
    for p in procs:
        try:
            p.kill()
        except Exception:  # noqa: BLE001
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def pretrain_args(candidate: Dict[str, Any], fixed: Sequence[str]) -> List[str]:
    """The candidate's pretrain_gpt.py flags (model, batch and layout, as planned), then the user's fixed flags."""
    if "pretrain_argv" not in candidate:
        raise ConfigError(f"candidate {candidate.get('name')} has no pretrain_argv: the plan was written by an older "
                          f"version; run `tune_parallelism.py plan` again")
    return list(candidate["pretrain_argv"]) + list(fixed)


PLACEHOLDERS = ("nproc_per_node", "gpus_per_node", "nodes", "world_size", "port", "name", "run_dir", "script")
"""The launcher template's fields (str.format), filled per run by `build_command`."""
_LAYOUT_NUMBERS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size")


def _format_launcher(launcher: str, values: Dict[str, Any]) -> List[str]:
    """The launcher's words with `values` filled in; ConfigError naming --launcher for a template that cannot be."""
    try:
        return shlex.split(launcher.format(**values))
    except (KeyError, IndexError, AttributeError) as e:
        field = "{" + str(e.args[0]) + "}" if isinstance(e, KeyError) else "(a positional {} or an attribute)"
        raise ConfigError(f"--launcher {launcher!r}: unknown placeholder {field}; use "
                          f"{', '.join('{' + k + '}' for k in PLACEHOLDERS)} (double a literal brace: {{{{ }}}})"
                          ) from None
    except ValueError as e:  # a lone brace (str.format) or an unclosed quote (shlex)
        raise ConfigError(f"--launcher {launcher!r} is not a template: {e}; write placeholders as "
                          f"{', '.join('{' + k + '}' for k in PLACEHOLDERS)}, a literal brace doubled ({{{{ }}}}), "
                          f"quotes closed") from None


def check_launcher(launcher: str) -> None:
    """Refuse a template `build_command` could not fill, before any run starts (every field is known now)."""
    _format_launcher(launcher, {k: "x" if k in ("name", "run_dir", "script") else 1 for k in PLACEHOLDERS})


def plan_problem(plan: Any, path: str) -> Optional[str]:
    """Why the JSON read from `path` is not a plan the sweep can run, or None: `tune_parallelism.py plan
    --output` writes an object with the cluster and a list of candidates, each with a name (its run folder)
    and its pretrain_gpt.py flags."""
    again = "give a plan written by `tune_parallelism.py plan --output`"
    if not isinstance(plan, dict) or not isinstance(plan.get("candidates"), list):
        return f"--plan {path} is not a plan: it has no list of \"candidates\"; {again}"
    cluster = plan.get("cluster")
    if not isinstance(cluster, dict) or not all(_positive_int(cluster.get(k)) for k in ("nodes", "gpus_per_node")):
        return f"--plan {path} is not a plan: \"cluster\" needs whole \"nodes\" and \"gpus_per_node\"; {again}"
    names = set()
    for i, c in enumerate(plan["candidates"]):
        where = f"--plan {path}: candidate {i}"
        if not isinstance(c, dict):
            return f"{where} is not an object; {again}"
        name = c.get("name")
        if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or os.sep in name:
            return f"{where}'s \"name\" {json.dumps(name)} is not a folder name (a non-empty string without /); {again}"
        if name in names:
            return f"{where}'s \"name\" {name} is used twice (each names a run folder); {again}"
        names.add(name)
        argv = c.get("pretrain_argv")
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            return (f"{where} ({name}) has no \"pretrain_argv\" list of strings: the plan was written by an older "
                    f"version or edited; run `tune_parallelism.py plan` again")
        bad = [k for k in _LAYOUT_NUMBERS if not _positive_int(c.get(k))]
        bad += [k for k in ("context_parallel_size",) if k in c and not _positive_int(c[k])]
        if bad:
            return f"{where} ({name}) needs positive whole {', '.join(bad)}; {again}"
    return None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def only_problem(plan: Dict[str, Any], only: Sequence[str]) -> Optional[str]:
    """Why `--only` selects nothing it was meant to, or None: each of its words must be in some candidate's name."""
    names = [c["name"] for c in plan["candidates"]]
    missing = [o for o in only if not any(o in n for n in names)]
    if not missing:
        return None
    shown = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
    return (f"--only {' '.join(missing)}: no candidate of the plan has {'it' if len(missing) == 1 else 'them'} in "
            f"its name; the names are {shown or 'none (the plan is empty)'}")


def build_command(launcher: str, candidate: Dict[str, Any], plan: Dict[str, Any], fixed: Sequence[str],
                  run_dir: str, train_iters: int, script: str) -> List[str]:
    cluster = plan["cluster"]
    world = (candidate["tensor_model_parallel_size"] * candidate.get("context_parallel_size", 1)
             * candidate["pipeline_model_parallel_size"] * candidate["data_parallel_size"])
    values = {"nproc_per_node": min(cluster["gpus_per_node"], world), "gpus_per_node": cluster["gpus_per_node"],
              "nodes": cluster["nodes"], "world_size": world, "port": free_port(), "name": candidate["name"],
              "run_dir": os.path.abspath(run_dir), "script": script}
    cmd = _format_launcher(launcher, values)
    if "{script}" not in launcher:
        cmd.append(script)
    return cmd + pretrain_args(candidate, fixed) + [
        "--train-iters", str(train_iters), "--log-interval", "1", "--eval-interval", str(10 ** 9),
        "--eval-iters", "0", "--tensorboard-dir", os.path.join(os.path.abspath(run_dir), TENSORBOARD)]


def _read(path: str, default: str = "") -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return default


def run_one(cmd: List[str], run_dir: str, time_limit: float, env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Run a command with its output in run_dir/log.txt; kill it at time_limit."""
    write_text(os.path.join(run_dir, "command.txt"), " ".join(shlex.quote(c) for c in cmd) + "\n")
    write_text(os.path.join(run_dir, "status"), "running\n")
    full_env = dict(os.environ, PYTHONUNBUFFERED="1")
    full_env["PYTHONPATH"] = REPO_ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    start = time.time()
    timed_out = False
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO_ROOT,
                                    start_new_session=True)
        except OSError as e:
            log.write(f"sweep: could not start {cmd[0]}: {e}\n")
            return {"returncode": None, "timed_out": False, "seconds": 0.0}
        try:
            returncode = proc.wait(timeout=time_limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_tree(proc.pid)
            returncode = proc.wait()
    return {"returncode": returncode, "timed_out": timed_out, "seconds": time.time() - start}


def _result_line(candidate: Dict[str, Any], status: str, run: Dict[str, Any],
                 measured: Dict[str, Any]) -> Dict[str, Any]:
    keys = ("name", "layout", "rank", "throughput_rank", "tensor_model_parallel_size", "context_parallel_size",
            "pipeline_model_parallel_size", "data_parallel_size", "expert_model_parallel_size", "micro_batch_size",
            "gradient_accumulation_steps", "zero_stage", "cpu_offload",
            "sequence_parallel", "recompute_granularity", "recompute_method", "recompute_num_layers", "saver",
            "pipeline_schedule", "predicted_pipeline_efficiency", "predicted_tokens_per_s", "predicted_step_seconds", "predicted_from",
            "predicted_ep_comm_seconds", "predicted_relative_throughput", "peak_bytes_per_stage", "argv")
    line = {k: candidate.get(k) for k in keys}
    line["predicted_peak_gib_per_stage"] = [b / 2 ** 30 for b in candidate.get("peak_bytes_per_stage") or []]
    line.update(status=status, returncode=run.get("returncode"), seconds=run.get("seconds"))
    line.update(measured)
    return line


def collect(results_dir: str) -> List[Dict[str, Any]]:
    """Every run's result.json, in the plan's order; written to results.jsonl."""
    lines = []
    for name in sorted(os.listdir(results_dir)):
        path = os.path.join(results_dir, name, "result.json")
        if os.path.isfile(path):
            lines.append(json.loads(_read(path)))
    lines.sort(key=lambda r: r.get("rank") or 0)
    write_text(os.path.join(results_dir, RESULTS_FILE), "".join(json.dumps(r) + "\n" for r in lines))
    return lines


def repeat_dir(run_dir: str, repeat: int) -> str:
    """Where a candidate's repeat (1, 2, ...) runs: the first in the run's own folder, later ones inside it."""
    return run_dir if repeat == 1 else os.path.join(run_dir, f"repeat{repeat}")


def fastest_repeat(lines: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A candidate's result over its repeats (each a result line, in repeat order): the completed one with the
    fewest ms per iteration, or the first when none completed; `repeats` lists each one's status and speed. The
    fastest, not the mean: a shared machine's slow spells only ever lengthen a run (the same layout measured
    0.69x-1.26x of itself in two sweeps an hour apart here), as calibrate's passes keep each run's fastest."""
    done = [line for line in lines if line["status"] == "completed" and line.get("ms_per_iteration")]
    best = dict(min(done, key=lambda line: line["ms_per_iteration"]) if done else lines[0])
    best["repeats"] = [{"status": line["status"], "ms_per_iteration": line.get("ms_per_iteration"),
                        "tokens_per_s": line.get("tokens_per_s")} for line in lines]
    return best


def _repeats_so_far(run_dir: str, repeats: int) -> List[Dict[str, Any]]:
    """The repeat.json of each repeat of a candidate that has run."""
    paths = (os.path.join(repeat_dir(run_dir, k), "repeat.json") for k in range(1, repeats + 1))
    return [json.loads(_read(path)) for path in paths if os.path.isfile(path)]


def run_repeat(c: Dict[str, Any], plan: Dict[str, Any], fixed: Sequence[str], here: str, launcher: str,
               train_iters: int, warmup_iters: int, time_limit: float, script: str):
    """One run of candidate `c` in its repeat folder `here`: launched, measured, classified, and its
    repeat.json written; returns (status, the run's outcome, the measurements)."""
    cmd = build_command(launcher, c, plan, fixed, here, train_iters, script)
    shutil.rmtree(os.path.join(here, TENSORBOARD), ignore_errors=True)  # a retried run's records only
    run = run_one(cmd, here, time_limit)
    measured = read_run(here, warmup_iters)
    status = classify(run["returncode"], run["timed_out"], _read(os.path.join(here, "log.txt")), measured)
    line = _result_line(c, status, run, measured)
    line["pretrain_args"] = pretrain_args(c, fixed)
    line["launcher_args"] = cmd[:cmd.index(script)] if script in cmd else []
    line["script"] = script
    write_text(os.path.join(here, "repeat.json"), json.dumps(line, indent=1))
    return status, run, measured


def sweep(plan: Dict[str, Any], results_dir: str, launcher: str, fixed: Sequence[str], train_iters: int = 10,
          warmup_iters: int = 2, time_limit: float = 900.0, retry: Sequence[str] = (), only: Sequence[str] = (),
          max_runs: Optional[int] = None, script: Optional[str] = None, log=print, repeats: int = 1) -> Dict[str, int]:
    """Run every selected candidate not yet done; returns counts per status of this invocation. With repeats > 1
    every candidate whose first run completed runs again, in passes over the candidates in alternating order
    (a slow spell of the machine falls on different runs), and its result.json is the fastest repeat's."""
    script = script or os.path.join(REPO_ROOT, "pretrain_gpt.py")
    owned = [f for f in fixed if f.split("=", 1)[0] in LAYOUT_FLAGS + SWEEP_OWNED]
    if owned:
        raise ConfigError(f"fixed pretrain_gpt.py flags {owned} are set by the plan or the sweep; remove them "
                          f"(layout flags come from the plan, --train-iters from sweep --train-iters)")
    if repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {repeats}")
    # Every input is checked before the results folder exists: a refusal leaves nothing behind.
    why = plan_problem(plan, "plan") or only_problem(plan, only)
    if why:
        raise ConfigError(why)
    check_launcher(launcher)
    os.makedirs(results_dir, exist_ok=True)
    candidates = plan["candidates"]
    if only:
        candidates = [c for c in candidates if any(o in c["name"] for o in only)]
    if max_runs is not None:
        candidates = candidates[:max_runs]
    counts: Dict[str, int] = {}
    for repeat in range(1, repeats + 1):
        order = list(enumerate(candidates, 1))
        for i, c in (order if repeat % 2 else order[::-1]):
            run_dir = os.path.join(results_dir, c["name"])
            here = repeat_dir(run_dir, repeat)
            if repeat > 1 and _read(os.path.join(run_dir, "status"), "pending").strip() != "completed":
                continue  # a layout that failed once is not timed again
            os.makedirs(here, exist_ok=True)
            status_path = os.path.join(here, "status")
            previous = _read(status_path, "pending").strip()
            if previous == "completed" or (previous in FINAL_FAILURES and previous not in retry):
                counts["skipped"] = counts.get("skipped", 0) + 1
                continue
            tag = f"[{i}/{len(candidates)}]" + (f" repeat {repeat}/{repeats}" if repeats > 1 else "")
            log(f"{tag} {c['name']}: running ({c.get('saver', 'saver not recorded')})")
            status, run, measured = run_repeat(c, plan, fixed, here, launcher, train_iters, warmup_iters, time_limit,
                                               script)
            write_text(os.path.join(run_dir, "result.json"),
                       json.dumps(fastest_repeat(_repeats_so_far(run_dir, repeats)), indent=1))
            write_text(status_path, status + "\n")
            collect(results_dir)
            counts[status] = counts.get(status, 0) + 1
            rate = f", {measured['tokens_per_s']:.0f} tokens/s" if measured.get("tokens_per_s") else ""
            log(f"{tag} {c['name']}: {status} in {run['seconds']:.0f}s{rate}")
    collect(results_dir)
    return counts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tune_parallelism.py sweep", allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--plan", required=True, help="plan JSON from `tune_parallelism.py plan`")
    parser.add_argument("--results", required=True, help="folder for the run folders and results.jsonl")
    parser.add_argument("--launcher", required=True, help="launcher command template (placeholders above)")
    add_number(parser, "--train-iters", minimum=2, default=10)
    add_number(parser, "--warmup-iters", minimum=0, default=2, help="first iterations left out of the timing")
    add_number(parser, "--time-limit", kind=float, above=0, maximum=7 * 24 * 3600, default=900.0,
               help="seconds per run before it is killed")
    parser.add_argument("--retry", nargs="+", default=[], choices=FINAL_FAILURES,
                        help="rerun runs with these statuses (completed runs are never rerun)")
    parser.add_argument("--only", nargs="+", default=[], help="run only candidates whose name contains one of these")
    add_number(parser, "--max-runs", minimum=1, default=None, example=4, help="the first N candidates of the plan")
    parser.add_argument("--script", default=None, help="training script (default: this checkout's pretrain_gpt.py)")
    add_number(parser, "--repeats", minimum=1, default=1,
               help="runs per candidate, in passes of alternating order; each candidate's result is its fastest (on "
                    "a shared machine, 2 keeps a slow spell from deciding the ranking)")
    return parser


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    fixed: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, fixed = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.train_iters <= args.warmup_iters:
        parser.error(f"--train-iters {args.train_iters} must be larger than --warmup-iters {args.warmup_iters}")
    if blocking_file(args.results):  # an existing --results folder is resumed (completed runs are kept)
        parser.error(f"--results {args.results} cannot be created: {blocking_file(args.results)} is a file; give a "
                     f"folder path whose parents are folders")
    if os.path.lexists(args.results) and not os.path.isdir(args.results):
        parser.error(f"--results {args.results} is a file; give a folder (a new one, or an earlier sweep's to "
                     f"resume it)")
    try:
        plan = read_json(args.plan)
    except UnreadableFile as e:
        parser.error(f"--plan {e}")
    why = plan_problem(plan, args.plan) or only_problem(plan, args.only)
    if why:
        parser.error(why)
    try:
        check_launcher(args.launcher)
    except ConfigError as e:
        parser.error(str(e))
    start = time.time()
    counts = sweep(plan, args.results, args.launcher, fixed, args.train_iters, args.warmup_iters, args.time_limit,
                   args.retry, args.only, args.max_runs, args.script, log=lambda s: print(s, flush=True),
                   repeats=args.repeats)
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "nothing to run"
    print(f"sweep: {summary} in {time.time() - start:.0f}s; results in {os.path.join(args.results, RESULTS_FILE)}")
    return 0
