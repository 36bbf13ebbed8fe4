#!/usr/bin/env python3
"""Train a SentencePiece tokenizer (BPE or unigram) from a JSONL corpus.

    python tools/train_tokenizer.py --input corpus.jsonl --vocab-size 32000 --model-prefix spm32k

writes spm32k.model and spm32k.vocab. Documents are cut at line ends into
training sentences of at most --max-sentence-length bytes, newlines kept, so
the model learns code and prose layout. SentencePiece samples at most
--input-sentence-size of them. Ids: unk 0, bos 1, eos 2 (our end of
document), pad 3, as Megatron-LM's SentencePiece tokenizers expect.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.atomic import WriteError, describe, write_bytes, write_text  # noqa: E402
from megatron_lite.data.jsonl import BadLine, open_input, parse_line, split_lines  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", required=True, help="JSONL, JSONL.gz or JSONL.zst, one JSON object per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys whose strings are training text")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    p.add_argument("--character-coverage", type=float, default=0.9995,
                   help="share of characters the vocabulary must cover; the rarest become bytes or unk")
    p.add_argument("--byte-fallback", action=argparse.BooleanOptionalAction, default=True,
                   help="encode uncovered characters as UTF-8 bytes instead of unk (adds 256 pieces)")
    p.add_argument("--input-sentence-size", type=int, default=2_000_000,
                   help="train on a random sample of at most this many sentences (0: all)")
    p.add_argument("--max-sentence-length", type=int, default=4096, help="bytes per training sentence")
    p.add_argument("--normalization-rule-name", default="identity",
                   help="SentencePiece normalization; identity keeps text (and whitespace) exactly")
    p.add_argument("--pad-id", type=int, default=3, help="-1 for no padding token")
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed-sentencepiece-size", type=int, default=1_000_000)
    return p


class SentenceStream:
    """Yields training sentences from the JSONL and counts what it read, for progress and the summary."""

    def __init__(self, path: str, json_keys, max_bytes: int) -> None:
        self.path, self.json_keys, self.max_bytes = path, json_keys, max_bytes
        self.documents = self.sentences = self.bytes = self.bad_lines = 0

    def _chunks(self, text: str):
        """Whole lines, packed up to max_bytes; a longer line is cut (SentencePiece drops over-long sentences)."""
        chunk, size = [], 0
        for line in text.splitlines(keepends=True):
            n = len(line.encode("utf-8"))
            if size + n > self.max_bytes and chunk:
                yield "".join(chunk)
                chunk, size = [], 0
            if n > self.max_bytes:
                yield line[: self.max_bytes // 4]  # 4 bytes per character at most in UTF-8
                continue
            chunk.append(line)
            size += n
        if chunk:
            yield "".join(chunk)

    def __iter__(self):
        self._next_report = time.monotonic() + 5.0
        lines, raw = open_input(self.path)
        with raw:
            for raw_line in lines:
                for line in split_lines(raw_line):
                    texts = parse_line(line, self.json_keys)
                    if isinstance(texts, BadLine):
                        self.bad_lines += 1
                        continue
                    self.documents += 1
                    for text in texts:
                        for sentence in self._chunks(text):
                            if sentence.strip():
                                self.sentences += 1
                                self.bytes += len(sentence)
                                yield sentence
                if time.monotonic() >= self._next_report:
                    self._next_report = time.monotonic() + 5.0
                    print(f"  read {self.documents} documents, {self.sentences} sentences, "
                          f"{self.bytes / 1e6:.1f} MB", file=sys.stderr, flush=True)


def vocab_text(model_proto: bytes) -> str:
    """The .vocab file SentencePiece would write: a line per piece, 'piece<TAB>score' (C++'s default float
    format, which %g reproduces)."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
    return "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.vocab_size()))


def publish(model_proto: bytes, model_prefix: str) -> None:
    """PREFIX.vocab, then PREFIX.model, each written atomically: the .model appearing last means both are there."""
    write_text(model_prefix + ".vocab", vocab_text(model_proto))
    try:
        write_bytes(model_prefix + ".model", model_proto)
    except WriteError:
        os.remove(model_prefix + ".vocab")
        raise


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not os.path.isfile(args.input):
        print(f"train_tokenizer.py: error: --input {args.input}: no such file", file=sys.stderr)
        return 2
    import sentencepiece

    stream = SentenceStream(args.input, args.json_keys, args.max_sentence_length)
    start = time.perf_counter()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.model_prefix)), exist_ok=True)
    except OSError as e:
        print(f"train_tokenizer.py: error: {WriteError(args.model_prefix + '.model', describe(e))}", file=sys.stderr)
        return 1
    # SentencePiece writing PREFIX.model itself says nothing when a write fails (a full disk left a truncated
    # .model behind an exit code of 0): it hands the model over in memory, and we write both files.
    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(stream), model_writer=model, vocab_size=args.vocab_size,
            model_type=args.model_type, character_coverage=args.character_coverage,
            byte_fallback=args.byte_fallback, input_sentence_size=args.input_sentence_size,
            shuffle_input_sentence=True, max_sentence_length=args.max_sentence_length,
            normalization_rule_name=args.normalization_rule_name, remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, split_digits=True,
            unk_id=0, bos_id=1, eos_id=2, pad_id=args.pad_id,
            num_threads=args.num_threads, seed_sentencepiece_size=args.seed_sentencepiece_size,
            minloglevel=2,  # pieces holding "\n" make it warn that the human-readable .vocab is ambiguous
        )
    except RuntimeError as e:
        print(f"train_tokenizer.py: error: SentencePiece could not train on {args.input}: {e}", file=sys.stderr)
        return 1
    if stream.documents == 0:
        print(f"train_tokenizer.py: error: {args.input} has no usable documents", file=sys.stderr)
        return 1
    try:
        publish(model.getvalue(), args.model_prefix)
    except WriteError as e:
        print(f"train_tokenizer.py: error: {e}; nothing was written", file=sys.stderr)
        return 1
    print(f"trained {args.model_type} vocab {args.vocab_size} on {stream.sentences} sentences "
          f"({stream.bytes / 1e6:.1f} MB) from {stream.documents} documents ({stream.bad_lines} bad lines) "
          f"in {time.perf_counter() - start:.1f}s -> {args.model_prefix}.model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
