"""Every output flag of every tool refuses an existing target unless --overwrite, and a path under a file always:
exit 2, one line naming the flag, nothing written. With --overwrite the previous output is replaced, whole.

Each tool's main() runs in this process (tests/data/corpus_mix.py's load_tool): the refusals come before the
tool reads its inputs, so the inputs of the refused cases need not exist.
"""
import json
import os

import pytest

from tests import tool_calls
from tests.data.corpus_mix import load_tool
from tests.tool_calls import snapshot

TOOLS = {name: load_tool(name) for name in ("train_tokenizer", "preprocess_data", "merge_datasets", "make_corpus",
                                            "tune_parallelism", "convert_checkpoint", "synthetic_data")}
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
         "--vocab-size", "128", "--global-batch-size", "8"]
PLAN = ["plan", "--nodes", "1", "--gpus-per-node", "2", "--gpu-memory-gb", "80", "--device", "cpu", *MODEL]


def call(tool, *argv):
    """(exit status, stdout, stderr) of tools/<tool>.py's main(argv) in this process."""
    return tool_calls.call(TOOLS[tool].main, argv)


def refused(tool, *argv):
    """The one error line of a refusal (exit 2, no traceback)."""
    return tool_calls.refusal(TOOLS[tool].main, argv)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    assert call("make_corpus", "--output", path, "--max-docs", "30", "--max-bytes", "300000")[0] == 0
    return path


# (tool, argv with {target} for the output flag and {missing} for inputs, the flag, what the output consists of:
# suffixes added to {target}, or "folder").
OUTPUTS = [
    ("train_tokenizer", ["--input", "{missing}", "--model-prefix", "{target}"], "--model-prefix", [".model"]),
    ("train_tokenizer", ["--input", "{missing}", "--model-prefix", "{target}", "--model-type", "byte-level-bpe"],
     "--model-prefix", "folder"),
    ("preprocess_data", ["--input", "{missing}", "--output-prefix", "{target}", "--tokenizer-type", "NullTokenizer",
                         "--vocab-size", "128"], "--output-prefix", ["_text_document.bin"]),
    ("preprocess_data", ["--input", "{missing}", "--output-prefix", "{target}", "--tokenizer-type", "NullTokenizer",
                         "--vocab-size", "128", "--num-shards", "2", "--shard-index", "1"], "--output-prefix",
     ["_text_document.shard-00001-of-00002.idx"]),
    ("merge_datasets", ["--input", "{missing}", "--output-prefix", "{target}"], "--output-prefix", [".json"]),
    ("make_corpus", ["--output", "{target}"], "--output", [""]),
    ("tune_parallelism", PLAN + ["--output", "{target}"], "--output", [""]),
    ("tune_parallelism", ["calibrate", "--output", "{target}"], "--output", [""]),
    ("tune_parallelism", ["report", "--results", "{missing}", "--output", "{target}"], "--output", ["/report.md"]),
    ("convert_checkpoint", ["merge", "--load", "{missing}", "--output", "{target}"], "--output", [""]),
    ("convert_checkpoint", ["reshard", "--load", "{missing}", "--save", "{target}",
                            "--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "1"],
     "--save", "folder"),
    ("convert_checkpoint", ["universal", "--load", "{missing}", "--save", "{target}"], "--save", "folder"),
    ("convert_checkpoint", ["export-hf", "--load", "{missing}", "--output", "{target}"], "--output", "folder"),
    ("convert_checkpoint", ["import-hf", "--input", "{missing}", "--output", "{target}"], "--output", "folder"),
]


def _id(case):
    return f"{case[0]} {case[1][0] if not case[1][0].startswith('-') else ''} {case[2]} {case[3]}".replace("  ", " ")


def _make_existing(target, consists_of):
    if consists_of == "folder":
        os.makedirs(target)
        with open(os.path.join(target, "precious"), "w") as f:
            f.write("kept")
    else:
        os.makedirs(os.path.dirname(str(target) + consists_of[0]), exist_ok=True)
        with open(str(target) + consists_of[0], "w") as f:
            f.write("kept")


@pytest.mark.parametrize("tool,argv,flag,consists_of", OUTPUTS, ids=[_id(c) for c in OUTPUTS])
def test_an_existing_output_is_refused_naming_the_flag_and_left_as_it_was(tool, argv, flag, consists_of, tmp_path):
    target = str(tmp_path / "out")
    _make_existing(target, consists_of)
    before = snapshot(tmp_path)
    paths = {"target": target, "missing": str(tmp_path / "missing")}
    line = refused(tool, *[a.format(**paths) for a in argv])
    assert f"{flag} {target}" in line and "already exists" in line and "--overwrite" in line, line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("tool,argv,flag,consists_of", OUTPUTS + [
    ("synthetic_data", ["--output-dir", "{target}", "--vocab-size", "128"], "--output-dir", "folder")],
    ids=[_id(c) for c in OUTPUTS] + ["synthetic_data --output-dir folder"])
def test_an_output_under_a_file_is_refused_naming_the_flag_and_the_file_even_with_overwrite(tool, argv, flag,
                                                                                            consists_of, tmp_path):
    file = tmp_path / "corpus.jsonl"
    file.write_text("{}\n")
    target = str(file / "sub")
    before = snapshot(tmp_path)
    paths = {"target": target, "missing": str(tmp_path / "missing")}
    overwrite = ["--overwrite"] if tool != "synthetic_data" else []
    line = refused(tool, *[a.format(**paths) for a in argv], *overwrite)
    assert f"{flag} {target} cannot be created: {file} is a file" in line, line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("model_type,written", [("bpe", "out.model"), ("byte-level-bpe", "out/tokenizer.json")])
def test_train_tokenizer_refuses_an_existing_model_prefix_and_replaces_it_with_overwrite(corpus, tmp_path,
                                                                                         model_type, written):
    argv = ["--input", corpus, "--model-prefix", tmp_path / "out", "--vocab-size", "400", "--num-threads", "1",
            "--model-type", model_type]
    assert call("train_tokenizer", *argv)[0] == 0
    first = (tmp_path / written).read_bytes()
    line = refused("train_tokenizer", *argv[:5], "500", *argv[6:])
    assert f"--model-prefix {tmp_path / 'out'} already exists" in line and "--overwrite" in line, line
    assert (tmp_path / written).read_bytes() == first
    assert call("train_tokenizer", *argv[:5], "500", *argv[6:], "--overwrite")[0] == 0
    assert (tmp_path / written).read_bytes() != first
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary, no previous copy left


def test_preprocess_data_refuses_an_existing_output_prefix_and_replaces_it_with_overwrite(tmp_path):
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"text": "1 2 3"}\n{"text": "4 5"}\n')
    argv = ["--input", ids, "--output-prefix", tmp_path / "data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "128"]
    assert call("preprocess_data", *argv)[0] == 0
    before = snapshot(tmp_path)
    line = refused("preprocess_data", *argv, "--append-eod")
    assert f"--output-prefix {tmp_path / 'data'} already exists ({tmp_path / 'data'}_text_document.bin)" in line, line
    assert snapshot(tmp_path) == before
    assert call("preprocess_data", *argv, "--append-eod", "--overwrite")[0] == 0
    assert (tmp_path / "data_text_document.bin").stat().st_size > before[str(tmp_path / "data_text_document.bin")].__len__()


def test_plan_refuses_an_existing_output_and_an_offload_json_of_other_content(tmp_path):
    plan = tmp_path / "plan.json"
    assert call("tune_parallelism", *PLAN, "--output", plan)[0] == 0
    offload = tmp_path / "zero3_offload_param.json"
    assert json.loads(offload.read_text()) == {"zero_optimization": {"offload_param": {"device": "cpu"}}}
    first = plan.read_bytes()
    line = refused("tune_parallelism", *PLAN, "--output", plan)
    assert f"--output {plan} already exists" in line, line
    assert call("tune_parallelism", *PLAN, "--output", plan, "--overwrite")[0] == 0
    assert json.loads(plan.read_text())["candidates"] == json.loads(first)["candidates"]
    offload.write_text('{"zero_optimization": {"stage": 3}}')  # the user's own file of that name
    other = tmp_path / "other.json"
    line = refused("tune_parallelism", *PLAN, "--output", other)
    assert f"{offload} already exists" in line and "--overwrite" in line, line
    assert offload.read_text() == '{"zero_optimization": {"stage": 3}}' and not other.exists()
