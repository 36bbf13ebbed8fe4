#!/usr/bin/env python3
"""Tokenize a JSONL corpus into Megatron-format .bin/.idx files.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model spm32k.model --append-eod --workers 8

writes data/corpus_text_document.{bin,idx}, byte-identical to Megatron-LM's
tools/preprocess_data.py for the same input and model, readable by Megatron-LM,
Megatron-DeepSpeed and GPT-NeoX. Input: one JSON object per line, plain or .gz.
Workers tokenize chunks of lines in parallel; the parent writes them in input
order. Bad lines (invalid UTF-8 or JSON, a missing key, a non-string value) are
skipped and counted, the first few named by line number.

Exit status: 0 when the files were written (bad lines, if any, skipped);
1 when --strict met a bad line or no line held a document (nothing written);
2 for unusable arguments (missing input or tokenizer model).
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.data.encode import ChunkEncoder, encode_in_worker, init_worker  # noqa: E402
from megatron_lite.data.indexed_dataset import IndexedDatasetWriter, token_dtype  # noqa: E402
from megatron_lite.data.jsonl import open_input, physical_lines  # noqa: E402
from megatron_lite.data.tokenizer import SENTENCEPIECE_TYPES, build_tokenizer  # noqa: E402

REPORTED_BAD_LINES = 5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, help="JSONL file (.jsonl or .jsonl.gz)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize; one output pair per key")
    g.add_argument("--strict", action="store_true", help="stop at the first bad line instead of skipping it")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=SENTENCEPIECE_TYPES + ("NullTokenizer",))
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece .model file")
    g.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    g.add_argument("--append-eod", action="store_true", help="end every non-empty document with the eod id")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--chunk-documents", type=int, default=64, help="lines sent to a worker at a time")
    g.add_argument("--log-interval", type=int, default=1000, help="report progress every this many documents")
    return p


def read_chunks(path: str, chunk_documents: int, chunk_bytes: int = 4 << 20):
    """Yields lists of (line number, line bytes); line numbers count from 1 as an editor does."""
    lines, raw = open_input(path)
    with raw:
        chunk, size, number = [], 0, 0
        for raw_line in lines:
            for line in physical_lines(raw_line):
                number += 1
                chunk.append((number, line))
                size += len(line)
            if len(chunk) >= chunk_documents or size >= chunk_bytes:
                yield chunk, raw.tell()
                chunk, size = [], 0
        if chunk:
            yield chunk, raw.tell()


def encoded_chunks(chunks, workers: int, encoder_args):
    """Encoded chunks in input order; with workers > 1 a bounded number are in flight, so memory stays flat."""
    if workers == 1:
        encoder = ChunkEncoder(*encoder_args)
        for chunk, position in chunks:
            yield encoder(chunk), position
        return
    with multiprocessing.Pool(workers, initializer=init_worker, initargs=encoder_args) as pool:
        pending = collections.deque()
        for chunk, position in chunks:
            pending.append((pool.apply_async(encode_in_worker, (chunk,)), position))
            if len(pending) >= 4 * workers:
                result, at = pending.popleft()
                yield result.get(), at
        while pending:
            result, at = pending.popleft()
            yield result.get(), at


class Progress:
    def __init__(self, total_bytes: int, log_interval: int) -> None:
        self.start = time.perf_counter()
        self.total_bytes = total_bytes
        self.log_interval = log_interval
        self.next_log = log_interval
        self.documents = self.tokens = self.bad_lines = self.input_bytes = 0

    def rate(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return f"{self.documents / elapsed:.0f} docs/s, {self.input_bytes / elapsed / 1e6:.2f} MB/s"

    def maybe_log(self, file_position: int) -> None:
        if self.documents < self.next_log:
            return
        self.next_log = (self.documents // self.log_interval + 1) * self.log_interval
        elapsed = time.perf_counter() - self.start
        done = file_position / self.total_bytes if self.total_bytes else 1.0
        eta = elapsed * (1 - done) / done if done > 0 else 0.0
        print(f"processed {self.documents} documents ({self.rate()}), {100 * done:.1f}% of input, "
              f"ETA {int(eta) // 60}:{int(eta) % 60:02d}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not os.path.isfile(args.input):
        print(f"preprocess_data.py: error: --input {args.input}: no such file", file=sys.stderr)
        return 2
    if args.workers < 1 or args.chunk_documents < 1 or args.log_interval < 1:
        print("preprocess_data.py: error: --workers, --chunk-documents and --log-interval must be at least 1",
              file=sys.stderr)
        return 2
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    except (OSError, ValueError) as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return 2
    dtype = token_dtype(tokenizer.vocab_size)
    encoder_args = (args.tokenizer_type, args.tokenizer_model, args.vocab_size, args.json_keys, args.append_eod, dtype)
    prefixes = [f"{args.output_prefix}_{key}_document" for key in args.json_keys]
    writers = [IndexedDatasetWriter(prefix, dtype) for prefix in prefixes]
    progress = Progress(os.path.getsize(args.input), args.log_interval)
    try:
        for encoded, position in encoded_chunks(read_chunks(args.input, args.chunk_documents),
                                                args.workers, encoder_args):
            for number, reason in encoded.bad_lines:
                if args.strict:
                    raise BadInput(f"{args.input}:{number}: {reason} (--strict); nothing written")
                progress.bad_lines += 1
                if progress.bad_lines <= REPORTED_BAD_LINES:
                    print(f"skipping {args.input}:{number}: {reason}", file=sys.stderr)
            for writer, token_bytes, lengths in zip(writers, encoded.token_bytes, encoded.document_lengths):
                writer.add_documents(token_bytes, lengths)
            progress.documents += len(encoded.document_lengths[0])
            progress.tokens += sum(len(b) for b in encoded.token_bytes) // dtype.itemsize
            progress.input_bytes += encoded.input_bytes
            progress.maybe_log(position)
        if progress.documents == 0:
            raise BadInput(f"{args.input}: no line held a document ({progress.bad_lines} bad lines); nothing written")
    except BadInput as e:
        for writer in writers:
            writer.abort()
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return 1
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    for writer in writers:
        writer.finalize()
    elapsed = time.perf_counter() - progress.start
    print(f"wrote {progress.documents} documents, {progress.tokens} tokens ({dtype}) to "
          f"{', '.join(p + '.{bin,idx}' for p in prefixes)}; {progress.bad_lines} bad lines skipped; "
          f"{elapsed:.1f}s, {progress.rate()}")
    return 0


class BadInput(Exception):
    """Stops the run without output: --strict met a bad line, or the input had no documents."""


if __name__ == "__main__":
    sys.exit(main())
