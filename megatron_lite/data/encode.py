"""Turning blocks of JSONL lines into packed token arrays (the worker side of preprocess_data.py).

A block is bytes holding whole lines, cut by the reading process; the worker
splits it into lines itself, so the reader hands over one bytes object instead
of a list of lines. The result holds, per JSON key, the tokens of every good
line packed in the output dtype plus one length per document, the number of
lines, and the bad lines (numbered from 1 within the block) with the reason.
Token ids match Megatron-LM's preprocessing exactly: one `tokenize(text)` per
document, then the eod id when `append_eod` and the document produced tokens.
No torch here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

from megatron_lite.data.jsonl import BadLine, parse_line, split_lines
from megatron_lite.data.tokenizer import build_tokenizer


@dataclass
class EncodedChunk:
    token_bytes: List[bytes]
    """Per JSON key: the chunk's tokens, concatenated, in the output dtype."""
    document_lengths: List[np.ndarray]
    """Per JSON key: tokens per good line (0 for a document with no tokens)."""
    bad_lines: List[Tuple[int, str]] = field(default_factory=list)
    """(line number within the block, from 1; reason) of each skipped line."""
    input_bytes: int = 0
    lines: int = 0
    """Lines in the block (good and bad), so the reader can number the next block's lines."""


class ChunkEncoder:
    """Holds the tokenizer; built once per worker process."""

    def __init__(self, tokenizer_args: Sequence, json_keys: Sequence[str], append_eod: bool, dtype) -> None:
        """tokenizer_args: build_tokenizer's arguments (type, model, vocab size, vocab file, merge file)."""
        self.tokenizer = build_tokenizer(*tokenizer_args)
        self.json_keys = list(json_keys)
        self.append_eod = append_eod
        self.dtype = np.dtype(dtype)

    def __call__(self, block: bytes) -> EncodedChunk:
        lines = split_lines(block)
        bad: List[Tuple[int, str]] = []
        good: List[Tuple[int, List[str]]] = []
        for number, line in enumerate(lines, 1):
            texts = parse_line(line, self.json_keys)
            if isinstance(texts, BadLine):
                bad.append((number, str(texts)))
            else:
                good.append((number, texts))
        try:
            encoded = self._tokenize(good)
        except ValueError:
            # Only NullTokenizer rejects text (non-integer words): find those lines, then redo the rest.
            rejected = {n: self._rejection(texts) for n, texts in good}
            bad = sorted(bad + [(n, reason) for n, reason in rejected.items() if reason])
            good = [(n, texts) for n, texts in good if not rejected[n]]
            encoded = self._tokenize(good)
        token_bytes, lengths = [], []
        eod = np.array([self.tokenizer.eod], dtype=self.dtype)
        for documents in encoded:
            counts = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))
            if self.append_eod:
                parts = [part for ids in documents if len(ids) for part in (ids, eod)]
                counts += counts > 0
            else:
                parts = documents
            # Ids are below the vocabulary size, which token_dtype() chose the dtype to hold.
            flat = np.concatenate(parts, dtype=self.dtype, casting="unsafe") if len(parts) else eod[:0]
            token_bytes.append(flat.tobytes())
            lengths.append(counts)
        return EncodedChunk(token_bytes, lengths, bad, len(block), len(lines))

    def _tokenize(self, good: List[Tuple[int, List[str]]]) -> List[List[np.ndarray]]:
        """Per JSON key, the ids of each good line's text."""
        return [self.tokenizer.tokenize_batch([texts[k] for _, texts in good]) for k in range(len(self.json_keys))]

    def _rejection(self, texts: List[str]) -> str:
        try:
            for text in texts:
                self.tokenizer.tokenize(text)
        except ValueError as e:
            return f"tokenizer rejected the text ({e})"
        return ""


_worker_encoder: Optional[ChunkEncoder] = None


def init_worker(*encoder_args) -> None:
    """multiprocessing.Pool initializer: one tokenizer per worker process."""
    global _worker_encoder
    _worker_encoder = ChunkEncoder(*encoder_args)


def encode_in_worker(block: bytes) -> EncodedChunk:
    return _worker_encoder(block)
