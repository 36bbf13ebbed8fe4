#!/usr/bin/env python3
"""Tokenize a JSONL corpus into Megatron-format .bin/.idx files.

    python tools/preprocess_data.py --input 'corpus/*.jsonl.zst' --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model spm32k.model --append-eod --workers 8

(or --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt, or
--tokenizer-type HuggingFaceTokenizer --tokenizer-model FOLDER_OR_tokenizer.json)
writes data/corpus_text_document.{bin,idx}, byte-identical to Megatron-LM's
tools/preprocess_data.py for the same input and tokenizer, readable by Megatron-LM,
Megatron-DeepSpeed and GPT-NeoX, and data/corpus_text_document.json, which
records the tokenizer, dtype and counts. Input: files or globs (a glob's
matches sorted), one JSON object per line, plain, .gz or .zst, read streaming.
The parent reads and cuts the input into blocks of whole lines; workers split,
parse and tokenize the blocks in parallel; the parent writes them in input
order. Bad lines (invalid UTF-8 or JSON, a missing key, a non-string value) are
skipped and counted, the first few named.

With --num-shards N --shard-index i, only the i-th of N contiguous parts of
the input is read (whole files, or line-aligned byte ranges of a large plain
file) and the output is PREFIX_text_document.shard-0000i-of-0000N.{bin,idx,json};
tools/merge_datasets.py joins the shards into what one run would have written.

An existing output is refused unless --overwrite (each file is then replaced
whole, the sidecar last). Exit status: 0 when the files were written (bad
lines, if any, skipped); 1 when --strict met a bad line, a compressed file was
corrupt, or no line held a document (nothing written; a shard without
documents is written empty); 2 for unusable arguments (a number out of range,
an existing output, missing input or tokenizer file, bad shard flags), said in
one line naming the flag before anything is read or written.
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.atomic import WriteError, describe  # noqa: E402
from megatron_lite.data.encode import ChunkEncoder, encode_in_worker, init_worker  # noqa: E402
from megatron_lite.data.indexed_dataset import IndexedDatasetWriter, token_dtype  # noqa: E402
from megatron_lite.data.input_files import (  # noqa: E402
    InputError, PieceReader, expand_inputs, input_fingerprint, shard_pieces, whole_files,
)
from megatron_lite.data.jsonl import ZSTD_SUFFIXES, line_blocks  # noqa: E402
from megatron_lite.data.sidecar import (  # noqa: E402
    describe_outputs, remove_outputs, shard_prefix, sidecar_path, tokenizer_identity, tokenizer_sha256, write_sidecar,
)
from megatron_lite.data.tokenizer import TOKENIZER_FILE_FIELDS, TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from megatron_lite.flag_numbers import add_number  # noqa: E402
from megatron_lite.targets import OVERWRITE_HELP, target_problem  # noqa: E402

REPORTED_BAD_LINES = 5
MAX_WORKERS = 1024  # more tokenizer processes than any node has cores is a typo


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=os.path.basename(__file__), description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, nargs="+",
                   help="JSONL files or globs (quote them), plain, .gz or .zst; read in the order given, "
                        "a glob's matches sorted")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize; one output pair per key")
    g.add_argument("--strict", action="store_true", help="stop at the first bad line instead of skipping it")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece .model file; for HuggingFaceTokenizer a Hugging Face tokenizer folder or its "
                        "tokenizer.json")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: GPT-2-style vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: GPT-2-style merges.txt")
    add_number(g, "--vocab-size", minimum=2, default=None, example=32000,
               help="for NullTokenizer: ids 0 to vocab size - 1, the last one end of document")
    g.add_argument("--append-eod", action="store_true", help="end every non-empty document with the eod id")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx/.json")
    g.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    g = p.add_argument_group("sharding (one part of the input per process, node or Slurm array task)")
    add_number(g, "--num-shards", minimum=1, default=None, example=8, help="split the input into this many parts")
    add_number(g, "--shard-index", minimum=0, default=None, example=0,
               help="the part this run processes, from 0 to --num-shards - 1")
    g = p.add_argument_group("runtime")
    add_number(g, "--workers", minimum=1, maximum=MAX_WORKERS, default=1, help="tokenizer processes")
    add_number(g, "--chunk-documents", minimum=1, default=64,
               help="lines sent to a worker at a time (fewer when they pass 4 MiB)")
    add_number(g, "--log-interval", minimum=1, default=1000, help="report progress every this many documents")
    return p


def read_chunks(pieces, chunk_documents: int, chunk_bytes: int = 4 << 20):
    """Yields (block, (piece, input bytes done)); a block holds up to chunk_documents whole lines of one piece.

    The workers split blocks into lines: handing over one bytes object per block,
    instead of a list of lines, keeps the reading process's share of the CPU small.
    """
    done = 0
    for piece in pieces:
        text_bytes = 0
        try:
            with PieceReader(piece) as reader:
                for block in line_blocks(reader.blocks(chunk_bytes), chunk_documents, chunk_bytes):
                    text_bytes += len(block)
                    yield block, (piece, done + reader.consumed())
        except read_errors() as e:
            # A byte offset, not a line number: counting lines here would cost the reader a pass over the text.
            raise BadInput(f"{piece.path}: cannot be read after the first {text_bytes} bytes of its text "
                           f"({type(e).__name__}: {e}); nothing written") from None
        done += piece.size


def read_errors() -> tuple:
    """What a damaged input raises: I/O errors, a truncated or corrupt gzip or zstd stream."""
    try:
        from zstandard import ZstdError
    except ImportError:
        return OSError, EOFError, zlib.error
    return OSError, EOFError, zlib.error, ZstdError


def encoded_chunks(chunks, workers: int, encoder_args):
    """(encoded chunk, its tag) in input order; with workers > 1 a bounded number are in flight, so memory stays flat."""
    if workers == 1:
        encoder = ChunkEncoder(*encoder_args)
        for chunk, tag in chunks:
            yield encoder(chunk), tag
        return
    with multiprocessing.Pool(workers, initializer=init_worker, initargs=encoder_args) as pool:
        pending = collections.deque()
        for chunk, tag in chunks:
            pending.append((pool.apply_async(encode_in_worker, (chunk,)), tag))
            if len(pending) >= 4 * workers:
                result, tag = pending.popleft()
                yield result.get(), tag
        while pending:
            result, tag = pending.popleft()
            yield result.get(), tag


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

    def maybe_log(self, bytes_done: int) -> None:
        """bytes_done: input bytes on disk (compressed, for compressed files) read so far, over all files."""
        if self.documents < self.next_log:
            return
        self.next_log = (self.documents // self.log_interval + 1) * self.log_interval
        elapsed = time.perf_counter() - self.start
        done = bytes_done / self.total_bytes if self.total_bytes else 1.0
        eta = elapsed * (1 - done) / done if done > 0 else 0.0
        print(f"processed {self.documents} documents ({self.rate()}), {bytes_done / 1e6:.1f} of "
              f"{self.total_bytes / 1e6:.1f} MB of input ({100 * done:.1f}%), "
              f"ETA {int(eta) // 60}:{int(eta) % 60:02d}", file=sys.stderr, flush=True)


def usage_error(message: str) -> int:
    print(f"preprocess_data.py: error: {message}", file=sys.stderr)
    return 2


def write_error(error: WriteError) -> int:
    print(f"preprocess_data.py: error: {error}; nothing was written", file=sys.stderr)
    return 1


def publish(args, datasets, prefixes, writers, identity, dtype, progress, files, pieces, sharded) -> None:
    """Each output's .bin/.idx, then its sidecar, which marks it complete. A failure leaves no output of
    this run under a final name."""
    published = []
    try:
        for prefix in prefixes:
            if os.path.exists(sidecar_path(prefix)):
                os.remove(sidecar_path(prefix))  # a rerun's new pair must never sit beside the old run's record
        for key, dataset, prefix, writer in zip(args.json_keys, datasets, prefixes, writers):
            writer.finalize()
            published.append(prefix)
            write_sidecar(prefix, {
                "dataset": os.path.basename(dataset), "json_key": key, "tokenizer": identity, "dtype": str(dtype),
                "documents": progress.documents, "sequences": writer.num_sequences, "tokens": writer.num_tokens,
                "bad_lines": progress.bad_lines,
                "shard": ({"index": args.shard_index, "count": args.num_shards,
                           "input_fingerprint": input_fingerprint(files), "input_files": len(files),
                           "pieces": [[p.path, p.start, p.end] for p in pieces]} if sharded else None),
                **describe_outputs(prefix),
            })
    except (WriteError, OSError) as e:
        for writer in writers[len(published):]:
            writer.abort()
        for prefix in published:
            remove_outputs(prefix)
        if isinstance(e, WriteError):
            raise
        raise WriteError(sidecar_path(prefixes[0]), describe(e)) from None


def output_prefixes(args, sharded: bool):
    """(dataset prefixes, the prefixes this run writes: the shard's names when sharded), one per JSON key."""
    datasets = [f"{args.output_prefix}_{key}_document" for key in args.json_keys]
    return datasets, [shard_prefix(d, args.shard_index, args.num_shards) if sharded else d for d in datasets]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    sharded = args.num_shards is not None or args.shard_index is not None
    if sharded and (args.num_shards is None or args.shard_index is None):
        return usage_error("--num-shards and --shard-index go together (e.g. --num-shards 8 --shard-index 0)")
    if sharded and args.shard_index >= args.num_shards:
        return usage_error(f"--shard-index {args.shard_index} is outside [0, --num-shards {args.num_shards}); "
                           f"give 0 to {args.num_shards - 1}")
    datasets, prefixes = output_prefixes(args, sharded)
    outputs = [prefix + suffix for prefix in prefixes for suffix in (".bin", ".idx", ".json")]
    problem = target_problem("--output-prefix", args.output_prefix, outputs, args.overwrite)
    if problem:
        return usage_error(problem)
    try:
        files = expand_inputs(args.input)
        pieces = shard_pieces(files, args.num_shards, args.shard_index) if sharded else whole_files(files)
    except InputError as e:
        return usage_error(str(e))
    if any(p.endswith(ZSTD_SUFFIXES) for p in files):
        try:
            import zstandard  # noqa: F401
        except ImportError:
            return usage_error("reading .zst input needs the zstandard package: pip install zstandard")
    for field in ("tokenizer_model", "vocab_file", "merge_file"):
        if getattr(args, field) and field not in TOKENIZER_FILE_FIELDS[args.tokenizer_type]:
            return usage_error(f"--{field.replace('_', '-')} {getattr(args, field)} is not read by --tokenizer-type "
                               f"{args.tokenizer_type}; drop it or give the type that reads it")
    tokenizer_args = (args.tokenizer_type, args.tokenizer_model, args.vocab_size, args.vocab_file, args.merge_file)
    try:
        tokenizer = build_tokenizer(*tokenizer_args)
        files_sha256 = tokenizer_sha256(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file)
    except (OSError, ValueError) as e:
        return usage_error(str(e))
    if args.append_eod and tokenizer.eod < 0:
        return usage_error(f"--append-eod needs an end-of-document token, but the tokenizer names none (a "
                           f"HuggingFaceTokenizer's eos_token comes from the tokenizer_config.json or "
                           f"special_tokens_map.json beside its tokenizer.json); drop --append-eod or add one")
    dtype = token_dtype(tokenizer.vocab_size)
    identity = tokenizer_identity(tokenizer, args.tokenizer_type, files_sha256, args.append_eod)
    encoder_args = (tokenizer_args, args.json_keys, args.append_eod, dtype)
    writers = []
    try:
        for prefix in prefixes:
            writers.append(IndexedDatasetWriter(prefix, dtype))
    except WriteError as e:
        for writer in writers:
            writer.abort()
        return write_error(e)
    progress = Progress(sum(p.size for p in pieces), args.log_interval)
    current, lines_before = None, 0  # line numbers count from 1 within each piece
    try:
        for encoded, (piece, bytes_done) in encoded_chunks(read_chunks(pieces, args.chunk_documents),
                                                           args.workers, encoder_args):
            if piece is not current:
                current, lines_before = piece, 0
            for number, reason in encoded.bad_lines:
                if args.strict:
                    raise BadInput(f"{piece.label(lines_before + number)}: {reason} (--strict); nothing written")
                progress.bad_lines += 1
                if progress.bad_lines <= REPORTED_BAD_LINES:
                    print(f"skipping {piece.label(lines_before + number)}: {reason}", file=sys.stderr)
            lines_before += encoded.lines
            for writer, token_bytes, lengths in zip(writers, encoded.token_bytes, encoded.document_lengths):
                writer.add_documents(token_bytes, lengths)
            progress.documents += len(encoded.document_lengths[0])
            progress.tokens += sum(len(b) for b in encoded.token_bytes) // dtype.itemsize
            progress.input_bytes += encoded.input_bytes
            progress.maybe_log(bytes_done)
        if progress.documents == 0 and not sharded:
            raise BadInput(f"{', '.join(args.input)}: no line held a document ({progress.bad_lines} bad lines); "
                           f"nothing written")
    except BadInput as e:
        for writer in writers:
            writer.abort()
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return 1
    except WriteError as e:
        for writer in writers:
            writer.abort()
        return write_error(e)
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    try:
        publish(args, datasets, prefixes, writers, identity, dtype, progress, files, pieces, sharded)
    except WriteError as e:
        return write_error(e)
    elapsed = time.perf_counter() - progress.start
    part = f"shard {args.shard_index} of {args.num_shards} ({len(pieces)} pieces of {len(files)} files): " \
        if sharded else ""
    print(f"{part}wrote {progress.documents} documents, {progress.tokens} tokens ({dtype}) to "
          f"{', '.join(p + '.{bin,idx,json}' for p in prefixes)}; {progress.bad_lines} bad lines skipped; "
          f"{elapsed:.1f}s, {progress.rate()}")
    return 0


class BadInput(Exception):
    """Stops the run without output: --strict met a bad line, a corrupt file, or the input had no documents."""


if __name__ == "__main__":
    sys.exit(main())
