"""A dataset of random token ids, made by our own preprocessing tool, for benchmarks and GPU checks.

Writes a JSONL whose documents are whitespace-separated random ids (100-2000 per document) and
tokenizes it with tools/preprocess_data.py --tokenizer-type NullTokenizer --append-eod, so the
result is an ordinary Megatron-format `PREFIX_text_document.{bin,idx,json}` that pretrain_gpt.py
trains on with `--tokenizer-type NullTokenizer --vocab-size V`. Reused when already there with the
same --vocab-size, --num-tokens and --seed; a dataset of other flags there is refused unless
--overwrite, which makes it anew.

    python tools/synthetic_data.py --output-dir data/random --vocab-size 50304 --num-tokens 2000000
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from typing import Iterator, Optional

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TOOLS))

from megatron_lite.atomic import temporary_name  # noqa: E402
from megatron_lite.flag_numbers import add_number  # noqa: E402
from megatron_lite.reading import UnreadableFile, read_json  # noqa: E402
from megatron_lite.targets import OVERWRITE_HELP, target_problem  # noqa: E402

SUFFIXES = (".bin", ".idx", ".json")


def random_documents(vocab_size: int, num_tokens: int, seed: int) -> Iterator:
    """Arrays of ids below vocab_size - 1 (the NullTokenizer's eod is the last id, appended per document),
    until they and their eods hold at least num_tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    written = 0
    while written < num_tokens:
        ids = rng.integers(0, vocab_size - 1, size=int(rng.integers(100, 2000)))
        yield ids
        written += len(ids) + 1


def expected_counts(vocab_size: int, num_tokens: int, seed: int) -> dict:
    """The documents and tokens (eods included) the dataset of these flags holds, as its sidecar records them."""
    lengths = [len(ids) for ids in random_documents(vocab_size, num_tokens, seed)]
    return {"documents": len(lengths), "tokens": sum(lengths) + len(lengths)}


def reuse_problem(document: str, vocab_size: int, num_tokens: int, seed: int) -> Optional[str]:
    """Why the dataset at `document` is not the one these flags make (so it cannot be reused), or None."""
    try:
        record = read_json(document + ".json")
    except UnreadableFile as e:
        return str(e)
    tokenizer = record.get("tokenizer") if isinstance(record, dict) else None
    if not isinstance(tokenizer, dict) or tokenizer.get("type") != "NullTokenizer":
        return f"{document}.json is not a NullTokenizer dataset's record"
    if tokenizer.get("vocab_size") != vocab_size:
        return f"{document}.json records vocab_size {tokenizer.get('vocab_size')}, not --vocab-size {vocab_size}"
    counts = {key: record.get(key) for key in ("documents", "tokens")}
    if counts != expected_counts(vocab_size, num_tokens, seed):
        return (f"{document}.json records {counts['documents']} documents of {counts['tokens']} tokens, not what "
                f"--num-tokens {num_tokens} --seed {seed} make")
    return None


def random_token_dataset(output_dir: str, vocab_size: int, num_tokens: int, seed: int = 0,
                         overwrite: bool = False) -> str:
    """The dataset prefix (`.../data_text_document`) for --data-path; one already there is reused unless
    `overwrite`. Raises subprocess.CalledProcessError when preprocess_data.py fails (it said why)."""
    prefix = os.path.join(output_dir, "data")
    document = prefix + "_text_document"
    if not overwrite and all(os.path.exists(document + s) for s in SUFFIXES):
        return document
    os.makedirs(output_dir, exist_ok=True)
    jsonl = temporary_name(os.path.join(output_dir, "ids.jsonl"))  # hidden: a user's ids.jsonl stays as it was
    try:
        with open(jsonl, "w") as f:
            for ids in random_documents(vocab_size, num_tokens, seed):
                f.write(json.dumps({"text": " ".join(map(str, ids.tolist()))}) + "\n")
        subprocess.run([sys.executable, os.path.join(TOOLS, "preprocess_data.py"), "--input", jsonl,
                        "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size",
                        str(vocab_size), "--append-eod", "--workers", "1", "--log-interval", "100000000",
                        *(["--overwrite"] if overwrite else [])],
                       check=True, stdout=subprocess.DEVNULL)
    finally:
        with contextlib.suppress(OSError):
            os.remove(jsonl)
    return document


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=os.path.basename(__file__), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", required=True,
                   help="folder of the dataset: writes data_text_document.{bin,idx,json} there")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    add_number(p, "--vocab-size", minimum=2, required=True, example=50304,
               help="NullTokenizer ids 0 to vocab size - 1, the last one end of document")
    add_number(p, "--num-tokens", minimum=1, default=2_000_000, help="tokens to write, at least")
    add_number(p, "--seed", minimum=0, default=0, help="of the random ids")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    document = os.path.join(args.output_dir, "data_text_document")
    outputs = [document + s for s in SUFFIXES]
    problem = target_problem("--output-dir", args.output_dir, outputs, args.overwrite)
    if problem and "--overwrite" in problem and all(os.path.isfile(p) for p in outputs):
        why = reuse_problem(document, args.vocab_size, args.num_tokens, args.seed)
        problem = None if why is None else (f"--output-dir {args.output_dir} holds another dataset ({why}); give "
                                            f"a new folder, or add --overwrite to replace it")
    if problem:
        print(f"synthetic_data.py: error: {problem}", file=sys.stderr)
        return 2
    try:
        print(random_token_dataset(args.output_dir, args.vocab_size, args.num_tokens, args.seed,
                                   overwrite=args.overwrite))
    except subprocess.CalledProcessError as e:
        return e.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
