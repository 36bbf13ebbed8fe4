"""A corpus as published: several files, plain, .gz and multi-frame .zst, with bad lines; and the tools in-process."""
import gzip
import importlib.util
import json
import os

import zstandard

from tests.data.conftest import REPO_ROOT


def load_tool(name):
    """tools/<name>.py as a module, so a test can call its main(argv) without starting an interpreter."""
    spec = importlib.util.spec_from_file_location(f"tool_{name}", os.path.join(REPO_ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


preprocess_data = load_tool("preprocess_data")
merge_datasets = load_tool("merge_datasets")

BAD_LINES = 3


def write_corpus_mix(corpus_path, folder):
    """Files whose sorted order is the document order; returns (glob, good texts in order).

    a_big.jsonl holds most bytes, so shard boundaries fall inside it and it is split by byte range.
    """
    texts = [json.loads(line)["text"] for line in open(corpus_path, encoding="utf-8")]
    assert len(texts) >= 20, "the session corpus is smaller than this test expects"
    n = len(texts)
    a, b, c = n * 6 // 10, n * 7 // 10, n * 8 // 10
    line = lambda t: json.dumps({"text": t}).encode() + b"\n"  # noqa: E731
    os.makedirs(folder, exist_ok=True)
    big = [line(t) for t in texts[:a]]
    big.insert(9, b'{"text": "unterminated\n')
    with open(os.path.join(folder, "a_big.jsonl"), "wb") as f:
        f.write(b"".join(big))
    gz = [line(t) for t in texts[a:b]] + [b'{"title": "no text key"}\n']
    with open(os.path.join(folder, "b_part.jsonl.gz"), "wb") as f:
        f.write(gzip.compress(b"".join(gz)))
    zst = [line(t) for t in texts[b:c]]
    frames = [zstandard.ZstdCompressor().compress(b"".join(zst[:3])),
              zstandard.ZstdCompressor(level=9).compress(b"".join(zst[3:]))]
    with open(os.path.join(folder, "c_part.jsonl.zst"), "wb") as f:
        f.write(b"".join(frames))  # two frames, as parallel compressors write
    tail = [line(t) for t in texts[c:]] + [line(""), b"not json\n"]
    with open(os.path.join(folder, "d_tail.jsonl"), "wb") as f:
        f.write(b"".join(tail))
    good = texts[:a] + texts[a:b] + texts[b:c] + texts[c:] + [""]
    return os.path.join(folder, "*"), good


def preprocess(input_glob, output_prefix, spm_model, *extra):
    """Runs preprocess_data.py's main in this process; returns its exit status."""
    return preprocess_data.main(["--input", str(input_glob), "--output-prefix", str(output_prefix),
                                 "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(spm_model),
                                 "--append-eod", *map(str, extra)])


def preprocess_shards(input_glob, output_prefix, spm_model, num_shards, *extra):
    for index in range(num_shards):
        status = preprocess(input_glob, output_prefix, spm_model, "--num-shards", num_shards,
                            "--shard-index", index, *extra)
        assert status == 0, f"shard {index} of {num_shards} exited {status}"
