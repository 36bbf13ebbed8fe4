"""Many short training runs in a row, to find start-up and exit hangs: world 4 (PP 2 x DP 2, ZeRO 1, gloo),
one DataLoader worker per rank, --save with --exit-interval (every other run with --async-save), and a
resume from the previous run's checkpoint. A run that has not ended within --timeout is a hang: every
rank's Python stack is dumped with py-spy (when installed) into the report before the run is killed.

    python benchmarks/stress_startup.py --runs 100 --report stress.jsonl

Prints one JSON line per run (index, seconds, exit code, hung, the stack dump file) and a summary line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "1",
         "--eval-interval", "1000", "--eval-iters", "1", "--num-workers", "1", "--make-vocab-size-divisible-by",
         "16", "--pipeline-model-parallel-size", "2", "--zero-stage", "1", "--distributed-backend", "gloo"]


def _tool(*args) -> None:
    subprocess.run([sys.executable, *args], cwd=REPO, check=True, capture_output=True)


def corpus(work: str) -> list:
    """Data flags for a small corpus made with the project's own tools."""
    jsonl = os.path.join(work, "corpus.jsonl")
    _tool("tools/make_corpus.py", "--output", jsonl, "--max-docs", "120")
    _tool("tools/train_tokenizer.py", "--input", jsonl, "--vocab-size", "400", "--model-prefix",
          os.path.join(work, "spm"))
    _tool("tools/preprocess_data.py", "--input", jsonl, "--output-prefix", os.path.join(work, "corpus"),
          "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", os.path.join(work, "spm.model"),
          "--append-eod", "--workers", "1")
    return ["--data-path", os.path.join(work, "corpus_text_document"), "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", os.path.join(work, "spm.model"), "--split", "90,10,0"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dump_stacks(pid: int, path: str) -> None:
    """py-spy dump of the launcher's every descendant, into `path`."""
    import psutil

    with open(path, "w") as out:
        for proc in [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True):
            out.write(f"=== pid {proc.pid}: {' '.join(proc.cmdline())[:200]}\n")
            if shutil.which("py-spy") is None:
                out.write("(py-spy is not installed)\n")
                continue
            result = subprocess.run(["py-spy", "dump", "--pid", str(proc.pid)], capture_output=True, text=True)
            out.write(result.stdout + result.stderr + "\n")


def one_run(index: int, data: list, save: str, timeout: float, work: str) -> dict:
    flags = MODEL + data + ["--train-iters", str(1000), "--save", save, "--load", save,
                            "--exit-interval", str(index + 1), "--save-interval", "1", "--seed", str(index)]
    if index % 2:
        flags.append("--async-save")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "pretrain_gpt.py", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    row = {"run": index, "async_save": bool(index % 2)}
    try:
        out, _ = proc.communicate(timeout=timeout)
        row.update(seconds=round(time.perf_counter() - start, 1), exit_code=proc.returncode, hung=False)
        if proc.returncode:
            log = os.path.join(work, f"run{index}.log")
            with open(log, "w") as f:
                f.write(out)
            row["log"] = log
    except subprocess.TimeoutExpired:
        stacks = os.path.join(work, f"hang{index}.txt")
        dump_stacks(proc.pid, stacks)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        row.update(seconds=round(time.perf_counter() - start, 1), exit_code=None, hung=True, stacks=stacks)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds after which a run counts as hung")
    p.add_argument("--report", default=None, help="also write the JSON lines here")
    p.add_argument("--work-dir", default=None)
    args = p.parse_args(argv)
    work = args.work_dir or tempfile.mkdtemp(prefix="stress-")
    data = corpus(work)
    save = os.path.join(work, "ckpt")
    rows = []
    report = open(args.report, "w") if args.report else None
    for index in range(args.runs):
        row = one_run(index, data, save, args.timeout, work)
        rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        if report:
            report.write(line + "\n")
            report.flush()
    hung = [r["run"] for r in rows if r["hung"]]
    failed = [r["run"] for r in rows if not r["hung"] and r["exit_code"]]
    seconds = sorted(r["seconds"] for r in rows)
    summary = {"runs": len(rows), "hung": hung, "failed": failed, "median_seconds": seconds[len(seconds) // 2],
               "max_seconds": seconds[-1], "work_dir": work}
    print(json.dumps({"summary": summary}), flush=True)
    return 1 if hung or failed else 0


if __name__ == "__main__":
    sys.exit(main())
