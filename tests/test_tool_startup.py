"""--help, a bad flag and a missing input cost no torch start-up: every entry point answers them before it
imports torch, DeepSpeed, TensorBoard, transformers or our C++ kernels (about 2 s of CPU on the 2-core VM).

Each case runs the script in a fresh `python -X importtime` process and reads the module column of what it
imported; a refusal exits 2 with one `error:` line naming the flag (and the path), --help exits 0.
"""
import os
import re
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "deepspeed", "tensorboard", "transformers", "megatron_lite._C")
IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)\s*$")

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
         "--vocab-size", "128", "--global-batch-size", "8"]

# (script, argv, what --help prints); {missing}: a path that does not exist, {out}: a fresh folder's path.
HELP = [
    ("pretrain_gpt.py", [], "--data-path"),
    ("tools/convert_checkpoint.py", [], "import-hf"),
    ("tools/convert_checkpoint.py", ["merge"], "--strip-vocab-padding"),
    ("tools/convert_checkpoint.py", ["reshard"], "--target-tensor-model-parallel-size"),
    ("tools/convert_checkpoint.py", ["universal"], "--save"),
    ("tools/convert_checkpoint.py", ["export-hf"], "--dtype"),
    ("tools/convert_checkpoint.py", ["import-hf"], "--input"),
    ("tools/evaluate.py", [], "--eval-iters"),
    ("tools/generate.py", [], "--max-new-tokens"),
    ("tools/estimate_memory.py", [], "--world-size"),
    ("tools/tune_parallelism.py", [], "calibrate | plan | sweep | report"),
    ("tools/tune_parallelism.py", ["plan"], "--gpu-memory-gb"),
    ("tools/tune_parallelism.py", ["calibrate"], "--world-size"),
    ("tools/tune_parallelism.py", ["sweep"], "--launcher"),
    ("tools/tune_parallelism.py", ["report"], "--results"),
    ("tools/preprocess_data.py", [], "--tokenizer-type"),
    ("tools/merge_datasets.py", [], "--output-prefix"),
    ("tools/train_tokenizer.py", [], "--model-prefix"),
    ("tools/make_corpus.py", [], "--max-docs"),
    ("tools/synthetic_data.py", [], "--num-tokens"),
]

# (script, argv, words the error line holds)
MISSING = [
    ("pretrain_gpt.py", ["--data-path", "{missing}", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"],
     ["--data-path {missing}.bin", "no such file"]),
    ("pretrain_gpt.py", ["--tokenizer-model", "{missing}"], ["--tokenizer-model {missing}", "no such file"]),
    ("pretrain_gpt.py", ["--load", "{file}"], ["--load {file}", "not a checkpoint folder"]),
    ("pretrain_gpt.py", ["--use-checkpoint-args", "--load", "{missing}"], ["--load {missing}", "holds no checkpoint"]),
    ("tools/convert_checkpoint.py", ["import-hf", "--input", "{missing}", "--output", "{out}"],
     ["--input {missing}", "no such folder"]),
    ("tools/convert_checkpoint.py", ["merge", "--load", "{missing}", "--output", "{out}.pt"],
     ["--load {missing}", "no such folder"]),
    ("tools/convert_checkpoint.py", ["reshard", "--load", "{missing}", "--save", "{out}",
                                     "--target-tensor-model-parallel-size", "1",
                                     "--target-pipeline-model-parallel-size", "1"],
     ["--load {missing}", "no such folder"]),
    ("tools/convert_checkpoint.py", ["universal", "--load", "{missing}", "--save", "{out}"],
     ["--load {missing}", "no such folder"]),
    ("tools/convert_checkpoint.py", ["export-hf", "--load", "{missing}", "--output", "{out}"],
     ["--load {missing}", "no such folder"]),
    ("tools/convert_checkpoint.py", ["merge", "--load", "{missing}", "--output", "{file}"],
     ["--output {file} already exists"]),
    ("tools/evaluate.py", ["--load", "{missing}"], ["--load {missing}", "no such folder"]),
    ("tools/generate.py", ["--load", "{missing}", "--prompt", "x"], ["--load {missing}", "no such folder"]),
    ("tools/generate.py", ["--load", "{missing}", "--prompt", "x", "--tokenizer-type", "SentencePieceTokenizer",
                           "--tokenizer-model", "{missing}"], ["--tokenizer-model {missing}", "no such file"]),
    ("tools/evaluate.py", ["--load", "{missing}", "--vocab-file", "{missing}", "--merge-file", "{file}"],
     ["--vocab-file {missing}", "no such file"]),
    ("tools/estimate_memory.py", ["--world-size", "1", "--tokenizer-model", "{missing}"],
     ["--tokenizer-model {missing}", "no such file"]),
    ("tools/tune_parallelism.py", ["plan", "--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gb", "80",
                                   "--profile", "{missing}", *MODEL], ["profile {missing}", "calibrate"]),
    ("tools/tune_parallelism.py", ["sweep", "--plan", "{missing}", "--results", "{out}", "--launcher", "torchrun"],
     ["--plan {missing}"]),
    ("tools/tune_parallelism.py", ["report", "--results", "{missing}"], ["--results {missing}", "no such folder"]),
    ("tools/preprocess_data.py", ["--input", "{missing}", "--output-prefix", "{out}", "--tokenizer-type",
                                  "NullTokenizer", "--vocab-size", "128"], ["--input {missing}", "no such file"]),
    ("tools/preprocess_data.py", ["--input", "{file}", "--output-prefix", "{out}", "--tokenizer-type",
                                  "SentencePieceTokenizer", "--tokenizer-model", "{missing}"],
     ["--tokenizer-model {missing}", "no such file"]),
    ("tools/merge_datasets.py", ["--input", "{missing}", "--output-prefix", "{out}"],
     ["--input {missing}", "no such dataset"]),
    ("tools/train_tokenizer.py", ["--input", "{missing}", "--model-prefix", "{out}"],
     ["--input {missing}", "no such file"]),
    ("tools/make_corpus.py", ["--root", "{missing}", "--output", "{out}"], ["--root {missing}", "not a folder"]),
]

# Issue 43's reproductions that need no checkpoint: each was a traceback or a wrong word before.
# {folder}: a byte-level BPE tokenizer folder; {binary}: a file of random bytes.
ISSUE_43 = [
    ("pretrain_gpt.py", ["--data-path", "nan", "{missing}", "1", "{missing}", "--tokenizer-type", "NullTokenizer",
                         "--vocab-size", "128"], ["--data-path weight nan", "positive finite number"]),
    ("pretrain_gpt.py", ["--data-path", "inf", "{missing}", "1", "{missing}", "--tokenizer-type", "NullTokenizer",
                         "--vocab-size", "128"], ["--data-path weight inf", "positive finite number"]),
    ("pretrain_gpt.py", ["--distributed-timeout-minutes", "1e15"],
     ["--distributed-timeout-minutes: must be at most 10000000, got 1e15"]),
    ("tools/tune_parallelism.py", ["plan", "--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gb", "80",
                                   "--profile", "{binary}", *MODEL], ["--profile {binary}", "not UTF-8 text"]),
    ("tools/convert_checkpoint.py", ["import-hf", "--input", "{missing}", "--output", "{folder}"],
     ["--output {folder} already exists", "--overwrite"]),
    ("pretrain_gpt.py", ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "{folder}"],
     ["--tokenizer-model {folder} is a folder", "HuggingFaceTokenizer"]),
    ("tools/preprocess_data.py", ["--input", "{file}", "--output-prefix", "{file}/x", "--tokenizer-type",
                                  "NullTokenizer", "--vocab-size", "128"],
     ["--output-prefix {file}/x cannot be created: {file} is a file"]),
    ("tools/convert_checkpoint.py", ["import-hf", "--input", "{missing}", "--output", "{file}/sub"],
     ["--output {file}/sub cannot be created: {file} is a file"]),
    ("tools/convert_checkpoint.py", ["export-hf", "--load", "{missing}", "--output", "{file}/sub"],
     ["--output {file}/sub cannot be created: {file} is a file"]),
    ("tools/train_tokenizer.py", ["--input", "{file}", "--model-prefix", "{out}", "--vocab-size", "0"],
     ["--vocab-size", "must be at least 1, got 0"]),
]

BAD_FLAG = [
    ("pretrain_gpt.py", ["--num-layers", "-1"], ["--num-layers", "at least 1"]),
    ("pretrain_gpt.py", ["--tokenizer-type", "Bogus"], ["--tokenizer-type", "invalid choice"]),
    ("tools/convert_checkpoint.py", ["bogus"], ["command", "invalid choice"]),
    ("tools/convert_checkpoint.py", ["export-hf", "--load", "{missing}", "--output", "{out}", "--dtype", "int8"],
     ["--dtype", "invalid choice"]),
    ("tools/evaluate.py", ["--load", "{missing}", "--eval-iters", "0"], ["--eval-iters", "at least 1"]),
    ("tools/evaluate.py", ["--load", "{missing}", "--split-name", "bogus"], ["--split-name", "invalid choice"]),
    ("tools/generate.py", ["--load", "{missing}", "--prompt", "x", "--max-new-tokens", "0"],
     ["--max-new-tokens: must be at least 1, got 0"]),
    ("tools/generate.py", ["--load", "{missing}", "--prompt", "x", "--tokenizer-type", "Bogus"],
     ["--tokenizer-type", "invalid choice"]),
    ("tools/evaluate.py", ["--load", "{missing}", "--tokenizer-type", "SentencePieceTokenizer", "--vocab-file",
                           "{file}"], ["--vocab-file {file} is not read by --tokenizer-type SentencePieceTokenizer"]),
    ("tools/convert_checkpoint.py", ["import-hf", "--input", "{missing}", "--output", "{out}", "--tokenizer-type",
                                     "Bogus"], ["--tokenizer-type", "invalid choice"]),
    ("tools/estimate_memory.py", ["--world-size", "0"], ["--world-size", "at least 1"]),
    ("tools/estimate_memory.py", ["--world-size", "1", "--num-layers", "-1"], ["--num-layers", "at least 1"]),
    ("tools/tune_parallelism.py", ["bogus"], ["give a command"]),
    ("tools/tune_parallelism.py", ["plan", "--nodes", "0", "--gpus-per-node", "8", "--gpu-memory-gb", "80"],
     ["--nodes", "at least 1"]),
    ("tools/tune_parallelism.py", ["calibrate", "--output", "{out}", "--world-size", "0"],
     ["--world-size", "at least 1"]),
    ("tools/preprocess_data.py", ["--input", "{file}", "--output-prefix", "{out}", "--tokenizer-type",
                                  "NullTokenizer", "--vocab-size", "128", "--workers", "0"],
     ["--workers", "at least 1"]),
    ("tools/preprocess_data.py", ["--input", "{file}", "--output-prefix", "{out}", "--tokenizer-type", "Bogus"],
     ["--tokenizer-type", "invalid choice"]),
    ("tools/merge_datasets.py", ["--input", "{missing}", "--output-prefix", "{out}", "--bogus"],
     ["unrecognized arguments: --bogus"]),
    ("tools/train_tokenizer.py", ["--input", "{file}", "--model-prefix", "{out}", "--model-type", "bogus"],
     ["--model-type", "invalid choice"]),
    ("tools/make_corpus.py", ["--max-docs", "abc"], ["--max-docs: must be a whole number, got abc"]),
    ("tools/synthetic_data.py", ["--output-dir", "{out}", "--vocab-size", "abc"],
     ["--vocab-size: must be a whole number, got abc"]),
]


def _run(script, argv, tmp_path):
    """(exit code, stdout, stderr without the import lines, the modules imported), from a fresh interpreter."""
    file = tmp_path / "corpus.jsonl"
    file.write_text('{"text": "a document"}\n')
    folder = tmp_path / "bpe"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    binary = tmp_path / "profile.json"
    binary.write_bytes(bytes([0x91, 0x00, 0xff, 0x13]) * 64)
    paths = {"missing": str(tmp_path / "missing"), "out": str(tmp_path / "out"), "file": str(file),
             "folder": str(folder), "binary": str(binary)}
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "DS_ACCELERATOR")}
    env["PYTHONPATH"] = REPO_ROOT
    proc = subprocess.run([sys.executable, "-X", "importtime", script, *[a.format(**paths) for a in argv]],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    modules, rest = set(), []
    for line in proc.stderr.splitlines():
        match = IMPORT_LINE.match(line)
        if match:
            modules.add(match.group(1))
        elif not line.startswith("import time:"):
            rest.append(line)
    return proc.returncode, proc.stdout, rest, modules, paths


def _heavy(modules):
    """Which of HEAVY (or a submodule of one) was imported."""
    return [h for h in HEAVY if any(m == h or m.startswith(h + ".") for m in modules)]


def _id(case):
    script, argv = case[0], case[1]
    return f"{os.path.basename(script)} {' '.join(argv) or '-'}"


@pytest.mark.parametrize("script,argv,shown", HELP, ids=[_id(case) for case in HELP])
def test_help_exits_0_listing_the_flags_without_importing_torch(script, argv, shown, tmp_path):
    code, out, err, modules, _ = _run(script, [*argv, "--help"], tmp_path)
    assert code == 0, err
    assert shown in out
    assert _heavy(modules) == []


def _assert_refused(script, argv, words, tmp_path):
    code, out, err, modules, paths = _run(script, argv, tmp_path)
    errors = [line for line in err if "error:" in line]
    assert code == 2 and len(errors) == 1, (code, out, err)
    for word in words:
        assert word.format(**paths) in errors[0]
    assert "Traceback" not in "\n".join(err)
    assert _heavy(modules) == [], f"{script} imported {_heavy(modules)} before refusing"


@pytest.mark.parametrize("script,argv,words", MISSING, ids=[_id(case) for case in MISSING])
def test_a_missing_input_exits_2_naming_the_flag_and_path_without_importing_torch(script, argv, words, tmp_path):
    _assert_refused(script, argv, words, tmp_path)


@pytest.mark.parametrize("script,argv,words", BAD_FLAG, ids=[_id(case) for case in BAD_FLAG])
def test_a_bad_flag_exits_2_naming_the_flag_without_importing_torch(script, argv, words, tmp_path):
    _assert_refused(script, argv, words, tmp_path)


@pytest.mark.parametrize("script,argv,words", ISSUE_43, ids=[_id(case) for case in ISSUE_43])
def test_issue_43_reproductions_exit_2_in_one_line_naming_the_flag_without_importing_torch(script, argv, words,
                                                                                           tmp_path):
    _assert_refused(script, argv, words, tmp_path)
