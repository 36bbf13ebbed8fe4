"""Micro-batches for each data-parallel rank, in Megatron-LM's pretraining order, resumable.

Samples are taken in dataset order from `consumed_samples` on. Every
micro_batch_size x data_parallel_size consecutive samples form one step of the
whole DP group; rank r takes the r-th micro_batch_size of them. A run resumed
with the consumed-samples count of its checkpoint therefore continues with
exactly the micro-batches it would have seen next.
"""
from __future__ import annotations

import functools
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_lite.data import workers
from megatron_lite.data.context_parallel import context_parallel_part, mtp_context_parallel_part
from megatron_lite.data.mtp import mtp_arrays


class PretrainingSampler:
    """Yields lists of micro_batch_size sample indices for one DP rank; a last incomplete step is dropped."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int) -> None:
        if micro_batch_size < 1 or data_parallel_size < 1:
            raise ValueError(f"micro batch size {micro_batch_size} and data parallel size {data_parallel_size} "
                             f"must be at least 1")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data parallel rank {data_parallel_rank} outside [0, {data_parallel_size})")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed samples {consumed_samples} outside the dataset's {total_samples} samples")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.step = micro_batch_size * data_parallel_size
        self.offset = data_parallel_rank * micro_batch_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.step

    def __iter__(self) -> Iterator[List[int]]:
        for start in range(self.consumed_samples, self.total_samples - self.step + 1, self.step):
            first = start + self.offset
            yield list(range(first, first + self.micro_batch_size))


BATCH_KEYS = ("tokens", "position_ids", "labels", "loss_mask")
DOCUMENT_KEY = "document_ids"
"""The fifth array, in samples of a run with document masking (data/documents.py)."""


def collate_arrays(samples: Sequence[Dict[str, np.ndarray]]) -> Tuple[np.ndarray, ...]:
    """Dataset items -> the four stacked arrays [micro, seq] of BATCH_KEYS (and the document ids, when
    the items carry them)."""
    keys = BATCH_KEYS + ((DOCUMENT_KEY,) if DOCUMENT_KEY in samples[0] else ())
    return tuple(np.stack([s[key] for s in samples]) for key in keys)


def as_batch(arrays: Sequence[np.ndarray], context_parallel: Tuple[int, int] = (0, 1), mtp_depths: int = 0):
    """The four arrays -> ((tokens, position_ids), (labels, loss_mask)), as DeepSpeed's pipeline engine
    takes them (tensors sharing the arrays' memory); with document ids, ((tokens, position_ids,
    document_ids), (labels, loss_mask)). context_parallel (rank, size) with size > 1: that CP rank's part
    of the sequence, the mask as loss weights (data/context_parallel.py); the document ids stay whole.
    mtp_depths D > 0 (--mtp-num-layers): Multi-Token Prediction's tokens [micro, D, seq] join the inputs, last,
    and its labels and mask the labels (data/mtp.py), made before the CP split."""
    arrays, documents = tuple(arrays[:4]), tuple(arrays[4:])
    mtp = mtp_arrays(arrays[0], arrays[2], arrays[3], documents[0] if documents else None, mtp_depths) \
        if mtp_depths else ()
    if context_parallel[1] > 1:
        arrays = context_parallel_part(arrays, *context_parallel)
        mtp = mtp_context_parallel_part(mtp, *context_parallel) if mtp else ()
    tokens, position_ids, labels, loss_mask, *rest = (torch.from_numpy(np.ascontiguousarray(a))
                                                      for a in arrays + documents + tuple(mtp))
    documents, mtp = rest[:len(documents)], rest[len(documents):]
    if mtp:
        return (tokens, position_ids, *documents, mtp[0]), (labels, loss_mask, *mtp[1:])
    return (tokens, position_ids, *documents), (labels, loss_mask)


def collate(samples: Sequence[Dict[str, np.ndarray]], context_parallel: Tuple[int, int] = (0, 1),
            mtp_depths: int = 0):
    """Dataset items -> ((tokens, position_ids[, document_ids][, mtp tokens]), (labels, loss_mask[, mtp labels,
    mtp mask]))."""
    return as_batch(collate_arrays(samples), context_parallel, mtp_depths)


class _ArrayBatches:
    """A worker-fed DataLoader iterator whose micro-batches arrive as arrays (collate_arrays) and
    leave as tensors. Every other attribute, read or set, is the DataLoader iterator's (its
    worker shutdown, which tests and the exit hook of data/workers.py rely on)."""

    def __init__(self, iterator, context_parallel: Tuple[int, int] = (0, 1), mtp_depths: int = 0) -> None:
        object.__setattr__(self, "_iterator", iterator)
        object.__setattr__(self, "_context_parallel", context_parallel)
        object.__setattr__(self, "_mtp_depths", mtp_depths)

    def __iter__(self) -> "_ArrayBatches":
        return self

    def __next__(self):
        return as_batch(next(self._iterator), self._context_parallel, self._mtp_depths)

    def __getattr__(self, name: str):
        return getattr(self._iterator, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._iterator, name, value)


def build_data_iterator(dataset, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                        data_parallel_size: int, num_workers: int = 0,
                        context_parallel: Tuple[int, int] = (0, 1), mtp_depths: int = 0) -> Optional[Iterator]:
    """Iterator of this DP rank's micro-batches from consumed_samples on (with context_parallel
    (rank, size): that CP rank's part of each; with mtp_depths, Multi-Token Prediction's arrays: as_batch);
    None for no dataset."""
    if dataset is None:
        return None
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, data_parallel_rank,
                                 data_parallel_size)
    # A private generator: starting a DataLoader iterator otherwise draws from the global torch
    # generator, and a resumed run (which starts its iterator after restoring the RNG states)
    # would then see different dropout masks than the run it continues.
    # Workers hand over numpy arrays, which travel pickled through the worker's pipe (a micro-batch
    # is a few KiB). A tensor would travel as shared memory: one file descriptor per tensor, each
    # fetched from the worker's fd-server thread, four round trips per micro-batch through a
    # process that competes with the compute threads for the cores (measured on 2 cores:
    # 2.5-3 ms per micro-batch against 0.5 ms; benchmarks/bench_single_peers.py).
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         collate_fn=collate_arrays if num_workers else
                                         functools.partial(collate, context_parallel=context_parallel,
                                                           mtp_depths=mtp_depths),
                                         persistent_workers=num_workers > 0,
                                         generator=torch.Generator().manual_seed(data_parallel_rank),
                                         **(workers.loader_options() if num_workers else {}))
    if not num_workers:
        return iter(loader)
    return _ArrayBatches(workers.start_workers(loader), context_parallel, mtp_depths)
