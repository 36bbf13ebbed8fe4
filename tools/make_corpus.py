#!/usr/bin/env python3
"""Make a JSONL text corpus from the Python standard library's own sources.

Real text that exists wherever Python does, so the quickstart and the tests
need no download. One {"text": ..., "path": ...} object per line, one line per
source file. Deterministic for a given Python installation: files are taken in
an order fixed by a hash of their relative path (which mixes packages, unlike
alphabetical order) while they fit in --max-docs and --max-bytes.

    python tools/make_corpus.py --output corpus.jsonl --max-docs 2000

An existing --output is refused unless --overwrite, which replaces it whole.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.atomic import WriteError, atomic_file, describe  # noqa: E402
from megatron_lite.flag_numbers import add_number  # noqa: E402
from megatron_lite.targets import OVERWRITE_HELP, target_problem  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=os.path.basename(__file__), description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--output", default="corpus.jsonl", help="JSONL file to write")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--root", default=sysconfig.get_paths()["stdlib"], help="folder of .py files to read")
    add_number(p, "--max-docs", minimum=1, default=2000, help="stop after this many documents")
    add_number(p, "--max-bytes", minimum=1, default=64 << 20, help="stop before the text exceeds this many bytes")
    add_number(p, "--min-doc-bytes", minimum=0, default=256, help="skip files smaller than this")
    add_number(p, "--max-doc-bytes", minimum=1, default=256 << 10, help="skip files larger than this")
    return p


def refuse(message: str) -> int:
    print(f"make_corpus.py: error: {message}", file=sys.stderr)
    return 2


def source_files(root: str):
    """Relative paths of .py files under root, in a stable hash order; third-party packages excluded."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        found.extend(os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".py"))
    return sorted(found, key=lambda rel: hashlib.md5(rel.encode()).hexdigest())


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    problem = target_problem("--output", args.output, [args.output], args.overwrite)
    if problem:
        return refuse(problem)
    if args.min_doc_bytes > args.max_doc_bytes:
        return refuse(f"--min-doc-bytes {args.min_doc_bytes} is more than --max-doc-bytes {args.max_doc_bytes}, "
                      f"which leaves no file; give a --min-doc-bytes of at most {args.max_doc_bytes}")
    if not os.path.isdir(args.root):
        return refuse(f"--root {args.root} is not a folder")
    files = source_files(args.root)
    if not files:  # an empty corpus would only fail later, in train_tokenizer or preprocess_data
        return refuse(f"--root {args.root} holds no .py file (outside site-packages); give a folder of Python "
                      f"sources, such as a checkout of a Python project")
    start = time.perf_counter()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        docs, total = write_corpus(args, files)
    except WriteError as e:
        print(f"make_corpus.py: error: {e}; nothing was written", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"make_corpus.py: error: {WriteError(args.output, describe(e))}", file=sys.stderr)
        return 1
    print(f"wrote {docs} documents ({total / 1e6:.2f} MB of text) from {args.root} to {args.output} "
          f"in {time.perf_counter() - start:.1f}s")
    return 0


def write_corpus(args, files):
    docs = total = 0
    with atomic_file(args.output, "w", encoding="utf-8") as out:
        for rel in files:
            if docs >= args.max_docs:
                break
            path = os.path.join(args.root, rel)
            size = os.path.getsize(path)
            if not args.min_doc_bytes <= size <= args.max_doc_bytes or total + size > args.max_bytes:
                continue  # size on disk bounds the text's UTF-8 size (newlines only shrink)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue  # a few test fixtures are deliberately not UTF-8
            nbytes = len(text.encode("utf-8"))
            out.write(json.dumps({"text": text, "path": rel}, ensure_ascii=False) + "\n")
            docs += 1
            total += nbytes
            if docs % 500 == 0:
                print(f"  {docs} documents, {total / 1e6:.1f} MB", file=sys.stderr, flush=True)
    return docs, total


if __name__ == "__main__":
    sys.exit(main())
