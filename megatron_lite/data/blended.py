"""Weighted blending of several datasets (`--data-path 0.3 prefixA 0.7 prefixB`).

Sample i comes from the dataset furthest below its share so far, so any
window of the blend, not just the whole, follows the weights. The two small
index arrays are recomputed on every rank (milliseconds in the C++ helper).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_lite.data import indices


class BlendedDataset:
    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if any(w <= 0 for w in weights):
            raise ValueError(f"blending weights must be positive, got {list(weights)}")
        self.datasets = list(datasets)
        self.weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        self.size = size
        self.dataset_index, self.dataset_sample_index = indices.build_blending_indices(self.weights, size)
        for d, dataset in enumerate(self.datasets):
            used = self.dataset_sample_index[self.dataset_index == d]
            if len(used) and used.max() >= len(dataset):
                raise ValueError(f"blend of {size} samples needs {used.max() + 1} from dataset {d} "
                                 f"(weight {self.weights[d]:.3f}), which has {len(dataset)}")

    def __getstate__(self) -> dict:
        """What a DataLoader worker receives: the components (each sends its files' names) and the weights;
        the worker recomputes the index arrays (9 bytes per sample) rather than have them pickled."""
        return {"datasets": self.datasets, "weights": self.weights, "size": self.size}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.dataset_index, self.dataset_sample_index = indices.build_blending_indices(self.weights, self.size)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, index: int):
        return self.datasets[self.dataset_index[index]][int(self.dataset_sample_index[index])]
