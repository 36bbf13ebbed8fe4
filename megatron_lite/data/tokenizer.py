"""Tokenizers behind the small interface the rest of the code uses.

`vocab_size`, `eod`, `bos`, `pad`, `tokenize(text) -> list[int]`,
`detokenize(ids) -> str`. An id of -1 means the tokenizer has no such token
(SentencePiece's convention). No torch here: tools/preprocess_data.py imports
this module in every worker.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence

import numpy as np

from megatron_lite.config import TOKENIZER_TYPES

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")


class SentencePieceTokenizer:
    """A trained SentencePiece model; end of document is the model's EOS id, as in Megatron-LM."""

    def __init__(self, model_path: str) -> None:
        if not model_path:
            raise ValueError("SentencePieceTokenizer needs --tokenizer-model PATH.model")
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"--tokenizer-model {model_path}: no such file; train one with "
                                    f"tools/train_tokenizer.py")
        import sentencepiece

        self.model_path = model_path
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(model_path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"--tokenizer-model {model_path}: not a readable SentencePiece model ({e})") from None

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id()

    def tokenize(self, text: str) -> List[int]:
        # Default options (no BOS/EOS added) is what Megatron-LM's preprocessing calls.
        return self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        """Same ids as tokenize() per text, as int32 arrays; one call into C++ (one thread: workers are processes).

        Arrays, not lists: building a Python int per token cost 12-14% of the
        encode time on the stdlib corpus, and the ids are packed into arrays anyway.
        """
        return self._sp.encode_as_numpy(list(texts), num_threads=1)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))


class NullTokenizer:
    """For tests and synthetic data: text is whitespace-separated ids; eod is the last id."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or vocab_size < 2:
            raise ValueError(f"NullTokenizer needs --vocab-size of at least 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.bos = -1
        self.pad = -1

    def tokenize(self, text: str) -> List[int]:
        ids = [int(t) for t in text.split()]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer: ids {bad[:5]} outside [0, {self.vocab_size})")
        return ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        return [np.array(self.tokenize(t), dtype=np.int64) for t in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str] = None, vocab_size: Optional[int] = None):
    """`--tokenizer-type` / `--tokenizer-model` / `--vocab-size` -> a tokenizer."""
    if tokenizer_type in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}")
