#!/usr/bin/env python3
"""Benchmark preprocess_data.py at corpus scale: throughput per input format, and memory as the input grows.

1. MB/s of tools/preprocess_data.py (a fresh process, as a user runs it) on
   plain, .gz and .zst copies of one corpus, against bare SentencePiece
   encoding of the same texts with the same number of processes in this run
   (target: >= 0.95x for every format and worker count).
2. Peak memory of the tool's whole process tree (parent + workers: the sum of
   their RSS, and of their PSS, which counts shared pages once), sampled while
   it runs, at each of --memory-sizes-mb. It must not grow with the input.

    python benchmarks/bench_preprocess_scale.py                              # 200 MB, memory at 50 and 200 MB
    python benchmarks/bench_preprocess_scale.py --size-mb 4 --memory-sizes-mb 2 4   # a quick check

The corpus is the Python standard library's sources (tools/make_corpus.py,
about 30 MB), repeated to the size asked; the tokenizer is trained on it
first (not timed) unless --tokenizer-model is given.
"""
from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(REPO, "tools")
sys.path.insert(0, TOOLS)  # make_corpus, train_tokenizer

import make_corpus  # noqa: E402
# The same bare-SentencePiece baselines as bench_preprocess.py.
from bench_preprocess import _encode, _encode_arrays, _load  # noqa: E402
import train_tokenizer  # noqa: E402

FORMATS = ("plain", "gz", "zst")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size-mb", type=float, default=200, help="corpus size for the throughput runs (text bytes)")
    p.add_argument("--memory-sizes-mb", type=float, nargs="+", default=[50, 200],
                   help="input sizes at which peak memory is reported (the largest may equal --size-mb)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--repeats", type=int, default=1, help="best of this many timings")
    p.add_argument("--tokenizer-model", help="SentencePiece model (default: train one on the corpus)")
    p.add_argument("--vocab-size", type=int, default=8000, help="for the trained tokenizer")
    p.add_argument("--work-dir", help="keep the corpora here (default: a temporary folder, removed at the end)")
    p.add_argument("--sample-interval", type=float, default=0.25,
                   help="seconds between memory samples (each costs CPU the timed run shares)")
    return p


def make_inputs(base: str, folder: str, size_mb: float, formats) -> dict:
    """The base corpus's lines repeated until the text reaches size_mb; one file per format, written streaming."""
    target = int(size_mb * 1e6)
    stem = os.path.join(folder, f"corpus_{size_mb:g}mb.jsonl")
    paths = {"plain": stem, "gz": stem + ".gz", "zst": stem + ".zst"}
    if all(os.path.exists(paths[f]) for f in formats):
        return {f: paths[f] for f in formats}
    import zstandard

    text_bytes = 0
    with open(paths["plain"], "wb") as plain, gzip.open(paths["gz"], "wb", compresslevel=6) as gz, \
            open(paths["zst"], "wb") as zst_file, \
            zstandard.ZstdCompressor(level=3).stream_writer(zst_file, closefd=False) as zst:
        while text_bytes < target:
            with open(base, "rb") as f:
                for line in f:
                    for out in (plain, gz, zst):
                        out.write(line)
                    text_bytes += len(json.loads(line)["text"].encode("utf-8"))
                    if text_bytes >= target:
                        break
    return {f: paths[f] for f in formats}


def children_cpu() -> float:
    """CPU seconds of every finished descendant this process has waited for (a tool run includes its workers)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bare_sentencepiece(texts, model: str, workers: int, chunk: int = 64, arrays: bool = False) -> tuple:
    """(wall s, CPU s) to encode every text with `workers` processes; model load and pool start included, as in the tool.

    arrays=False is `sp.encode` returning lists of ints, as Megatron-LM calls it (the issue's baseline);
    arrays=True asks SentencePiece for numpy arrays instead, as the tool does.
    """
    encode = _encode_arrays if arrays else _encode
    start, cpu = time.perf_counter(), time.process_time() + children_cpu()
    chunks = [texts[i:i + chunk] for i in range(0, len(texts), chunk)]
    if workers == 1:
        _load(model)
        for c in chunks:
            encode(c)
    else:
        with multiprocessing.Pool(workers, initializer=_load, initargs=(model,)) as pool:
            for _ in pool.imap(encode, chunks):
                pass
    return time.perf_counter() - start, time.process_time() + children_cpu() - cpu


def process_tree(pid: int) -> list:
    tree, stack = [], [pid]
    while stack:
        p = stack.pop()
        tree.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                stack.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return tree


def memory_kb(pid: int) -> tuple:
    """(RSS, PSS, peak RSS so far) of one process in kB; zeros once it has gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            rollup = dict(line.split(":", 1) for line in f if line[0].isupper() and ":" in line)
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        return (int(rollup["Rss"].split()[0]), int(rollup["Pss"].split()[0]), int(status["VmHWM"].split()[0]))
    except (OSError, KeyError, ValueError):
        return 0, 0, 0


def run_tool(path: str, model: str, workers: int, out_dir: str, interval: float) -> tuple:
    """(wall s, CPU s, peak tree RSS MB, peak tree PSS MB, sum of per-process peak RSS MB) of one run.

    The sums are sampled; the last is the kernel's high-water mark of each process (parent and
    workers), an upper bound of the tree's peak that sampling cannot miss.
    """
    command = [sys.executable, os.path.join(TOOLS, "preprocess_data.py"), "--input", path, "--output-prefix",
               os.path.join(out_dir, "out"), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
               model, "--append-eod", "--workers", str(workers), "--log-interval", str(10 ** 12),
               "--overwrite"]  # the same prefix each run
    peak = [0, 0]
    high_water = {}
    start, cpu = time.perf_counter(), children_cpu()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def sample():
        while proc.poll() is None:
            sizes = {p: memory_kb(p) for p in process_tree(proc.pid)}
            peak[0] = max(peak[0], sum(s[0] for s in sizes.values()))
            peak[1] = max(peak[1], sum(s[1] for s in sizes.values()))
            for p, s in sizes.items():
                high_water[p] = max(high_water.get(p, 0), s[2])
            time.sleep(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"preprocess_data.py exited {proc.returncode}:\n{stderr}")
    return wall, children_cpu() - cpu, peak[0] / 1024, peak[1] / 1024, sum(high_water.values()) / 1024


def interpreter_start(model: str) -> float:
    """What a fresh tool process pays before reading input: interpreter, imports, tokenizer load."""
    code = ("import sys; sys.path.insert(0, %r); import numpy, sentencepiece; "
            "import megatron_lite.data.encode; sentencepiece.SentencePieceProcessor(model_file=%r)"
            % (REPO, model))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_preprocess_scale_") as scratch:
        work = args.work_dir or scratch
        os.makedirs(work, exist_ok=True)
        base = os.path.join(work, "stdlib.jsonl")
        if not os.path.exists(base):
            make_corpus.main(["--output", base, "--max-docs", "1000000", "--max-bytes", str(int(64e6))])
        model = args.tokenizer_model
        if model is None:
            model = os.path.join(work, "spm.model")
            if not os.path.exists(model):
                train_tokenizer.main(["--input", base, "--model-prefix", model[:-len(".model")],
                                      "--vocab-size", str(args.vocab_size), "--input-sentence-size", "300000"])
        sizes = sorted(set([args.size_mb] + list(args.memory_sizes_mb)))
        inputs = {size: make_inputs(base, work, size, args.formats) for size in sizes}
        on_disk = {size: {f: os.path.getsize(p) / 1e6 for f, p in paths.items()} for size, paths in inputs.items()}
        with open(make_inputs(base, work, args.size_mb, ["plain"])["plain"], encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f]
        mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
        startup = interpreter_start(model)
        print(f"\npreprocess_data vs bare SentencePiece encode: {len(texts)} documents, {mb:.1f} MB of text "
              f"(on disk: {', '.join(f'{f} {on_disk[args.size_mb][f]:.1f} MB' for f in args.formats)}), "
              f"best of {args.repeats}; the tool's time includes a fresh interpreter, imports and tokenizer load "
              f"({startup:.2f} s), the baseline's only the tokenizer load and pool start\n")
        # CPU seconds show the tool's overhead even on a busy machine, where wall times are noisy.
        print("Baselines: `sp.encode` (lists of ints, as Megatron-LM calls it; the target's baseline) and "
              "`sp.encode_as_numpy` (arrays, as the tool's workers call it).\n")
        print("| workers | bare encode MB/s | bare encode_as_numpy MB/s | format | preprocess_data MB/s "
              "| ratio to encode (wall) | ratio to encode (CPU s) | ratio to encode_as_numpy (wall) "
              "| peak tree RSS MB | peak tree PSS MB |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        memory = {}
        for workers in args.workers:
            bare, bare_arrays, tool = [], [], {f: [] for f in args.formats}
            for _ in range(args.repeats):  # interleaved, so baselines and tool see the same machine load
                bare.append(bare_sentencepiece(texts, model, workers))
                bare_arrays.append(bare_sentencepiece(texts, model, workers, arrays=True))
                for fmt in args.formats:
                    tool[fmt].append(run_tool(inputs[args.size_mb][fmt], model, workers, work, args.sample_interval))
            bare_wall, bare_cpu = min(t[0] for t in bare), min(t[1] for t in bare)
            arrays_wall = min(t[0] for t in bare_arrays)
            for fmt in args.formats:
                wall, cpu = min(t[0] for t in tool[fmt]), min(t[1] for t in tool[fmt])
                rss, pss, hwm = (max(t[i] for t in tool[fmt]) for i in (2, 3, 4))
                memory[(fmt, workers, args.size_mb)] = (rss, pss, hwm)
                print(f"| {workers} | {mb / bare_wall:.2f} | {mb / arrays_wall:.2f} | {fmt} | {mb / wall:.2f} "
                      f"| {bare_wall / wall:.2f}x | {bare_cpu / cpu:.2f}x | {arrays_wall / wall:.2f}x "
                      f"| {rss:.0f} | {pss:.0f} |", flush=True)
        del texts
        workers = max(args.workers)
        print(f"\npeak memory of the preprocess_data.py process tree, {workers} workers "
              f"(sampled every {args.sample_interval:g} s)\n")
        print("| format | input MB (text) | on disk MB | peak RSS MB | peak PSS MB | sum of per-process peak RSS MB |")
        print("|---|---|---|---|---|---|")
        for fmt in args.formats:
            for size in sizes:
                if size not in args.memory_sizes_mb:
                    continue
                if (fmt, workers, size) not in memory:
                    memory[(fmt, workers, size)] = run_tool(inputs[size][fmt], model, workers, work,
                                                            args.sample_interval)[2:]
                rss, pss, hwm = memory[(fmt, workers, size)]
                print(f"| {fmt} | {size:g} | {on_disk[size][fmt]:.1f} | {rss:.0f} | {pss:.0f} | {hwm:.0f} |",
                      flush=True)
            small, large = min(args.memory_sizes_mb), max(args.memory_sizes_mb)
            if small != large:
                growth = [memory[(fmt, workers, large)][i] / memory[(fmt, workers, small)][i] for i in range(3)]
                print(f"| {fmt} | {large:g} / {small:g} | | x{growth[0]:.2f} | x{growth[1]:.2f} | x{growth[2]:.2f} |")
    print(f"\nbenchmark done in {time.perf_counter() - begin:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
