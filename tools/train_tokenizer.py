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

An existing PREFIX.model/.vocab or folder PREFIX is refused unless --overwrite
(the tokenizer is what later runs record by SHA-256); the replacement is
written whole before it takes the old one's place. Flags are checked before
the corpus is read: a refusal exits 2 with one line naming the flag.
"""
from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import re
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.atomic import AtomicFile, WriteError, atomic_folder, describe, write_text  # noqa: E402
from megatron_lite.data.jsonl import BadLine, open_input, parse_line, split_lines  # noqa: E402
from megatron_lite.data.tokenizer import GPT2_EOD  # noqa: E402
from megatron_lite.flag_numbers import add_number  # noqa: E402
from megatron_lite.reading import file_problem  # noqa: E402
from megatron_lite.targets import OVERWRITE_HELP, target_problem  # noqa: E402

SPECIAL_IDS = {0: "unk", 1: "bos", 2: "eos"}
"""SentencePiece's fixed ids here; --pad-id adds a fourth."""
MAX_THREADS = 1024  # SentencePiece's limit
BYTE_LEVEL_ALPHABET = 256 + 1  # the 256 bytes and <|endoftext|>


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=os.path.basename(__file__), description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", required=True, help="JSONL, JSONL.gz or JSONL.zst, one JSON object per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys whose strings are training text")
    p.add_argument("--model-prefix", required=True,
                   help="writes PREFIX.model and PREFIX.vocab; for byte-level-bpe, the folder PREFIX")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    add_number(p, "--vocab-size", minimum=1, default=32000,
               help="pieces in the vocabulary, special and byte pieces included")
    p.add_argument("--model-type", choices=("bpe", "unigram", "byte-level-bpe"), default="bpe",
                   help="bpe, unigram: SentencePiece; byte-level-bpe: GPT-2's, with Hugging Face's tokenizers")
    add_number(p, "--character-coverage", kind=float, minimum=0.98, maximum=1.0, default=0.9995,
               help="share of characters the vocabulary must cover (SentencePiece takes 0.98 to 1); the rarest "
                    "become bytes or unk")
    p.add_argument("--byte-fallback", action=argparse.BooleanOptionalAction, default=True,
                   help="encode uncovered characters as UTF-8 bytes instead of unk (adds 256 pieces)")
    add_number(p, "--input-sentence-size", minimum=0, default=2_000_000,
               help="train on a random sample of at most this many sentences (0: all; SentencePiece samples "
                    "more than 100)")
    add_number(p, "--max-sentence-length", minimum=10, maximum=1 << 30, default=4096,
               help="bytes per training sentence (SentencePiece takes 10 to 2^30)")
    p.add_argument("--normalization-rule-name", default="identity",
                   help="SentencePiece normalization; identity keeps text (and whitespace) exactly")
    add_number(p, "--pad-id", minimum=-1, default=3, help="-1 for no padding token; unk, bos, eos are 0, 1, 2")
    add_number(p, "--num-threads", minimum=1, maximum=MAX_THREADS, default=min(os.cpu_count() or 1, MAX_THREADS),
               help="training threads")
    add_number(p, "--seed-sentencepiece-size", minimum=1, default=1_000_000,
               help="unigram: the seed pieces it starts from")
    return p


def flag_problem(args) -> Optional[str]:
    """What SentencePiece or the byte-level BPE would refuse only after reading the corpus, said before."""
    if args.model_type == "byte-level-bpe":
        if args.vocab_size < BYTE_LEVEL_ALPHABET:
            return (f"--vocab-size {args.vocab_size} is too small for a byte-level BPE, whose 256 bytes and "
                    f"{GPT2_EOD} come first; use {BYTE_LEVEL_ALPHABET} or more")
        return None
    if args.pad_id in SPECIAL_IDS:
        return (f"--pad-id {args.pad_id} is {SPECIAL_IDS[args.pad_id]}'s id (unk 0, bos 1, eos 2); use 3, or -1 "
                f"for no padding token")
    specials = len(SPECIAL_IDS) + (args.pad_id != -1)
    needed = specials + 256 * args.byte_fallback + 1
    if args.vocab_size < needed:
        names = "unk, bos, eos" + (", pad" if args.pad_id != -1 else "")
        pieces = f"its {specials} special pieces ({names})" + (" and 256 byte pieces (--byte-fallback)"
                                                                if args.byte_fallback else "")
        return (f"--vocab-size {args.vocab_size} is too small for SentencePiece: {pieces} come first, then the "
                f"corpus's characters; use {needed} or more")
    if args.pad_id >= args.vocab_size:
        return (f"--pad-id {args.pad_id} is outside --vocab-size {args.vocab_size} (ids 0 to "
                f"{args.vocab_size - 1}); use 3, or -1 for no padding token")
    if 0 < args.input_sentence_size <= 100:
        return (f"--input-sentence-size {args.input_sentence_size}: SentencePiece samples more than 100 sentences "
                f"or, with 0, all of them; use 0 or 101 or more")
    return None


def sentencepiece_vocab_problem(error: RuntimeError, args) -> Optional[str]:
    """SentencePiece's refusal of a --vocab-size that does not fit the corpus, said with the flag; else None."""
    small = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(error))
    if small:
        return (f"--vocab-size {args.vocab_size} is too small for the characters of {args.input}: with the special "
                f"and byte pieces SentencePiece needs {small.group(1)} at --character-coverage "
                f"{args.character_coverage:g}; use {small.group(1)} or more, or lower --character-coverage")
    large = re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", str(error))
    if large:
        more = " (or a larger --seed-sentencepiece-size)" if args.model_type == "unigram" else ""
        return (f"--vocab-size {args.vocab_size} is more pieces than SentencePiece finds in {args.input}; use "
                f"{large.group(1)} or less, or a larger corpus{more}")
    return None


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
    """PREFIX.vocab and PREFIX.model, both written in full under temporary names before either is renamed into
    place: a failed write (a full disk) leaves a previous pair as it was; the .model renamed last means both
    are there."""
    staged = []
    try:
        for suffix, data in ((".vocab", vocab_text(model_proto).encode("utf-8")), (".model", model_proto)):
            staged.append(AtomicFile(model_prefix + suffix))
            staged[-1].file.write(data)
            staged[-1].file.flush()
            os.fsync(staged[-1].file.fileno())
    except OSError as e:
        for target in staged:
            target.discard()
        raise WriteError(staged[-1].path, describe(e)) from None
    except WriteError:
        for target in staged:
            target.discard()
        raise
    for target in staged:
        target.commit()


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
    """The folder appears whole, replacing a previous one (--overwrite) only once the new one is complete."""
    with atomic_folder(folder, replace=os.path.isdir(folder)) as tmp:
        for name in BYTE_LEVEL_FILES:
            write_text(os.path.join(tmp, name), files[name])


def main_byte_level_bpe(args, stream) -> int:
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.num_threads))  # before tokenizers starts its threads
    start = time.perf_counter()
    sentences = itertools.islice(stream, args.input_sentence_size or None)
    tokenizer = train_byte_level_bpe(sentences, args.vocab_size)
    if stream.documents == 0:
        print(f"train_tokenizer.py: error: {args.input} has no usable documents", file=sys.stderr)
        return 1
    try:
        publish_folder(byte_level_files(tokenizer), args.model_prefix)
    except WriteError as e:
        print(f"train_tokenizer.py: error: {e}; nothing was written", file=sys.stderr)
        return 1
    print(f"trained byte-level-bpe vocab {tokenizer.get_vocab_size()} on {stream.sentences} sentences "
          f"({stream.bytes / 1e6:.1f} MB) from {stream.documents} documents ({stream.bad_lines} bad lines) in "
          f"{time.perf_counter() - start:.1f}s -> {args.model_prefix}/{{tokenizer.json,tokenizer_config.json,"
          f"vocab.json,merges.txt}}")
    return 0


def refuse(message: str) -> int:
    print(f"train_tokenizer.py: error: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    folder = args.model_type == "byte-level-bpe"
    outputs = [args.model_prefix] if folder else [args.model_prefix + ".model", args.model_prefix + ".vocab"]
    problem = target_problem("--model-prefix", args.model_prefix, outputs, args.overwrite, folder=folder,
                             empty_folder_is_new=True) or flag_problem(args)
    if problem:
        return refuse(problem)
    why = file_problem(args.input)
    if why:
        return refuse(f"--input {args.input}: {why}")
    stream = SentenceStream(args.input, args.json_keys, args.max_sentence_length)
    if next(iter(stream), None) is None:  # SentencePiece says only "[!sentences_.empty()]", after any vocab check
        return refuse(f"--input {args.input} holds no text to train on ({stream.documents} documents, all "
                      f"blank; {stream.bad_lines} lines not JSON with {'/'.join(args.json_keys)}); give a file "
                      f"with text (tools/make_corpus.py writes one)")
    try:  # before the training, which may take hours: a folder that cannot be made fails now
        os.makedirs(os.path.dirname(os.path.abspath(args.model_prefix)), exist_ok=True)
    except OSError as e:
        print(f"train_tokenizer.py: error: {WriteError(outputs[0], describe(e))}", file=sys.stderr)
        return 1
    stream = SentenceStream(args.input, args.json_keys, args.max_sentence_length)
    if folder:
        return main_byte_level_bpe(args, stream)
    import sentencepiece

    start = time.perf_counter()
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
        problem = sentencepiece_vocab_problem(e, args)
        if problem:
            return refuse(problem)
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
