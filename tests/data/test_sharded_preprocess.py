import json
import os
import subprocess

import pytest
import sentencepiece

from megatron_lite.data.indexed_dataset import IndexedDataset
from megatron_lite.data.input_files import expand_inputs, shard_pieces
from tests.data.conftest import REPO_ROOT
from tests.data.corpus_mix import (
    BAD_LINES, merge_datasets, preprocess, preprocess_data, preprocess_shards, write_corpus_mix,
)


@pytest.fixture(scope="module")
def mix(corpus, tmp_path_factory):
    return write_corpus_mix(corpus, tmp_path_factory.mktemp("mix") / "corpus")


@pytest.fixture(scope="module")
def single_run(mix, spm_model, tmp_path_factory):
    prefix = tmp_path_factory.mktemp("single") / "corpus"
    assert preprocess(mix[0], prefix, spm_model) == 0
    return f"{prefix}_text_document"


def merged_run(mix, spm_model, folder, num_shards, capsys):
    preprocess_shards(mix[0], folder / "shards" / "corpus", spm_model, num_shards)
    capsys.readouterr()
    assert merge_datasets.main(["--input", str(folder / "shards"), "--output-prefix", str(folder / "merged")]) == 0
    return str(folder / "merged"), capsys.readouterr().out


@pytest.mark.parametrize("num_shards", [4, 7])
def test_shards_merged_in_order_are_byte_identical_to_one_run(mix, spm_model, single_run, num_shards, tmp_path,
                                                             capsys):
    merged, summary = merged_run(mix, spm_model, tmp_path, num_shards, capsys)
    for suffix in (".bin", ".idx"):
        with open(single_run + suffix, "rb") as one, open(merged + suffix, "rb") as joined:
            assert joined.read() == one.read(), suffix
    assert f"{BAD_LINES} bad lines were skipped" in summary
    sidecars = [json.loads(p.read_text()) for p in sorted((tmp_path / "shards").glob("*.json"))]
    assert [s["shard"]["index"] for s in sidecars] == list(range(num_shards))
    assert sum(s["bad_lines"] for s in sidecars) == BAD_LINES
    big_pieces = [p for s in sidecars for p in s["shard"]["pieces"] if p[0].endswith("a_big.jsonl")]
    assert len(big_pieces) >= 2, "the large plain file was not split by byte range"
    assert json.loads(open(merged + ".json").read())["documents"] == IndexedDataset(single_run).num_documents


def test_merged_dataset_reads_back_as_a_direct_sentencepiece_encode_of_every_document(mix, spm_model, tmp_path,
                                                                                     capsys):
    merged, _ = merged_run(mix, spm_model, tmp_path, 4, capsys)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    good = mix[1]
    ds = IndexedDataset(merged)
    assert ds.num_documents == len(good)
    assert [ds[i].tolist() for i in range(len(ds))] == [sp.encode(t) + [sp.eos_id()] for t in good if t]


def test_shard_boundaries_fall_on_line_starts_and_tile_the_input(mix):
    files = expand_inputs([mix[0]])
    assert [f.rsplit("/", 1)[1] for f in files] == ["a_big.jsonl", "b_part.jsonl.gz", "c_part.jsonl.zst",
                                                    "d_tail.jsonl"]
    for num_shards in (1, 3, 7, 50):
        pieces = [p for i in range(num_shards) for p in shard_pieces(files, num_shards, i)]
        covered = {}
        for piece in pieces:
            data = open(piece.path, "rb").read()
            assert piece.start == 0 or data[piece.start - 1:piece.start] == b"\n"
            if piece.path.endswith((".gz", ".zst")):
                assert (piece.start, piece.end) == (0, len(data))
            assert covered.get(piece.path, 0) == piece.start, "pieces of a file must follow each other"
            covered[piece.path] = piece.end
        assert covered == {f: len(open(f, "rb").read()) for f in files}


def test_a_shard_with_no_line_start_writes_an_empty_dataset(mix, spm_model, tmp_path):
    # 50 shards over four files: many ranges hold no line start, or sit inside a compressed file.
    files = expand_inputs([mix[0]])
    empty = [i for i in range(50) if not shard_pieces(files, 50, i)]
    assert empty
    assert preprocess(mix[0], tmp_path / "s" / "c", spm_model, "--num-shards", 50, "--shard-index", empty[0]) == 0
    shard = json.loads(next((tmp_path / "s").glob("*.json")).read_text())
    assert (shard["documents"], shard["bin_bytes"]) == (0, 0)
    assert IndexedDataset(str(next((tmp_path / "s").glob("*.idx")))[:-4]).num_documents == 0


@pytest.mark.parametrize("name", ["b_part.jsonl.gz", "c_part.jsonl.zst"])
def test_truncated_compressed_input_is_an_error_naming_the_file_and_writes_nothing(spm_model, tmp_path, capsys, mix,
                                                                                   name):
    data = open(os.path.join(os.path.dirname(mix[0]), name), "rb").read()
    bad = tmp_path / "in" / f"cut.{name}"
    bad.parent.mkdir()
    bad.write_bytes(data[:len(data) // 2])
    assert preprocess(bad, tmp_path / "out" / "x", spm_model) == 1
    assert f"cut.{name}: cannot be read" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_strict_names_a_bad_line_inside_a_byte_range_by_its_offset(mix, spm_model, tmp_path, capsys):
    big = os.path.join(os.path.dirname(mix[0]), "a_big.jsonl")
    data = open(big, "rb").read()
    bad_at = data.index(b'{"text": "unterminated')
    files = expand_inputs([mix[0]])
    # A shard whose piece of a_big.jsonl starts inside the file and holds the bad line.
    num_shards, index = next((n, i) for n in range(2, 12) for i in range(n) for p in shard_pieces(files, n, i)
                             if p.path == big and 0 < p.start <= bad_at < p.end)
    status = preprocess(mix[0], tmp_path / "s", spm_model, "--num-shards", num_shards, "--shard-index", index,
                        "--strict")
    err = capsys.readouterr().err
    assert status == 1 and "a_big.jsonl: line" in err and "invalid JSON" in err
    # "a_big.jsonl: line N after byte B: invalid JSON": line N counted from byte B is the bad line.
    where = err.split("a_big.jsonl: line ")[1]
    number, offset = int(where.split()[0]), int(where.split("after byte ")[1].split(":")[0])
    assert offset + len(b"".join(data[offset:].splitlines(keepends=True)[:number - 1])) == bad_at


def test_bad_shard_flags_and_unmatched_globs_exit_2(spm_model, tmp_path, capsys, mix):
    for extra, message in ((["--num-shards", 4], "go together"),
                           (["--num-shards", 4, "--shard-index", 4], "--shard-index 4 is outside")):
        assert preprocess(mix[0], tmp_path / "x", spm_model, *extra) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # argparse's own refusal of a number out of range
        preprocess(mix[0], tmp_path / "x", spm_model, "--num-shards", 0, "--shard-index", 0)
    assert refused.value.code == 2 and "argument --num-shards: must be at least 1, got 0" in capsys.readouterr().err
    assert preprocess(tmp_path / "nothing*.jsonl", tmp_path / "x", spm_model) == 2
    assert "matches no file" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []



@pytest.mark.slow
def test_slurm_array_script_tasks_and_merge_script_give_the_single_run_bytes(mix, spm_model, single_run, tmp_path):
    # Slurm's array variables set by hand (an array 3-4, so task ids are not shard indices);
    # tests/slurm runs the same scripts on a real cluster.
    scripts = os.path.join(REPO_ROOT, "examples", "slurm")
    env = dict(os.environ, REPO=REPO_ROOT, INPUT=f"{mix[0]}", OUTPUT_DIR=str(tmp_path / "shards"), NAME="c",
               TOKENIZER_MODEL=str(spm_model), SLURM_CPUS_PER_TASK="1", SLURM_ARRAY_TASK_MIN="3",
               SLURM_ARRAY_TASK_MAX="4", SLURM_ARRAY_TASK_COUNT="2", OUTPUT_PREFIX=str(tmp_path / "merged"))
    for task in (3, 4):
        subprocess.run(["bash", os.path.join(scripts, "preprocess_array.sbatch")], check=True, capture_output=True,
                       env=dict(env, SLURM_ARRAY_TASK_ID=str(task)), timeout=120)
    subprocess.run(["bash", os.path.join(scripts, "merge_shards.sbatch")], check=True, capture_output=True, env=env,
                   timeout=120)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"merged{suffix}").read_bytes() == open(single_run + suffix, "rb").read()


def test_inputs_keep_the_order_given_and_progress_counts_bytes_over_all_files(mix, spm_model, tmp_path, capsys):
    folder = os.path.dirname(mix[0])
    tail, big = os.path.join(folder, "d_tail.jsonl"), os.path.join(folder, "a_big.jsonl")
    assert preprocess(tail, tmp_path / "tail", spm_model) == 0
    assert preprocess(big, tmp_path / "big", spm_model) == 0
    capsys.readouterr()
    assert preprocess_data.main(["--input", tail, big, "--output-prefix", str(tmp_path / "both"),
                                 "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(spm_model),
                                 "--append-eod", "--log-interval", "1"]) == 0
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("processed")]
    total = (os.path.getsize(tail) + os.path.getsize(big)) / 1e6
    percents = [float(line.split("(")[-1].split("%")[0]) for line in progress]
    assert f"of {total:.1f} MB of input (100.0%)" in progress[-1] and percents == sorted(percents)
    assert any(0 < p < 100 * os.path.getsize(tail) / 1e6 / total + 1 for p in percents)
    # The two files in the order given are the two single-file datasets one after the other.
    assert merge_datasets.main(["--input", str(tmp_path / "tail_text_document"), str(tmp_path / "big_text_document"),
                                "--output-prefix", str(tmp_path / "joined")]) == 0
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"joined{suffix}").read_bytes() == (tmp_path / f"both_text_document{suffix}").read_bytes()


def test_a_file_named_twice_is_refused(mix, spm_model, tmp_path, capsys):
    big = os.path.join(os.path.dirname(mix[0]), "a_big.jsonl")
    assert preprocess_data.main(["--input", big, mix[0], "--output-prefix", str(tmp_path / "x"), "--tokenizer-type",
                                 "SentencePieceTokenizer", "--tokenizer-model", str(spm_model)]) == 2
    assert f"--input {big} is named twice" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
