"""Synthetic datasets whose token values are their positions, so tests can see which tokens a sample used."""
import numpy as np

from megatron_lite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter


def write_positional_dataset(prefix, num_documents=200, seed=0, offset=0, max_length=60):
    """Documents of random lengths 1..max_length; token value = offset + its position in the .bin."""
    rng = np.random.RandomState(seed)
    lengths = rng.randint(1, max_length + 1, size=num_documents)
    with IndexedDatasetWriter(str(prefix), np.int32) as writer:
        start = offset
        for n in lengths:
            writer.add_document(np.arange(start, start + n))
            start += n
    return IndexedDataset(str(prefix))


def document_stream(indexed, document_index):
    """The tokens of the documents in document_index order, concatenated."""
    return np.concatenate([indexed[int(d)] for d in document_index])
