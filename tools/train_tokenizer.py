#!/usr/bin/env python3
"""Train a tokenizer from a JSONL corpus: SentencePiece (BPE or unigram), or GPT-2's byte-level BPE.

    python tools/train_tokenizer.py --input corpus.jsonl --vocab-size 32000 --model-prefix spm32k

writes spm32k.model and spm32k.vocab. Documents are cut at line ends into
training sentences of at most --max-sentence-length bytes, newlines kept, so
the model learns code and prose layout. SentencePiece samples at most
--input-sentence-size of them. Ids: unk 0, bos 1, eos 2 (our end of
document), pad 3, as Megatron-LM's SentencePiece tokenizers expect.

    python tools/train_tokenizer.py --input corpus.jsonl --vocab-size 32000 --model-type byte-level-bpe \\
        --model-prefix bpe32k

trains with Hugging Face's `tokenizers` (GPT-2's pre-tokenizer, the 256 bytes
as the alphabet, <|endoftext|> as id 0 and end of document) on the first
--input-sentence-size sentences, and writes the folder bpe32k with
tokenizer.json and tokenizer_config.json (--tokenizer-type HuggingFaceTokenizer
--tokenizer-model bpe32k) and GPT-2-style vocab.json and merges.txt
(--tokenizer-type GPT2BPETokenizer --vocab-file bpe32k/vocab.json --merge-file
bpe32k/merges.txt). Both give the same ids, except for text that spells
<|endoftext|>: the tokenizer.json reads it as the special token, GPT-2's BPE
(as Megatron-LM's GPT2BPETokenizer) as plain text.
"""
from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.atomic import WriteError, describe, write_bytes, write_text  # noqa: E402
from megatron_lite.data.jsonl import BadLine, open_input, parse_line, split_lines  # noqa: E402
from megatron_lite.data.tokenizer import GPT2_EOD  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", required=True, help="JSONL, JSONL.gz or JSONL.zst, one JSON object per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys whose strings are training text")
    p.add_argument("--model-prefix", required=True,
                   help="writes PREFIX.model and PREFIX.vocab; for byte-level-bpe, the folder PREFIX")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--model-type", choices=("bpe", "unigram", "byte-level-bpe"), default="bpe",
                   help="bpe, unigram: SentencePiece; byte-level-bpe: GPT-2's, with Hugging Face's tokenizers")
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


BYTE_LEVEL_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json")


def train_byte_level_bpe(sentences, vocab_size: int):
    """A GPT-2-style byte-level BPE (a tokenizers.Tokenizer) trained on `sentences`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)  # as GPT-2's: adds no token
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[GPT2_EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(sentences, trainer)
    return tokenizer


def byte_level_files(tokenizer) -> dict:
    """name -> text of the folder's files: the tokenizer.json, its tokenizer_config.json (eos/bos for
    transformers and HuggingFaceTokenizer), and the same BPE as GPT-2's vocab.json and merges.txt."""
    model = json.loads(tokenizer.to_str())["model"]
    vocab = dict(sorted(model["vocab"].items(), key=lambda item: item[1]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]  # "a b" before tokenizers 0.20
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": GPT2_EOD, "eos_token": GPT2_EOD,
              "unk_token": GPT2_EOD, "add_prefix_space": False, "clean_up_tokenization_spaces": False}
    return {"vocab.json": json.dumps(vocab, ensure_ascii=False) + "\n",
            "merges.txt": "#version: 0.2\n" + "".join(f"{m}\n" for m in merges),
            "tokenizer_config.json": json.dumps(config, indent=1) + "\n",
            "tokenizer.json": tokenizer.to_str(pretty=True)}


def publish_folder(files: dict, folder: str) -> None:
    """Each file written atomically, tokenizer.json last: its appearance means the others are there."""
    written = []
    try:
        for name in BYTE_LEVEL_FILES:
            write_text(os.path.join(folder, name), files[name])
            written.append(name)
    except WriteError:
        for name in written:
            os.remove(os.path.join(folder, name))
        raise


def main_byte_level_bpe(args, stream) -> int:
    if args.vocab_size < 257:
        print(f"train_tokenizer.py: error: --vocab-size {args.vocab_size} is too small for a byte-level BPE, whose "
              f"256 bytes and {GPT2_EOD} come first; use 257 or more", file=sys.stderr)
        return 2
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.num_threads))  # before tokenizers starts its threads
    start = time.perf_counter()
    sentences = itertools.islice(stream, args.input_sentence_size or None)
    tokenizer = train_byte_level_bpe(sentences, args.vocab_size)
    if stream.documents == 0:
        print(f"train_tokenizer.py: error: {args.input} has no usable documents", file=sys.stderr)
        return 1
    try:
        os.makedirs(args.model_prefix, exist_ok=True)
        publish_folder(byte_level_files(tokenizer), args.model_prefix)
    except OSError as e:
        print(f"train_tokenizer.py: error: {WriteError(args.model_prefix, describe(e))}", file=sys.stderr)
        return 1
    except WriteError as e:
        print(f"train_tokenizer.py: error: {e}; nothing was written", file=sys.stderr)
        return 1
    print(f"trained byte-level-bpe vocab {tokenizer.get_vocab_size()} on {stream.sentences} sentences "
          f"({stream.bytes / 1e6:.1f} MB) from {stream.documents} documents ({stream.bad_lines} bad lines) in "
          f"{time.perf_counter() - start:.1f}s -> {args.model_prefix}/{{tokenizer.json,tokenizer_config.json,"
          f"vocab.json,merges.txt}}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not os.path.isfile(args.input):
        print(f"train_tokenizer.py: error: --input {args.input}: no such file", file=sys.stderr)
        return 2
    if args.model_type == "byte-level-bpe":
        return main_byte_level_bpe(args, SentenceStream(args.input, args.json_keys, args.max_sentence_length))
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
