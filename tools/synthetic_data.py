"""A dataset of random token ids, made by our own preprocessing tool, for benchmarks and GPU checks.

Writes a JSONL whose documents are whitespace-separated random ids (100-2000 per document) and
tokenizes it with tools/preprocess_data.py --tokenizer-type NullTokenizer --append-eod, so the
result is an ordinary Megatron-format `PREFIX_text_document.{bin,idx,json}` that pretrain_gpt.py
trains on with `--tokenizer-type NullTokenizer --vocab-size V`. Reused when already there.

    python tools/synthetic_data.py --output-dir data/random --vocab-size 50304 --num-tokens 2000000
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

TOOLS = os.path.dirname(os.path.abspath(__file__))


def random_token_dataset(output_dir: str, vocab_size: int, num_tokens: int, seed: int = 0) -> str:
    """The dataset prefix (`.../data_text_document`) for --data-path."""
    prefix = os.path.join(output_dir, "data")
    document = prefix + "_text_document"
    if os.path.exists(document + ".idx") and os.path.exists(document + ".json"):
        return document
    os.makedirs(output_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    jsonl = os.path.join(output_dir, "ids.jsonl")
    with open(jsonl, "w") as f:
        written = 0
        while written < num_tokens:
            # Ids below vocab_size - 1: the NullTokenizer's eod is the last id, appended per document.
            ids = rng.integers(0, vocab_size - 1, size=int(rng.integers(100, 2000)))
            f.write(json.dumps({"text": " ".join(map(str, ids.tolist()))}) + "\n")
            written += len(ids) + 1
    subprocess.run([sys.executable, os.path.join(TOOLS, "preprocess_data.py"), "--input", jsonl,
                    "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab_size),
                    "--append-eod", "--workers", "1", "--log-interval", "100000000"],
                   check=True, stdout=subprocess.DEVNULL)
    os.remove(jsonl)
    return document


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--num-tokens", type=int, default=2_000_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(random_token_dataset(args.output_dir, args.vocab_size, args.num_tokens, args.seed))


if __name__ == "__main__":
    main()
