"""The JSON file next to each .bin/.idx pair that says how it was made.

`{prefix}.json` records the tokenizer's identity (type, SHA-256 of its files
(`tokenizer_sha256`), vocabulary size, eod id, whether eod was appended), the token dtype, the
counts (documents, sequences, tokens, bad lines skipped), the sizes of the
.bin and .idx, and for a shard its index, the shard count and a fingerprint of
the whole input listing. tools/merge_datasets.py checks shards against each
other with it. It is written last and atomically, so a shard without it is
incomplete. No torch here.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from megatron_lite.atomic import write_text
from megatron_lite.reading import UnreadableFile, read_json
from megatron_lite.data.indexed_dataset import data_file_path, index_file_path
from megatron_lite.data.tokenizer import HF_SIDE_FILES, tokenizer_files

FORMAT = "megatron_lite.dataset"
VERSION = 1


class SidecarError(ValueError):
    """A sidecar that is missing or unreadable; the message names the file."""


def sidecar_path(prefix: str) -> str:
    return prefix + ".json"


def shard_prefix(dataset_prefix: str, shard_index: int, num_shards: int) -> str:
    width = max(5, len(str(num_shards)))
    return f"{dataset_prefix}.shard-{shard_index:0{width}d}-of-{num_shards:0{width}d}"


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_sha256(tokenizer_type: Optional[str], tokenizer_model: Optional[str] = None,
                     vocab_file: Optional[str] = None, merge_file: Optional[str] = None) -> Optional[str]:
    """The identity of the files that decide a tokenizer's ids: a SentencePiece .model's or a tokenizer.json's
    own SHA-256 (what sidecars and checkpoints recorded for SentencePiece before the other types existed),
    the SHA-256 of the lines 'vocab.json SHA256' and 'merges.txt SHA256' for GPT-2 BPE; None for NullTokenizer.
    A Hugging Face folder's tokenizer_config.json is left out: it names the special tokens, whose ids the
    sidecar records beside this."""
    files = [(path, name) for path, name in tokenizer_files(tokenizer_type, tokenizer_model, vocab_file, merge_file)
             if name not in HF_SIDE_FILES]
    if not files:
        return None
    if len(files) == 1:
        return file_sha256(files[0][0])
    return hashlib.sha256("".join(f"{name} {file_sha256(path)}\n" for path, name in files).encode()).hexdigest()


def tokenizer_identity(tokenizer, tokenizer_type: str, files_sha256: Optional[str], append_eod: bool) -> dict:
    """What must agree for two outputs to be one dataset: the same ids for the same text. `files_sha256`:
    tokenizer_sha256()'s digest (kept under the key `model_sha256`, which SentencePiece sidecars have)."""
    return {
        "type": tokenizer_type,
        "model_sha256": files_sha256,
        "vocab_size": int(tokenizer.vocab_size),
        "eod": int(tokenizer.eod),
        "append_eod": bool(append_eod),
    }


def describe_outputs(prefix: str) -> dict:
    """Sizes of the finished pair, so that a later truncation is noticed."""
    return {"bin_bytes": os.path.getsize(data_file_path(prefix)),
            "idx_bytes": os.path.getsize(index_file_path(prefix))}


def write_sidecar(prefix: str, record: dict) -> None:
    write_text(sidecar_path(prefix), json.dumps({"format": FORMAT, "version": VERSION, **record}, indent=1,
                                                sort_keys=True) + "\n")


def remove_outputs(prefix: str) -> None:
    """Remove a dataset's .bin, .idx and sidecar, where present (an output that could not be finished)."""
    for path in (data_file_path(prefix), index_file_path(prefix), sidecar_path(prefix)):
        if os.path.exists(path):
            os.remove(path)


def read_sidecar(prefix: str) -> dict:
    path = sidecar_path(prefix)
    if not os.path.isfile(path):
        raise SidecarError(f"{path}: missing; the output is incomplete (its preprocess_data.py run did not "
                           f"finish) or was not written by tools/preprocess_data.py")
    try:
        record = read_json(path)
    except UnreadableFile as e:
        raise SidecarError(str(e)) from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("version") != VERSION:
        raise SidecarError(f"{path}: not a {FORMAT} version {VERSION} sidecar")
    return record
