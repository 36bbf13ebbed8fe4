"""Where the test suite's time goes: what a cold process costs before its first step, against a warm one.

    python benchmarks/bench_test_startup.py --rounds 2 --json startup.json
    python benchmarks/bench_test_startup.py --map --log suite.jsonl --durations durations.json

The first form measures, in interleaved rounds (each number is its fastest round: the VM drifts), the
wall and CPU seconds of: an interpreter; `import torch`; `+ deepspeed`; the training loop's modules;
transformers; pretrain_gpt.py's refusal of a bad flag; the same tiny training run (2 layers, hidden 32, 4
steps) cold under torchrun at 1, 2 and 4 ranks, split at its first logged iteration into start-up (launch,
imports, rendezvous, engine) and work; and the same run's main on warm harness ranks (tests/entry_points.py),
after a worker pool started by spawn or forked from the harness's fork server.

The second form (`--map`) reads a suite run's process log (TEST_PROCESS_LOG, tests/process_log.py) and its
durations (TEST_DURATIONS_OUT) and prints, per test file, its seconds, its cold processes by kind, and the
start-up they cost at the measured prices (`--prices startup.json`): the table in docs/getting-started.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "1",
         "--eval-interval", "1000", "--eval-iters", "1", "--num-workers", "0", "--make-vocab-size-divisible-by",
         "16", "--train-iters", "4"]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_command(argv, first_line=None) -> dict:
    """Wall and CPU seconds of a command (its whole process tree), and the wall seconds until a line of its
    output matches `first_line`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=REPO)
    cpu0, start = _children_cpu(), time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    for line in proc.stdout:
        if first is None and first_line and re.search(first_line, line):
            first = time.monotonic() - start
    proc.wait()
    wall = time.monotonic() - start
    return {"wall": wall, "cpu": _children_cpu() - cpu0, "first_step": first, "code": proc.returncode}


def torchrun(nproc: int, script_args) -> list:
    from tests.harness import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), *script_args]


def cold_cases(data) -> dict:
    python = [sys.executable]
    run = ["pretrain_gpt.py", *MODEL, *data]
    return {
        "interpreter": lambda: timed_command(python + ["-c", "pass"]),
        "import torch": lambda: timed_command(python + ["-c", "import torch"]),
        "import torch, deepspeed": lambda: timed_command(python + ["-c", "import torch, deepspeed"]),
        "import megatron_lite.training.loop": lambda: timed_command(python + ["-c",
                                                                              "import megatron_lite.training.loop"]),
        "import transformers": lambda: timed_command(python + ["-c", "import transformers"]),
        "pretrain_gpt.py refuses a bad flag": lambda: timed_command(python + ["pretrain_gpt.py", "--num-layers", "0"]),
        "pretrain, plain python, 1 rank": lambda: timed_command(python + run, r"iteration\s+1/"),
        "pretrain, torchrun, 2 ranks": lambda: timed_command(torchrun(2, run + ["--pipeline-model-parallel-size",
                                                                                  "2"]), r"iteration\s+1/"),
        "pretrain, torchrun, 4 ranks": lambda: timed_command(torchrun(4, run + ["--pipeline-model-parallel-size", "2",
                                                                                  "--tensor-model-parallel-size", "2"]),
                                                             r"iteration\s+1/"),
    }


def warm_cases(data) -> dict:
    """The same runs on warm harness ranks: a pool's start (spawn or fork server), then its first and later runs."""
    from tests import harness
    from tests.entry_points import run_entry

    run = ["pretrain_gpt.py", *MODEL, *data]
    layouts = {1: [], 2: ["--pipeline-model-parallel-size", "2"],
               4: ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]}

    def pool_start(nproc, method):
        def measure():
            harness.shutdown_pools()
            saved = harness._start_context
            if method == "spawn":
                import torch.multiprocessing as mp

                harness._start_context = lambda: mp.get_context("spawn")
            try:
                cpu0, start = _children_cpu(), time.monotonic()
                harness.run_distributed(os.getpid, nproc)
                wall = time.monotonic() - start
            finally:
                harness._start_context = saved
            harness.shutdown_pools()
            return {"wall": wall, "cpu": _children_cpu() - cpu0}
        return measure

    def entry(nproc, fresh):
        def measure():
            if fresh:
                harness.shutdown_pools()
                harness.run_distributed(os.getpid, nproc)  # the pool up, not yet any run in it
            start = time.monotonic()
            result = run_entry(run + layouts[nproc], nproc)
            assert result.returncode == 0, result.stderr[-2000:]
            return {"wall": time.monotonic() - start}
        return measure

    cases = {}
    for nproc in (1, 2, 4):
        cases[f"pool start, spawn, {nproc} ranks"] = pool_start(nproc, "spawn")
        cases[f"pool start, fork server, {nproc} ranks"] = pool_start(nproc, "forkserver")
        cases[f"pretrain, warm, {nproc} ranks, first run of a pool"] = entry(nproc, True)
        cases[f"pretrain, warm, {nproc} ranks, a later run"] = entry(nproc, False)
    return cases


def make_corpus(work: str) -> list:
    from benchmarks.stress_startup import corpus

    return corpus(work)


def measure(rounds: int) -> dict:
    work = tempfile.mkdtemp(prefix="bench-startup-")
    data = make_corpus(work)
    cases = {**cold_cases(data), **warm_cases(data)}
    best: dict = {}
    for r in range(rounds):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))  # interleaved: drift hits both ends
        for name in order:
            result = cases[name]()
            if name not in best or result["wall"] < best[name]["wall"]:
                best[name] = result
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in result.items()
                                                          if isinstance(v, float)), flush=True)
    from tests import harness

    harness.shutdown_pools()
    return best


def print_prices(best: dict) -> None:
    print("\n| what | wall s | CPU s | to first step s |\n|---|---|---|---|")
    for name, r in best.items():
        first = f"{r['first_step']:.2f}" if r.get("first_step") else ""
        # A forked worker is the fork server's child, not this process's: its CPU is not in our rusage.
        cpu = f"{r['cpu']:.2f}" if "cpu" in r and "fork server" not in name else ""
        print(f"| {name} | {r['wall']:.2f} | {cpu} | {first} |")


# What one cold process of each kind costs before it works (CPU seconds, from the measured prices).
def startup_prices(best: dict) -> dict:
    torch_cpu = best["import torch, deepspeed"]["cpu"]
    per_rank = {n: best[f"pretrain, torchrun, {n} ranks"] for n in (2, 4)}
    return {"torch-process": torch_cpu, "python": best["interpreter"]["cpu"],
            "torchrun-rank": min(r["cpu"] / n for n, r in per_rank.items()),
            "spawned-pool-rank": best["pool start, spawn, 2 ranks"]["cpu"] / 2}


TORCH_TOOLS = {"pretrain_gpt.py", "convert_checkpoint.py", "evaluate.py", "generate.py", "estimate_memory.py",
               "tune_parallelism.py", "python -c", "python -m pytest", "python"}


def print_map(log: str, durations: str, prices: dict) -> None:
    seconds = defaultdict(float)
    for test, s in json.load(open(durations))["seconds"].items():
        seconds[test.split("::")[0]] += s
    kinds, startup = defaultdict(Counter), defaultdict(float)
    for line in open(log):
        row = json.loads(line)
        path = row["test"].split("::")[0] or "(collection)"
        kind, ranks = row["kind"], row["ranks"]
        if kind == "pool":
            forked = row["argv"] == ["forkserver"]  # earlier logs name no method: their pools were spawned
            kinds[path][f"{'forked' if forked else 'spawned'} pool {ranks}"] += 1
            startup[path] += 0.0 if forked else ranks * prices["spawned-pool-rank"]
        elif kind in ("torchrun", "deepspeed"):
            kinds[path][f"{kind} {ranks}"] += 1
            startup[path] += ranks * prices["torchrun-rank"]
        elif kind in TORCH_TOOLS:
            kinds[path][kind] += 1
            startup[path] += prices["torch-process"]
        elif kind.endswith(".py") or kind.startswith("python"):
            kinds[path][kind] += 1
            startup[path] += prices["python"]
        else:
            kinds[path][kind] += 1
    # A forked pool's workers cost no start-up of their own (the fork server imported once per pytest worker);
    # processes that a script (bash) or Slurm starts are not this process's children and are not in the log.
    print("| file | test s | processes started | their start-up, CPU s |\n|---|---|---|---|")
    for path in sorted(seconds, key=lambda p: -seconds[p]):
        if seconds[path] < 20:
            continue
        procs = ", ".join(f"{k} x{n}" for k, n in kinds[path].most_common())
        print(f"| {path} | {seconds[path]:.0f} | {procs or '-'} | {startup[path]:.0f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", help="write the measured prices here")
    p.add_argument("--map", action="store_true", help="print the per-file map from --log and --durations")
    p.add_argument("--log", help="a suite run's TEST_PROCESS_LOG file")
    p.add_argument("--durations", help="a suite run's TEST_DURATIONS_OUT file")
    p.add_argument("--prices", help="a --json file of an earlier measurement (default: measure now)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: give 1 or more")
    if args.map and not (args.log and args.durations):
        p.error("--map needs --log FILE (TEST_PROCESS_LOG) and --durations FILE (TEST_DURATIONS_OUT)")
    for flag, path in (("--log", args.log), ("--durations", args.durations), ("--prices", args.prices)):
        if path and not os.path.isfile(path):
            p.error(f"{flag} {path}: no such file")
    if args.prices:
        best = json.load(open(args.prices))
    else:
        best = measure(args.rounds)
        print_prices(best)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(best, f, indent=1)
    if args.map:
        print()
        print_map(args.log, args.durations, startup_prices(best))
    return 0


if __name__ == "__main__":
    sys.exit(main())
