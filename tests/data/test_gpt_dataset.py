import numpy as np
import pytest

from megatron_lite.data import indices
from megatron_lite.data.gpt_dataset import GPTDataset, build_train_valid_test_datasets
from tests.data.synthetic import document_stream, write_positional_dataset

SEQ = 16


@pytest.fixture
def indexed(tmp_path):
    return write_positional_dataset(tmp_path / "pos_text_document")


def make(indexed, tmp_path, num_samples=None, seed=1234, documents=None, **kw):
    return GPTDataset(indexed, "train", documents or (0, indexed.num_documents), SEQ, num_samples, seed,
                      str(tmp_path / "cache"), eod_token=kw.pop("eod_token", -1),
                      eod_mask_loss=kw.pop("eod_mask_loss", False), **kw)


@pytest.mark.parametrize("seq_length", [1, 7, 64])
def test_cpp_sample_index_equals_the_numpy_reference_and_the_stream_definition(seq_length):
    rng = np.random.RandomState(seq_length)
    lengths = rng.randint(0, 40, size=300).astype(np.int32)  # zero-length sequences included
    lengths[0] = 0  # the first sample may even start in an empty document
    document_index = rng.permutation(np.tile(np.arange(300, dtype=np.int32), 2))
    total = (int(lengths[document_index].sum()) - 1) // seq_length
    cpp = indices.build_sample_index(lengths, document_index, seq_length, total)
    assert np.array_equal(cpp, indices.build_sample_index_numpy(lengths, document_index, seq_length, total))
    starts = np.concatenate([[0], np.cumsum(lengths[document_index])])
    for i in range(1, total + 1):
        position, offset = cpp[i]
        assert starts[position] + offset == i * seq_length and offset < lengths[document_index[position]]


@pytest.mark.parametrize("builder", [indices.build_sample_index, indices.build_sample_index_numpy])
def test_sample_index_refuses_more_samples_than_tokens(builder):
    with pytest.raises(ValueError, match="holds fewer than 33 tokens for 2 samples of 16"):
        builder(np.array([10, 10], np.int32), np.array([0, 1], np.int32), 16, 2)


def test_samples_cross_document_boundaries_in_shuffled_document_order(indexed, tmp_path):
    ds = make(indexed, tmp_path)
    stream = document_stream(indexed, ds.document_index)
    assert not np.array_equal(ds.document_index, np.sort(ds.document_index)), "documents are shuffled"
    crossing = 0
    for i in range(len(ds)):
        expected = stream[i * SEQ: (i + 1) * SEQ + 1]
        assert np.array_equal(ds.sample_tokens(i), expected)
        crossing += ds.sample_index[i][0] != ds.sample_index[i + 1][0]
    assert 0 < crossing < len(ds), "both kinds covered: samples inside one document and across several"


def test_every_token_of_an_epoch_is_used_once(indexed, tmp_path):
    ds = make(indexed, tmp_path)
    epoch_tokens = int(indexed.sequence_lengths.sum())
    assert len(ds) == (epoch_tokens - 1) // SEQ
    used = np.concatenate([ds[i]["tokens"] for i in range(len(ds))])
    assert len(np.unique(used)) == len(used) == len(ds) * SEQ  # no token twice
    assert epoch_tokens - len(used) <= SEQ  # only the partial last sample is left out


def test_items_are_shifted_tokens_with_positions_and_optional_eod_loss_mask(indexed, tmp_path):
    eod = int(indexed[3][-1])  # pretend the last token of document 3 is an end-of-document id
    plain = make(indexed, tmp_path)
    masked = make(indexed, tmp_path, eod_token=eod, eod_mask_loss=True)
    i = next(i for i in range(len(masked)) if eod in masked[i]["tokens"])
    item = masked[i]
    assert [item[k].dtype for k in ("tokens", "labels", "position_ids", "loss_mask")] == [np.int64] * 3 + [np.float32]
    assert all(len(item[k]) == SEQ for k in item)
    assert np.array_equal(item["tokens"][1:], item["labels"][:-1])
    assert np.array_equal(item["position_ids"], np.arange(SEQ))
    assert np.array_equal(item["loss_mask"], (item["tokens"] != eod).astype(np.float32))
    assert item["loss_mask"].sum() == SEQ - 1 and plain[i]["loss_mask"].sum() == SEQ


def test_indices_are_deterministic_and_change_with_the_seed(indexed, tmp_path):
    a = make(indexed, tmp_path / "a", num_samples=50)
    b = make(indexed, tmp_path / "b", num_samples=50)
    c = make(indexed, tmp_path / "c", num_samples=50, seed=99)
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)


def test_second_build_reuses_the_cache_without_rebuilding(indexed, tmp_path, monkeypatch):
    first = make(indexed, tmp_path, num_samples=50)
    assert first.built_indices

    def fail(*args, **kwargs):
        raise AssertionError("indices rebuilt although cached")

    monkeypatch.setattr(indices, "build_sample_index", fail)
    second = make(indexed, tmp_path, num_samples=50)
    assert not second.built_indices
    assert isinstance(second.sample_index, np.memmap)
    assert np.array_equal(first.shuffle_index, second.shuffle_index)
    with pytest.raises(AssertionError, match="rebuilt"):
        make(indexed, tmp_path, num_samples=51)  # another key: built anew


def test_more_samples_than_an_epoch_repeat_every_document_per_epoch(indexed, tmp_path):
    epoch_samples = (int(indexed.sequence_lengths.sum()) - 1) // SEQ
    ds = make(indexed, tmp_path, num_samples=2 * epoch_samples + epoch_samples // 2)
    counts = np.bincount(ds.document_index, minlength=len(indexed))
    assert counts.min() == counts.max() == 3 and len(ds) >= ds.num_samples
    # A small final epoch is shuffled apart: the first samples served come from the first two epochs only.
    small = make(indexed, tmp_path, num_samples=epoch_samples + 3)
    first_epoch_samples = (int(indexed.sequence_lengths.sum()) - 1) // SEQ
    assert small.shuffle_index[:first_epoch_samples].max() < first_epoch_samples


def test_split_969_30_1_gives_disjoint_megatron_rounded_document_ranges(indexed, tmp_path):
    assert indices.split_document_ranges(1000, (0.969, 0.03, 0.001)) == [(0, 969), (969, 999), (999, 1000)]
    assert indices.split_document_ranges(200, (0.9, 0.1, 0.0)) == [(0, 180), (180, 200), (200, 200)]
    train, valid, test = build_train_valid_test_datasets(
        ((1.0, indexed.prefix),), (90, 10, 0), SEQ, (40, 5, 5), 1234, str(tmp_path / "cache"), -1, False)
    assert test is None
    assert set(train.document_index) == set(range(180)) and set(valid.document_index) == set(range(180, 200))
    assert len(train) >= 40 and len(valid) >= 5


def test_a_token_outside_the_vocabulary_is_an_error_naming_the_data_file_even_from_a_worker(indexed, tmp_path):
    from megatron_lite.data.gpt_dataset import TokenOutOfVocabularyError
    from megatron_lite.data.sampler import build_data_iterator

    biggest = max(int(make(indexed, tmp_path)[i]["tokens"].max()) for i in range(4))
    ds = GPTDataset(indexed, "train", (0, indexed.num_documents), SEQ, None, 1234, str(tmp_path / "cache"),
                    eod_token=-1, eod_mask_loss=False, vocab_size=biggest)
    message = rf"^{indexed.prefix}.bin: token id \d+ in train sample \d+ is outside the model's vocabulary \[0, {biggest}\)"
    with pytest.raises(TokenOutOfVocabularyError, match=message):
        [ds[i] for i in range(len(ds))]
    batches = build_data_iterator(ds, 0, 2, 0, 1, num_workers=1)
    try:  # stopped here: left to the garbage collector (inside pytest's teardown) the worker never got its stop
        with pytest.raises(TokenOutOfVocabularyError, match=message):  # re-raised by the DataLoader: our line only
            list(batches)
    finally:
        batches._shutdown_workers()


def test_document_ids_count_the_ends_before_each_token_and_positions_restart_after_each_end():
    from megatron_lite.data.documents import document_ids, positions_in_documents

    tokens = np.array([5, 6, 0, 7, 8, 9, 0, 0, 3])  # 0 ends a document, and belongs to it
    ids = document_ids(tokens, 0)
    assert ids.dtype == np.int32 and ids.tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 3]
    assert positions_in_documents(ids).tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 0]


def test_items_carry_document_ids_and_restarting_positions_only_when_asked(indexed, tmp_path):
    from megatron_lite.data.documents import document_ids

    plain = make(indexed, tmp_path)
    eod = int(plain[0]["tokens"][SEQ // 2])  # a token of the first sample's middle stands for the end of a document
    plain = make(indexed, tmp_path, eod_token=eod)
    both = make(indexed, tmp_path, eod_token=eod, reset_position_ids=True, with_document_ids=True)
    i = 0
    item = both[i]
    assert "document_ids" not in plain[i] and np.array_equal(plain[i]["position_ids"], np.arange(SEQ))
    assert np.array_equal(item["document_ids"], document_ids(item["tokens"], eod))
    end = int(np.flatnonzero(item["tokens"] == eod)[0])
    assert item["position_ids"][end + 1] == 0 and np.array_equal(item["position_ids"][:end + 1], np.arange(end + 1))
    positions_only = make(indexed, tmp_path, eod_token=eod, reset_position_ids=True)[i]
    assert "document_ids" not in positions_only and np.array_equal(positions_only["position_ids"], item["position_ids"])


def test_a_batch_with_document_ids_keeps_them_whole_on_every_context_parallel_rank():
    from megatron_lite.data.sampler import collate

    samples = [{"tokens": np.arange(8), "position_ids": np.arange(8), "labels": np.arange(8) + 1,
                "loss_mask": np.ones(8, dtype=np.float32), "document_ids": np.array([0, 0, 1, 1, 1, 2, 2, 2],
                                                                                   dtype=np.int32)}] * 2
    (tokens, positions, documents), (labels, weights) = collate(samples, context_parallel=(1, 2))
    assert tokens.tolist() == [[4, 5, 6, 7]] * 2 and positions.shape == labels.shape == weights.shape == (2, 4)
    assert documents.tolist() == [[0, 0, 1, 1, 1, 2, 2, 2]] * 2
    (tokens, positions), _ = collate([{k: v for k, v in s.items() if k != "document_ids"} for s in samples])
    assert tokens.shape == (2, 8)
