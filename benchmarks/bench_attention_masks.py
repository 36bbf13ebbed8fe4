"""What document masking and sliding windows cost in a training step, against the plain causal step.

    python benchmarks/bench_attention_masks.py [--rounds 5] [--baseline-repo /path/to/previous/checkout]

One training step (forward, backward, AdamW) of a small GPT (4 layers, hidden 256, 4 heads, micro batch 2,
seq 1024, fp32, RoPE) in one process, timed for:
  plain      causal attention (the flags off);
  documents  --reset-attention-mask --reset-position-ids on samples of about 8 documents each;
  window     --window-size 127 (every layer);
each on SDPA and on the fused softmax. Every variant runs in a fresh interpreter per round, and the rounds
interleave the variants (this VM drifts 10-40% within minutes); a variant's time is its median step over
rounds of each round's median. Ratios are against `plain` of the same backend. With --baseline-repo, the
plain step is also timed on that checkout (e.g. the commit before these flags) in the same rounds:
`plain vs baseline` is the price of the feature to runs that do not use it.

Masked blocks are not skipped on either path: SDPA takes the explicit [b, 1, s, s] mask and computes every
block, the fused softmax reads the mask per row after the full score matmul; so the attention FLOPs of a
masked step are the plain step's, and the difference measured is building the mask, reading it, and the
per-sample rotary tables.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "1024",
         "--vocab-size", "1024", "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "2",
         "--global-batch-size", "2", "--position-embedding-type", "rope", "--seed", "3"]
VARIANTS = {"plain": [], "documents": ["--reset-attention-mask", "--reset-position-ids"],
            "window": ["--window-size", "127"]}
DOCUMENTS_PER_SAMPLE = 8


def child(variant: str, backend: str, steps: int) -> None:
    """Time `steps` training steps (after two warm-up steps) in this process; print their seconds as JSON."""
    import torch

    from megatron_lite.arguments import parse_args
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    config = parse_args(SHAPE + ["--attention-backend", backend] + VARIANTS[variant], world_size=1)[0]
    model = GPTModel(config).train()
    model_parallel_seed(config.training.seed, config.model.num_layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    b, s, vocab = config.batch.micro_batch_size, config.model.seq_length, config.model.vocab_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab - 1, (b, s + 1), generator=g)
    eod = vocab - 1
    for row in tokens:  # about DOCUMENTS_PER_SAMPLE documents of random lengths
        row[torch.randperm(s, generator=g)[:DOCUMENTS_PER_SAMPLE - 1]] = eod
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(s).expand(b, s)
    kwargs = {}
    if variant == "documents":
        from megatron_lite.data.documents import document_ids, positions_in_documents

        ids = torch.stack([torch.from_numpy(document_ids(r.numpy(), eod)) for r in inputs])
        positions = torch.stack([torch.from_numpy(positions_in_documents(r.numpy())) for r in ids])
        kwargs["document_ids"] = ids
    mask = torch.ones(b, s)
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(inputs, positions, labels, mask, **kwargs).backward()
        optimizer.step()
        if step >= 2:
            times.append(time.perf_counter() - start)
    print(json.dumps(times))


def run(repo: str, variant: str, backend: str, steps: int) -> float:
    env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS=os.environ.get("BENCH_THREADS", "2"))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", variant, backend, str(steps)],
                         env=env, cwd=repo, capture_output=True, text=True, check=True)
    return statistics.median(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant and round")
    parser.add_argument("--backends", nargs="+", default=["sdpa", "fused"])
    parser.add_argument("--baseline-repo", default=None, help="a checkout to time the plain step on too")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return 0
    runs = [(REPO, v, b) for b in args.backends for v in VARIANTS]
    if args.baseline_repo:
        runs += [(os.path.abspath(args.baseline_repo), "plain", b) for b in args.backends]
    seconds = {run_: [] for run_ in runs}
    for round_ in range(args.rounds):
        order = runs if round_ % 2 == 0 else runs[::-1]  # alternate the order: drift hits every variant alike
        for run_ in order:
            seconds[run_].append(run(*run_, args.steps))
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"one training step, seq 1024, micro batch 2, {DOCUMENTS_PER_SAMPLE} documents per sample, "
          f"median of {args.rounds} interleaved rounds")
    print("| backend | variant | ms per step | vs plain |")
    print("|---|---|---|---|")
    for backend in args.backends:
        plain = statistics.median(seconds[(REPO, "plain", backend)])
        for repo, variant, b in runs:
            if b != backend:
                continue
            median = statistics.median(seconds[(repo, variant, b)])
            name = variant if repo == REPO else f"plain on {os.path.basename(repo)} (baseline)"
            print(f"| {backend} | {name} | {median * 1e3:.0f} | {median / plain:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
