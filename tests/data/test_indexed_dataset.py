import os
import struct

import numpy as np
import pytest

from megatron_lite.data.indexed_dataset import (
    IndexedDataset, IndexedDatasetError, IndexedDatasetWriter, merge_datasets, token_dtype,
)

DOCUMENTS = [[5, 6, 7], [], [1], [9, 8, 7, 6, 5, 4], [300]]


def write(prefix, documents=DOCUMENTS, dtype=np.uint16):
    with IndexedDatasetWriter(str(prefix), dtype) as writer:
        for doc in documents:
            writer.add_document(doc)
    return str(prefix)


def test_round_trip_returns_every_document_and_slice(tmp_path):
    ds = IndexedDataset(write(tmp_path / "ds"))
    nonempty = [d for d in DOCUMENTS if d]
    assert len(ds) == len(nonempty) and ds.num_documents == len(DOCUMENTS)
    assert [ds[i].tolist() for i in range(len(ds))] == nonempty
    assert ds.get(2, offset=1, length=3).tolist() == [8, 7, 6]
    assert ds.get(2, offset=4).tolist() == [5, 4]
    with pytest.raises(IndexError, match="outside sequence 2"):
        ds.get(2, offset=5, length=2)


def test_idx_header_and_arrays_match_formats_md_field_by_field(tmp_path):
    prefix = write(tmp_path / "ds", dtype=np.int32)
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, = struct.unpack_from("<Q", raw, 9)
    code, = struct.unpack_from("<B", raw, 17)
    n, d1 = struct.unpack_from("<QQ", raw, 18)
    assert (version, code, n, d1) == (1, 4, 4, 6)  # int32 is code 4; 4 non-empty sequences; 5 documents + 1
    at = 34
    lengths = struct.unpack_from(f"<{n}i", raw, at)
    at += 4 * n
    pointers = struct.unpack_from(f"<{n}q", raw, at)
    at += 8 * n
    doc_index = struct.unpack_from(f"<{d1}q", raw, at)
    at += 8 * d1
    assert at == len(raw), "no padding or trailing bytes"
    assert lengths == (3, 1, 6, 1)
    assert pointers == (0, 12, 16, 40)  # byte offsets, 4 bytes per int32 token
    assert doc_index == (0, 1, 1, 2, 3, 4)  # the empty document repeats the previous entry
    assert open(prefix + ".bin", "rb").read() == np.array(sum(DOCUMENTS, []), dtype="<i4").tobytes()


def test_token_dtype_is_uint16_below_65500_entries_else_int32():
    assert token_dtype(65499) == np.uint16 and token_dtype(65500) == np.int32


def test_multi_sequence_documents_and_packed_adds_agree(tmp_path):
    a = tmp_path / "a"
    with IndexedDatasetWriter(str(a), np.uint16) as writer:
        writer.add_document([1, 2, 3, 4], sequence_lengths=[1, 3])
    ds = IndexedDataset(str(a))
    assert ds.document_indices.tolist() == [0, 2] and ds.sequence_lengths.tolist() == [1, 3]
    b = tmp_path / "b"
    with IndexedDatasetWriter(str(b), np.uint16) as writer:
        writer.add_documents(np.array(sum(DOCUMENTS, []), np.uint16).tobytes(), [len(d) for d in DOCUMENTS])
    for suffix in (".bin", ".idx"):
        assert open(str(b) + suffix, "rb").read() == open(write(tmp_path / "c") + suffix, "rb").read()


def test_merge_concatenates_documents_in_order(tmp_path):
    first = write(tmp_path / "first")
    second = write(tmp_path / "second", [[42, 43], [44]])
    merged = merge_datasets(str(tmp_path / "merged"), [first, second])
    expected = [d for d in DOCUMENTS if d] + [[42, 43], [44]]
    assert [merged[i].tolist() for i in range(len(merged))] == expected
    assert merged.document_indices.tolist() == [0, 1, 1, 2, 3, 4, 5, 6]


def test_index_streamed_in_small_blocks_equals_the_index_written_in_one_block(tmp_path):
    # The writer keeps lengths and document ends on disk and streams them into the .idx in blocks;
    # pointers carry a running sum across blocks. Blocks of 2 and 3 cross every kind of boundary.
    documents = DOCUMENTS * 3
    small = IndexedDatasetWriter(str(tmp_path / "small"), np.uint16)
    for doc in documents:
        small.add_document(doc)
    small.finalize(block=2)
    one_block = write(tmp_path / "one", documents)
    merged = IndexedDatasetWriter(str(tmp_path / "merged"), np.uint16)
    for prefix in (write(tmp_path / "a", documents[:7]), write(tmp_path / "b", documents[7:])):
        merged.add_index(prefix, block=3)
    merged.finalize(block=3)
    for suffix in (".bin", ".idx"):
        expected = open(one_block + suffix, "rb").read()
        assert (tmp_path / f"small{suffix}").read_bytes() == expected
        assert (tmp_path / f"merged{suffix}").read_bytes() == expected
    assert sorted(os.listdir(tmp_path)) == sorted(f"{n}{s}" for n in ("small", "one", "a", "b", "merged")
                                                  for s in (".bin", ".idx"))


def test_merge_refuses_different_dtypes(tmp_path):
    with pytest.raises(IndexedDatasetError, match="dtype"):
        merge_datasets(str(tmp_path / "m"), [write(tmp_path / "u16"), write(tmp_path / "i32", dtype=np.int32)])


def test_writer_leaves_no_file_under_the_final_name_when_interrupted(tmp_path):
    prefix = tmp_path / "ds"
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetWriter(str(prefix), np.uint16) as writer:
            writer.add_document([1, 2, 3])
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def corrupt(prefix, suffix, at, data):
    with open(prefix + suffix, "r+b") as f:
        f.seek(at)
        f.write(data)


@pytest.mark.parametrize("damage, message", [
    (lambda p: corrupt(p, ".idx", 0, b"XXIDIDX"), "magic"),
    (lambda p: corrupt(p, ".idx", 9, struct.pack("<Q", 2)), "version 2"),
    (lambda p: corrupt(p, ".idx", 17, bytes([9])), "dtype code 9"),
    (lambda p: os.truncate(p + ".idx", os.path.getsize(p + ".idx") - 8), "truncated or corrupt"),
    (lambda p: os.truncate(p + ".idx", 20), "shorter than the 34-byte header"),
    (lambda p: os.truncate(p + ".bin", 10), "truncated .bin"),
    (lambda p: corrupt(p, ".idx", 34 + 4 * 4 + 8 * 4, struct.pack("<q", 1)), "from 0 to the sequence count"),
])
def test_reader_rejects_damaged_files_naming_the_file_and_problem(tmp_path, damage, message):
    prefix = write(tmp_path / "ds")
    damage(prefix)
    with pytest.raises(IndexedDatasetError, match=message) as info:
        IndexedDataset(prefix)
    assert "ds." in str(info.value)


def test_reader_names_a_missing_file(tmp_path):
    prefix = write(tmp_path / "ds")
    os.remove(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match=r"ds\.bin"):
        IndexedDataset(prefix)
