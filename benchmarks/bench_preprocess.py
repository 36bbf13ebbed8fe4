#!/usr/bin/env python3
"""Benchmark the data pipeline against its baselines, in one run.

1. tools/preprocess_data.py throughput against bare SentencePiece encoding of
   the same texts with the same number of processes (target: >= 0.8x).
2. Building the sample index for 1B tokens (synthetic document lengths) with
   the C++ helper against the same computation in numpy.

    python benchmarks/bench_preprocess.py --workers 1 2

Without --input / --tokenizer-model it makes a corpus from the Python standard
library and trains a small tokenizer first (not timed).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
TOOLS = os.path.join(REPO, "tools")  # the tools it measures
sys.path.insert(0, TOOLS)

import numpy as np  # noqa: E402

import make_corpus  # noqa: E402
import preprocess_data  # noqa: E402
import train_tokenizer  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", help="JSONL corpus (default: stdlib sources, --corpus-bytes of them)")
    p.add_argument("--corpus-bytes", type=int, default=8 << 20)
    p.add_argument("--tokenizer-model", help="SentencePiece model (default: train one on the corpus)")
    p.add_argument("--vocab-size", type=int, default=8000, help="for the trained tokenizer")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3, help="best of this many timings")
    p.add_argument("--tokens", type=float, default=1e9, help="tokens for the sample-index benchmark")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--index-repeats", type=int, default=7, help="best of this many sample-index timings")
    p.add_argument("--skip-preprocess", action="store_true")
    p.add_argument("--skip-sample-index", action="store_true")
    return p


_sp = None


def _load(model: str) -> None:
    global _sp
    import sentencepiece

    _sp = sentencepiece.SentencePieceProcessor(model_file=model)


def _encode(texts) -> int:
    return sum(len(ids) for ids in _sp.encode(texts, num_threads=1))


def _encode_arrays(texts) -> int:
    """The same with SentencePiece's array output, which preprocess_data.py's workers use."""
    return sum(len(ids) for ids in _sp.encode_as_numpy(texts, num_threads=1))


def bare_sentencepiece(texts, model: str, workers: int, chunk: int) -> None:
    """Encode every text with `workers` processes; model loading and pool start included, as in the tool."""
    chunks = [texts[i:i + chunk] for i in range(0, len(texts), chunk)]
    if workers == 1:
        _load(model)
        for c in chunks:
            _encode(c)
        return
    with multiprocessing.Pool(workers, initializer=_load, initargs=(model,)) as pool:
        for _ in pool.imap(_encode, chunks):
            pass


def preprocess(path: str, model: str, workers: int, chunk: int, out_dir: str) -> None:
    argv = ["--input", path, "--output-prefix", os.path.join(out_dir, f"w{workers}"), "--tokenizer-type",
            "SentencePieceTokenizer", "--tokenizer-model", model, "--append-eod", "--workers", str(workers),
            "--chunk-documents", str(chunk), "--log-interval", str(10 ** 9),
            "--overwrite"]  # the same prefix each round
    with open(os.devnull, "w") as devnull:
        stdout, sys.stdout = sys.stdout, devnull
        try:
            status = preprocess_data.main(argv)
        finally:
            sys.stdout = stdout
    if status != 0:
        raise SystemExit(f"preprocess_data.py exited {status}")


def measure(fn, *args):
    """(wall seconds, CPU seconds of this process and the worker processes it waited for)."""
    def cpu():
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + children.ru_utime + children.ru_stime

    wall, used = time.perf_counter(), cpu()
    fn(*args)
    return time.perf_counter() - wall, cpu() - used


def bench_preprocess(args, work: str) -> None:
    path = args.input
    if path is None:
        path = os.path.join(work, "corpus.jsonl")
        make_corpus.main(["--output", path, "--max-docs", "100000", "--max-bytes", str(args.corpus_bytes)])
    model = args.tokenizer_model
    if model is None:
        train_tokenizer.main(["--input", path, "--model-prefix", os.path.join(work, "spm"),
                              "--vocab-size", str(args.vocab_size)])
        model = os.path.join(work, "spm.model")
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    chunk = 64  # preprocess_data.py's default --chunk-documents
    print(f"\npreprocess_data vs bare SentencePiece encode: {len(texts)} documents, {mb:.1f} MB of text, "
          f"best of {args.repeats}\n")
    # CPU seconds show the tool's overhead even on a busy machine, where wall times are noisy.
    print("| workers | bare SentencePiece MB/s | preprocess_data MB/s | ratio (wall) | ratio (CPU s) |")
    print("|---|---|---|---|---|")
    for workers in args.workers:
        bare, tool = [], []
        for _ in range(args.repeats):  # interleaved, so both see the same machine load
            bare.append(measure(bare_sentencepiece, texts, model, workers, chunk))
            tool.append(measure(preprocess, path, model, workers, chunk, work))
        bare_wall, tool_wall = min(t[0] for t in bare), min(t[0] for t in tool)
        bare_cpu, tool_cpu = min(t[1] for t in bare), min(t[1] for t in tool)
        print(f"| {workers} | {mb / bare_wall:.2f} | {mb / tool_wall:.2f} | {bare_wall / tool_wall:.2f}x "
              f"| {bare_cpu / tool_cpu:.2f}x |", flush=True)


def bench_sample_index(args) -> None:
    from megatron_lite.data import indices

    rng = np.random.RandomState(0)
    # Web-text-like document lengths: log-normal around ~600 tokens, clipped to [1, 100k].
    lengths = np.clip(rng.lognormal(6.0, 1.2, size=int(args.tokens / 600 * 1.1)), 1, 100_000).astype(np.int32)
    keep = np.searchsorted(np.cumsum(lengths, dtype=np.int64), int(args.tokens)) + 1
    lengths = lengths[:keep]
    document_index = rng.permutation(len(lengths)).astype(np.int32)
    total_tokens = int(lengths.sum(dtype=np.int64))
    num_samples = (total_tokens - 1) // args.seq_length
    timings = {}
    for name, fn in (("C++ helper", indices.build_sample_index), ("numpy", indices.build_sample_index_numpy)):
        best = float("inf")
        for _ in range(args.index_repeats):
            start = time.perf_counter()
            result = fn(lengths, document_index, args.seq_length, num_samples)
            best = min(best, time.perf_counter() - start)
        timings[name] = (best, result)
    same = np.array_equal(timings["C++ helper"][1], timings["numpy"][1])
    print(f"\nsample index: {total_tokens / 1e9:.2f}B tokens, {len(lengths)} documents, seq_length "
          f"{args.seq_length}, {num_samples} samples; results identical: {same}\n")
    print("| builder | seconds |")
    print("|---|---|")
    for name, (seconds, _) in timings.items():
        print(f"| {name} | {seconds:.3f} |")
    print(f"\nC++ / numpy speed-up: {timings['numpy'][0] / timings['C++ helper'][0]:.1f}x")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_preprocess_") as work:
        if not args.skip_preprocess:
            bench_preprocess(args, work)
        if not args.skip_sample_index:
            bench_sample_index(args)
    print(f"\nbenchmark done in {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
