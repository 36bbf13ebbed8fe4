import numpy as np
import pytest
import torch

from megatron_lite.data.gpt_dataset import build_train_valid_test_datasets
from megatron_lite.data.sampler import PretrainingSampler, build_data_iterator
from tests.data.synthetic import write_positional_dataset

MICRO, DP = 2, 3


def test_each_step_splits_consecutive_samples_across_data_parallel_ranks():
    per_rank = [list(PretrainingSampler(20, 0, MICRO, r, DP)) for r in range(DP)]
    assert per_rank[0][:2] == [[0, 1], [6, 7]] and per_rank[2][1] == [10, 11]
    steps = [sum((per_rank[r][s] for r in range(DP)), []) for s in range(len(per_rank[0]))]
    assert steps == [list(range(6 * s, 6 * s + 6)) for s in range(3)]  # the partial step (18, 19) is dropped


def test_resuming_from_consumed_samples_yields_exactly_the_next_micro_batches():
    for rank in range(DP):
        full = list(PretrainingSampler(100, 0, MICRO, rank, DP))
        for steps_done in (0, 1, 7):
            resumed = list(PretrainingSampler(100, steps_done * MICRO * DP, MICRO, rank, DP))
            assert resumed == full[steps_done:]


def test_sampler_rejects_a_rank_outside_the_group():
    with pytest.raises(ValueError, match="rank 3 outside"):
        PretrainingSampler(10, 0, 1, 3, 3)


def test_data_iterator_gives_pipeline_engine_tuples_and_resumes_per_rank(tmp_path):
    prefix = write_positional_dataset(tmp_path / "d_text_document").prefix
    train, _, _ = build_train_valid_test_datasets(((1.0, prefix),), (1, 0, 0), 8, (60, 0, 0), 7, str(tmp_path / "c"), -1, False)
    (tokens, position_ids), (labels, loss_mask) = next(build_data_iterator(train, 0, MICRO, 0, DP))
    assert [t.shape for t in (tokens, position_ids, labels, loss_mask)] == [torch.Size([MICRO, 8])] * 4
    assert [t.dtype for t in (tokens, position_ids, labels, loss_mask)] == [torch.int64] * 3 + [torch.float32]
    assert torch.equal(tokens, torch.from_numpy(np.stack([train[0]["tokens"], train[1]["tokens"]])))
    for rank in range(DP):
        full = [batch[0][0] for batch in build_data_iterator(train, 0, MICRO, rank, DP)]
        resumed = [batch[0][0] for batch in build_data_iterator(train, 2 * MICRO * DP, MICRO, rank, DP)]
        assert len(resumed) == len(full) - 2 and all(torch.equal(x, y) for x, y in zip(full[2:], resumed))
    assert build_data_iterator(None, 0, MICRO, 0, DP) is None


def test_starting_an_iterator_leaves_the_global_torch_generator_alone():
    import torch

    from megatron_lite.data.sampler import build_data_iterator

    dataset = [{"tokens": np.zeros(4, dtype=np.int64), "position_ids": np.arange(4), "labels": np.zeros(4, dtype=np.int64),
                "loss_mask": np.ones(4, dtype=np.float32)} for _ in range(8)]
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    next(build_data_iterator(dataset, 0, 2, 0, 1))
    assert torch.equal(torch.rand(3), expected)


def test_a_worker_hands_over_the_same_micro_batches_as_tensors_without_shared_memory(tmp_path, monkeypatch):
    """Workers send arrays (pickled through their pipe), not tensors (shared memory, one file
    descriptor fetched from the worker per tensor); the trainer still gets tensors, identical
    to the in-process loader's."""
    from torch.multiprocessing import reductions

    prefix = write_positional_dataset(tmp_path / "d_text_document").prefix
    train, _, _ = build_train_valid_test_datasets(((1.0, prefix),), (1, 0, 0), 8, (40, 0, 0), 7, str(tmp_path / "c"),
                                                  -1, False)
    in_process = list(build_data_iterator(train, 0, MICRO, 0, 1, num_workers=0))
    workers = build_data_iterator(train, 0, MICRO, 0, 1, num_workers=1)
    received = []  # storages the trainer rebuilt from a worker's shared memory
    for name in ("rebuild_storage_fd", "rebuild_storage_filename"):  # looked up by name when unpickling
        original = getattr(reductions, name)
        monkeypatch.setattr(reductions, name, lambda *a, _o=original: received.append(1) or _o(*a))
    from_worker = list(workers)
    assert received == [] and len(from_worker) == len(in_process)
    for a, b in zip(from_worker, in_process):
        for x, y in zip(a[0] + a[1], b[0] + b[1]):
            assert isinstance(x, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
