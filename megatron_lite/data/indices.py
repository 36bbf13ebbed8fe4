"""The index arrays behind GPT samples and blending, as Megatron-LM defines them.

- split ranges: `"969,30,1"` -> contiguous document ranges for train, valid, test;
- document index: the split's sequences repeated once per epoch, shuffled;
- sample index: where each sample starts in the document index (C++ helper);
- shuffle index: the order samples are served in;
- blending indices: which dataset, and which of its samples, serves each blended sample (C++ helper).

Pure functions of their inputs and a numpy RandomState, so every rank (and
every rerun) gets the same arrays.
"""
from __future__ import annotations

import warnings
from typing import List, Sequence, Tuple

import numpy as np

_ops = None


def _helpers():
    """torch.ops.megatron_lite with the data helpers loaded; a clear error when the extension is not built."""
    global _ops
    if _ops is None:
        import torch  # here, not at the top: validation reads split ranges without starting torch

        try:
            import megatron_lite._C  # noqa: F401  (loading the library registers the ops)
        except ImportError as e:
            raise ImportError(
                "megatron_lite._C is not built; the dataset index helpers are C++. Build it with "
                "`python setup.py build_ext --inplace` or `pip install --no-build-isolation -e .`") from e
        _ops = torch.ops.megatron_lite
    return _ops


def _tensor(array: np.ndarray) -> "torch.Tensor":  # noqa: F821
    """Zero-copy view; read-only memmaps are fine because the helpers only read their inputs."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        return torch.from_numpy(np.ascontiguousarray(array))


def split_document_ranges(num_documents: int, weights: Sequence[float]) -> List[Tuple[int, int]]:
    """Normalised (train, valid, test) weights -> [begin, end) document ranges, Megatron-LM's rounding."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(num_documents))))
    excess = bounds[-1] - num_documents
    bounds = [0] + [b - excess for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(len(weights))]


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Epochs whose tokens cover num_samples samples (seq_length new tokens each, plus one to finish the last)."""
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def separate_final_epoch(tokens_per_epoch: int, seq_length: int, num_samples: int, num_epochs: int) -> bool:
    """Shuffle the last epoch on its own when only a small part (< 80%) of it is used.

    Otherwise its few samples, mixed into all epochs, would oversample some documents.
    """
    if num_epochs == 1:
        return False
    before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return num_samples - before_final < int(0.80 * per_epoch)


def build_document_index(sequences: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final: bool) -> np.ndarray:
    """The split's sequence ids, once per epoch, shuffled (the final epoch apart when separate_final)."""
    if separate_final:
        return np.concatenate([build_document_index(sequences, num_epochs - 1, rng, False),
                               build_document_index(sequences, 1, rng, False)])
    index = np.tile(np.asarray(sequences, dtype=np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int,
                       num_samples: int) -> np.ndarray:
    """[num_samples + 1, 2] int64: (position in document_index, token offset) where sample i starts (C++).

    ValueError when the document index holds fewer than num_samples * seq_length + 1 tokens.
    """
    return _helpers().build_sample_index(
        _tensor(np.asarray(sequence_lengths, dtype=np.int32)), _tensor(np.asarray(document_index, dtype=np.int32)),
        seq_length, num_samples).numpy()


def build_sample_index_numpy(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int,
                             num_samples: int) -> np.ndarray:
    """The same result in numpy: sample i starts at token i * seq_length of the document stream.

    The reference the C++ helper is tested and benchmarked against.
    """
    lengths = np.asarray(sequence_lengths, dtype=np.int64)[document_index]
    ends = np.cumsum(lengths)
    if num_samples * seq_length + 1 > (ends[-1] if len(ends) else 0):
        raise ValueError(f"build_sample_index: the document index holds fewer than {num_samples * seq_length + 1} "
                         f"tokens for {num_samples} samples of {seq_length}")
    starts = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    # side="right": a start equal to a document's end belongs to the next non-empty document
    position = np.searchsorted(ends, starts, side="right")
    index = np.zeros((num_samples + 1, 2), dtype=np.int64)
    index[1:, 0] = position
    index[1:, 1] = starts - (ends[position] - lengths[position])
    return index


def build_shuffle_index(num_samples: int, total_samples: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, num_samples) followed by one of [num_samples, total_samples)."""
    first = np.arange(num_samples, dtype=np.int64)
    rng.shuffle(first)
    if num_samples == total_samples:
        return first
    last = np.arange(num_samples, total_samples, dtype=np.int64)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of length size; every prefix tracks the weights (C++)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    dataset_index, dataset_sample_index = _helpers().build_blending_indices(_tensor(w), size)
    return dataset_index.numpy(), dataset_sample_index.numpy()
