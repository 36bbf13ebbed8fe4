import hashlib

import numpy as np

from tests.data.synthetic import write_positional_dataset
from tests.harness import run_distributed


def build_on_this_rank(prefix, cache):
    import torch.distributed as dist

    from megatron_lite.data.gpt_dataset import build_train_valid_test_datasets

    train, _, _ = build_train_valid_test_datasets(((1.0, prefix),), (1, 0, 0), 16, (100, 0, 0), 5, cache, -1, False)
    digest = hashlib.md5(np.ascontiguousarray(train.shuffle_index).tobytes()
                         + np.ascontiguousarray(train.sample_index).tobytes()).hexdigest()
    return dist.get_rank(), train.built_indices, digest


def test_rank_zero_builds_the_indices_and_other_ranks_map_the_same_cache(tmp_path):
    prefix = write_positional_dataset(tmp_path / "d_text_document").prefix
    results = run_distributed(build_on_this_rank, 2, prefix, str(tmp_path / "cache"))
    assert [(rank, built) for rank, built, _ in results] == [(0, True), (1, False)]
    assert results[0][2] == results[1][2]
    again = run_distributed(build_on_this_rank, 2, prefix, str(tmp_path / "cache"))
    assert [built for _, built, _ in again] == [False, False]
