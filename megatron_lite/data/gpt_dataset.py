"""GPT training samples from a Megatron-format dataset, and the train/valid/test datasets of a run.

A sample is seq_length + 1 consecutive tokens of the split's documents in a
shuffled order, taken across document boundaries: `tokens = sample[:-1]`,
`labels = sample[1:]`. Neighbouring samples share one token, so an epoch's
tokens are each used once. The index arrays (indices.py) are deterministic in
(dataset, split, seq_length, num_samples, seed) and cached (index_cache.py).
"""
from __future__ import annotations

import logging
import math
import os
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron_lite.config import format_split
from megatron_lite.data import indices
from megatron_lite.data.blended import BlendedDataset
from megatron_lite.data.documents import document_ids, positions_in_documents
from megatron_lite.data.index_cache import load_or_build, mapped_file
from megatron_lite.data.indexed_dataset import IndexedDataset, data_file_path

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
# Each blended component is built a little larger than its share so that rounding never runs it dry.
BLEND_MARGIN = 1.005
# A sample's arrays, cached by index_cache.py and memory-mapped from there.
INDEX_ARRAYS = ("document_index", "sample_index", "shuffle_index")


class TokenOutOfVocabularyError(ValueError):
    """A sample holds a token id the embedding has no row for (data made with another tokenizer).

    DataLoader workers re-raise an exception in the trainer as `type(message with the worker's
    traceback)`; the constructor keeps only our own message so the trainer can print it as is."""

    def __init__(self, message: str) -> None:
        marker = f"{type(self).__name__}: "
        if "Traceback" in message and marker in message:
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message)


class GPTDataset:
    """Samples of one split of one .bin/.idx dataset.

    documents: [begin, end) document range of the split. num_samples: at
    least this many samples (whole epochs are built, so len() may be larger);
    None for one epoch.
    """

    def __init__(self, indexed: IndexedDataset, split: str, documents: Tuple[int, int], seq_length: int,
                 num_samples: Optional[int], seed: int, cache_path: Optional[str], eod_token: int,
                 eod_mask_loss: bool, vocab_size: Optional[int] = None, reset_position_ids: bool = False,
                 with_document_ids: bool = False) -> None:
        self.indexed = indexed
        self.reset_position_ids = reset_position_ids
        self.with_document_ids = with_document_ids
        self.vocab_size = vocab_size
        self.split = split
        self.seq_length = seq_length
        self.eod_token = eod_token
        self.eod_mask_loss = eod_mask_loss
        first, last = (int(indexed.document_indices[d]) for d in documents)
        self.tokens_per_epoch = int(indexed.sequence_lengths[first:last].sum(dtype=np.int64))
        if self.tokens_per_epoch <= 1:
            raise ValueError(f"{indexed.prefix}: the {split} split (documents {documents[0]}-{documents[1]}) holds "
                             f"{self.tokens_per_epoch} tokens; give it more data or change --split")
        if num_samples is None:
            num_samples = (self.tokens_per_epoch - 1) // seq_length
        self.num_samples = num_samples
        description = {
            "class": "GPTDataset", "prefix": os.path.abspath(indexed.prefix), "split": split,
            "documents": list(documents), "sequences": len(indexed), "tokens_per_epoch": self.tokens_per_epoch,
            "seq_length": seq_length, "num_samples": num_samples, "seed": seed,
        }
        cache_dir = cache_path or os.path.join(os.path.dirname(os.path.abspath(indexed.prefix)), "cache",
                                               "GPTDataset_indices")
        start = time.perf_counter()
        arrays, self.built_indices = load_or_build(
            cache_dir, f"GPTDataset-{split}", description, INDEX_ARRAYS,
            lambda: self._build_indices(np.arange(first, last, dtype=np.int32), seed))
        self.document_index, self.sample_index, self.shuffle_index = (arrays[name] for name in INDEX_ARRAYS)
        logger.info("%s %s: %s indices for %d samples in %.2fs", indexed.prefix, split,
                    "built" if self.built_indices else "loaded cached", len(self), time.perf_counter() - start)

    def _build_indices(self, sequences: np.ndarray, seed: int) -> Dict[str, np.ndarray]:
        rng = np.random.RandomState(seed)
        epochs = indices.num_epochs_needed(self.tokens_per_epoch, self.seq_length, self.num_samples)
        separate = indices.separate_final_epoch(self.tokens_per_epoch, self.seq_length, self.num_samples, epochs)
        document_index = indices.build_document_index(sequences, epochs, rng, separate)
        # Every whole sample the built epochs hold; the partial one at the end is dropped.
        total = (epochs * self.tokens_per_epoch - 1) // self.seq_length
        sample_index = indices.build_sample_index(self.indexed.sequence_lengths, document_index, self.seq_length, total)
        shuffled = ((epochs - 1) * self.tokens_per_epoch - 1) // self.seq_length if separate else total
        shuffle_index = indices.build_shuffle_index(shuffled, total, rng)
        return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}

    def __getstate__(self) -> dict:
        """What a DataLoader worker receives (workers are spawned, not forked: data/workers.py): the
        index arrays by the cached files they are mapped from, the tokens by IndexedDataset's own state;
        never the arrays' contents."""
        state = dict(self.__dict__)
        for name in INDEX_ARRAYS:
            state[name] = mapped_file(state[name])
        return state

    def __setstate__(self, state: dict) -> None:
        for name in INDEX_ARRAYS:
            state[name] = np.load(state[name], mmap_mode="r", allow_pickle=False)
        self.__dict__.update(state)

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def sample_tokens(self, index: int) -> np.ndarray:
        """The seq_length + 1 tokens of sample `index` (before shuffling)."""
        (first, first_offset), (last, last_offset) = self.sample_index[index], self.sample_index[index + 1]
        if first == last:
            return self.indexed.get(self.document_index[first], int(first_offset), int(last_offset - first_offset + 1))
        parts = [self.indexed.get(self.document_index[first], int(first_offset))]
        parts.extend(self.indexed.get(self.document_index[d]) for d in range(first + 1, last))
        parts.append(self.indexed.get(self.document_index[last], 0, int(last_offset) + 1))
        return np.concatenate(parts)

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        sample = self.sample_tokens(int(self.shuffle_index[index])).astype(np.int64)
        if self.vocab_size is not None and (sample.max() >= self.vocab_size or sample.min() < 0):
            bad = int(sample.max() if sample.max() >= self.vocab_size else sample.min())
            raise TokenOutOfVocabularyError(
                f"{data_file_path(self.indexed.prefix)}: token id {bad} in {self.split} sample {index} is outside "
                f"the model's vocabulary [0, {self.vocab_size}); preprocess the data with the tokenizer given to "
                f"training (--tokenizer-model / --vocab-size)")
        tokens, labels = sample[:-1], sample[1:]
        loss_mask = np.ones(self.seq_length, dtype=np.float32)
        if self.eod_mask_loss:
            # As Megatron-LM: no loss where the input is an eod, whose next token starts an unrelated document.
            loss_mask[tokens == self.eod_token] = 0.0
        item = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                "position_ids": np.arange(self.seq_length, dtype=np.int64)}
        if self.reset_position_ids or self.with_document_ids:
            ids = document_ids(tokens, self.eod_token)
            if self.reset_position_ids:
                item["position_ids"] = positions_in_documents(ids)
            if self.with_document_ids:
                item["document_ids"] = ids
        return item


def check_splits(datasets: Sequence[IndexedDataset], split: Sequence[float],
                 num_samples: Sequence[Optional[int]]) -> List[List[Tuple[int, int]]]:
    """Document ranges [begin, end) of (train, valid, test) per dataset; ValueError naming --split
    and the file when a wanted split has no documents (or no tokens) in some or all datasets.

    Validation calls this before any process group exists, and the builder below again."""
    total = sum(split)
    weights = [w / total for w in split]
    ranges = [indices.split_document_ranges(ds.num_documents, weights) for ds in datasets]
    text = format_split(split)
    for i, name in enumerate(SPLIT_NAMES):
        if num_samples[i] == 0:
            continue
        empty = [ds.prefix for ds, r in zip(datasets, ranges) if _tokens(ds, r[i]) <= 1]
        if i == 0 and len(empty) == len(datasets):
            raise ValueError(f"--split {text} leaves no training documents in {', '.join(empty)}; give the first "
                             f"weight a positive share (e.g. --split 969,30,1) or more data")
        if empty and len(empty) < len(datasets):
            raise ValueError(f"--split {text} leaves the {name} split of {', '.join(empty)} without documents "
                             f"while other --data-path datasets have some; use a --split that gives every "
                             f"dataset {name} documents, or more data")
    return ranges


def _tokens(ds: IndexedDataset, documents: Tuple[int, int]) -> int:
    first, last = (int(ds.document_indices[d]) for d in documents)
    return int(ds.sequence_lengths[first:last].sum(dtype=np.int64))


def one_epoch_samples(data_path: Sequence[Tuple[float, str]], split: Sequence[float], seq_length: int,
                      split_name: str) -> int:
    """How many samples one pass over a split's documents gives (a GPTDataset's epoch; blended, the most before
    some dataset's share starts a second pass); more are drawn by repeating it. ValueError as check_splits."""
    datasets = [IndexedDataset(prefix) for _, prefix in data_path]
    wanted = [None if name == split_name else 0 for name in SPLIT_NAMES]
    i = SPLIT_NAMES.index(split_name)
    ranges = check_splits(datasets, split, wanted)
    total_weight = sum(w for w, _ in data_path)
    return min(int(max(_tokens(ds, r[i]) - 1, 0) // seq_length / (w / total_weight))
               for ds, r, (w, _) in zip(datasets, ranges, data_path))


def build_train_valid_test_datasets(data_path: Sequence[Tuple[float, str]], split: Sequence[float], seq_length: int,
                                    num_samples: Sequence[Optional[int]], seed: int, cache_path: Optional[str],
                                    eod_token: int, eod_mask_loss: bool, vocab_size: Optional[int] = None,
                                    reset_position_ids: bool = False, with_document_ids: bool = False):
    """(train, valid, test); None for a split without documents or with 0 samples requested.

    data_path: (weight, prefix) pairs; split: (train, valid, test) weights. Several
    weighted prefixes are blended per split: each prefix gives a GPTDataset with
    its share of the samples (plus a small margin), and a BlendedDataset
    interleaves them in proportion to the weights. With vocab_size, a token id
    at or past it is an error naming the data file. reset_position_ids: positions restart after each
    end-of-document token; with_document_ids: samples carry each token's document (data/documents.py).
    """
    datasets = [IndexedDataset(prefix) for _, prefix in data_path]
    ranges = check_splits(datasets, split, num_samples)
    total_weight = sum(w for w, _ in data_path)
    result = []
    for i, name in enumerate(SPLIT_NAMES):
        wanted = num_samples[i]
        if wanted == 0 or all(r[i][0] == r[i][1] for r in ranges):
            result.append(None)
            continue
        common = dict(seq_length=seq_length, seed=seed, cache_path=cache_path, eod_token=eod_token,
                      eod_mask_loss=eod_mask_loss, vocab_size=vocab_size, reset_position_ids=reset_position_ids,
                      with_document_ids=with_document_ids)
        if len(datasets) == 1:
            result.append(GPTDataset(datasets[0], name, ranges[0][i], num_samples=wanted, **common))
            continue
        shares = [w / total_weight for w, _ in data_path]
        parts = [GPTDataset(ds, name, r[i], num_samples=None if wanted is None else math.ceil(s * wanted * BLEND_MARGIN),
                            **common) for ds, r, s in zip(datasets, ranges, shares)]
        size = wanted if wanted is not None else min(int(len(p) / s) for p, s in zip(parts, shares))
        result.append(BlendedDataset(parts, shares, size))
    return tuple(result)
