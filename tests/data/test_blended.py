import numpy as np
import pytest

from megatron_lite.data import indices
from megatron_lite.data.blended import BlendedDataset
from megatron_lite.data.gpt_dataset import build_train_valid_test_datasets
from tests.data.synthetic import write_positional_dataset

B_OFFSET = 1_000_000  # token values of dataset B start here, so a sample tells where it came from


@pytest.fixture
def two_prefixes(tmp_path):
    a = write_positional_dataset(tmp_path / "a_text_document", num_documents=150, seed=1)
    b = write_positional_dataset(tmp_path / "b_text_document", num_documents=150, seed=2, offset=B_OFFSET)
    return a.prefix, b.prefix


def test_blended_samples_follow_the_weights_within_half_a_percent(two_prefixes, tmp_path):
    a, b = two_prefixes
    train, valid, test = build_train_valid_test_datasets(
        ((0.3, a), (0.7, b)), (100, 0, 0), 16, (2000, 0, 0), 1234, str(tmp_path / "cache"), -1, False)
    assert valid is None and test is None and len(train) == 2000
    from_b = np.array([train[i]["tokens"][0] >= B_OFFSET for i in range(len(train))])
    assert abs(from_b.mean() - 0.7) < 0.005
    for window in (100, 1000):  # every prefix of the blend tracks the weights, not only the whole
        assert abs(from_b[:window].sum() - 0.7 * window) <= 1
    component = train.datasets[train.dataset_index[5]]
    assert np.array_equal(train[5]["tokens"], component[int(train.dataset_sample_index[5])]["tokens"])


def test_blending_indices_take_each_component_sample_in_order_once():
    which, position = indices.build_blending_indices([0.2, 0.5, 0.3], 1000)
    for d in range(3):
        assert np.array_equal(position[which == d], np.arange((which == d).sum()))
    assert np.bincount(which).tolist() == [200, 500, 300]


def test_blend_larger_than_a_component_is_refused():
    with pytest.raises(ValueError, match="needs 50 from dataset 0"):
        BlendedDataset([list(range(10)), list(range(100))], [0.5, 0.5], 100)
