"""Does Muon help? The quickstart's model and data, trained for the same steps and tokens with AdamW and with
--optimizer muon, each at a small sweep of learning rates: final training and validation loss, step time and
the optimizer step's share of it.

Each (AdamW rate i, Muon rate i) pair runs back to back, so the step-time ratio of a pair is measured in the
same stretch of this VM's drift (docs/benchmarks.md: 10-40% within minutes); the ratio reported is the median
over pairs. Losses do not drift: they are the same on a rerun. Everything is read from each run's
metrics.jsonl (training/records.py), not from its console.

Needs the quickstart's data (bash scripts/quickstart.sh once, or --data-prefix / --tokenizer-model):

    python benchmarks/bench_muon.py                       # 100 steps, 3 rates each (about 8 minutes here)
    python benchmarks/bench_muon.py --iters 20 --adam-lrs 2e-3 --muon-lrs 2e-3 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_lite.atomic import write_text  # noqa: E402
from megatron_lite.training.records import FILE_NAME, read_records  # noqa: E402

# scripts/quickstart.sh's model and schedule, but --lr / --min-lr (a tenth of it) per run.
QUICKSTART = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
              "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
              "--micro-batch-size", "4", "--global-batch-size", "32", "--lr-decay-style", "cosine",
              "--clip-grad", "1.0", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
              "--tokenizer-type", "SentencePieceTokenizer", "--split", "98,2,0", "--num-workers", "0",
              "--log-interval", "10", "--eval-iters", "4", "--timing-breakdown"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(optimizer: str, lr: float, iters: int, data: str, tokenizer: str, folder: str) -> dict:
    """One training run; its numbers from metrics.jsonl."""
    flags = QUICKSTART + ["--optimizer", optimizer, "--lr", str(lr), "--min-lr", str(lr / 10),
                          "--lr-warmup-iters", str(max(iters * 15 // 100, 1)), "--train-iters", str(iters),
                          "--eval-interval", str(iters), "--data-path", data, "--tokenizer-model", tokenizer,
                          "--tensorboard-dir", folder]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()),
               os.path.join(ROOT, "pretrain_gpt.py"), *flags]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{optimizer} at lr {lr} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = read_records(os.path.join(folder, FILE_NAME))
    summary = [r for r in records if r["kind"] == "summary"][-1]
    intervals = [r for r in records if r["kind"] == "interval"][1:]  # the first holds the start-up
    timings = [r["ms_per_iteration"] for r in records if r["kind"] == "stage_timing"][1:]
    step_ms = statistics.median(r["ms_per_iteration"] for r in intervals)
    # The optimizer step of each stage, per iteration, from --timing-breakdown (stage_timing.py).
    optimizer_ms = max(statistics.median(r[key] for r in timings)
                       for key in timings[-1] if key.endswith("/optimizer"))
    return {"optimizer": optimizer, "lr": lr, "train_loss": summary["last_loss"],
            "validation_loss": summary["validation_loss"], "step_ms": step_ms, "optimizer_ms": optimizer_ms,
            "optimizer_share": optimizer_ms / step_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--adam-lrs", type=float, nargs="+", default=[1e-3, 2e-3, 4e-3])
    parser.add_argument("--muon-lrs", type=float, nargs="+", default=[2e-3, 4e-3, 8e-3])
    parser.add_argument("--data-prefix", default=os.path.join(ROOT, "quickstart", "corpus_text_document"))
    parser.add_argument("--tokenizer-model", default=os.path.join(ROOT, "quickstart", "spm.model"))
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.iters < 20:  # step times come from the log intervals (10 iterations each) after the first
        parser.error(f"--iters {args.iters}: at least 20, two log intervals of 10 (the first holds the start-up)")
    if len(args.adam_lrs) != len(args.muon_lrs):
        parser.error("--adam-lrs and --muon-lrs pair up: give as many of each")
    for path in (args.data_prefix + ".idx", args.tokenizer_model):
        if not os.path.exists(path):
            parser.error(f"{path} is missing: run bash scripts/quickstart.sh once, or give --data-prefix and "
                         f"--tokenizer-model")
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for i, (adam_lr, muon_lr) in enumerate(zip(args.adam_lrs, args.muon_lrs)):
            for optimizer, lr in (("adam", adam_lr), ("muon", muon_lr)) if i % 2 == 0 else \
                    (("muon", muon_lr), ("adam", adam_lr)):
                result = run(optimizer, lr, args.iters, args.data_prefix, args.tokenizer_model,
                             os.path.join(scratch, f"{optimizer}-{lr}"))
                result["pair"] = i
                results.append(result)
                print(f"{optimizer:5s} lr {lr:g}: train {result['train_loss']:.4f}, validation "
                      f"{result['validation_loss']:.4f}, {result['step_ms']:.1f} ms/step, optimizer "
                      f"{result['optimizer_ms']:.2f} ms ({100 * result['optimizer_share']:.1f}%)", flush=True)
    best = {name: min((r for r in results if r["optimizer"] == name), key=lambda r: r["validation_loss"])
            for name in ("adam", "muon")}
    ratios = [next(r for r in results if r["pair"] == i and r["optimizer"] == "muon")["step_ms"] /
              next(r for r in results if r["pair"] == i and r["optimizer"] == "adam")["step_ms"]
              for i in range(len(args.adam_lrs))]
    print(f"\nbest: AdamW lr {best['adam']['lr']:g} validation {best['adam']['validation_loss']:.4f}; Muon lr "
          f"{best['muon']['lr']:g} validation {best['muon']['validation_loss']:.4f} "
          f"({best['muon']['validation_loss'] - best['adam']['validation_loss']:+.4f})")
    print(f"step time Muon / AdamW, median of {len(ratios)} back-to-back pairs: {statistics.median(ratios):.3f} "
          f"(pairs: {', '.join(f'{r:.3f}' for r in ratios)})")
    if args.json:  # published whole or not at all, as every writer here (megatron_lite/atomic.py)
        write_text(args.json, json.dumps({"iters": args.iters, "runs": results, "best": best,
                                          "step_time_ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
