"""What --load may hold, and what a resume may change: checked by validation, before any process group exists,
with every difference listed by flag and both values."""
import json
import os

import pytest

from megatron_lite.arguments import parse_args
from megatron_lite.config import ConfigError
from tests.checkpoint.conftest import pretrain_in_one_process, run_tool

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "2", "--vocab-size", "100", "--train-iters", "4"]


def _config(*extra, world_size=1):
    return parse_args(TINY + list(extra), world_size=world_size)


def _fake_checkpoint(folder, config, tokenizer_sha256=None, iteration=2):
    """The metadata of a checkpoint of `config` (what validation reads; no weights needed)."""
    tag = f"iter_{iteration:07d}"
    os.makedirs(os.path.join(folder, tag))
    p = config.parallel
    with open(os.path.join(folder, tag, "megatron_lite.json"), "w") as f:
        json.dump({"iteration": iteration, "consumed_samples": 8, "tokenizer_sha256": tokenizer_sha256,
                   "layout": {"tensor_model_parallel_size": p.tensor_model_parallel_size,
                              "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
                              "data_parallel_size": p.data_parallel_size},
                   "config": config.to_dict()}, f)
    with open(os.path.join(folder, "latest"), "w") as f:
        f.write(tag)
    return str(folder)


@pytest.mark.parametrize("kind", ["missing", "empty", "only our lock, an unfinished save and other folders"])
def test_a_load_folder_without_a_checkpoint_yet_is_accepted(tmp_path, kind):
    folder = tmp_path / "ckpt"
    if kind != "missing":
        folder.mkdir()
    if kind.startswith("only"):
        (folder / ".megatron_lite.lock").write_text("")
        (folder / "tmp-iter_0000002-20261124-abc").mkdir()
        (folder / "data-cache").mkdir()  # what examples/slurm/pretrain_gpt.sbatch keeps there
        (folder / "tensorboard").mkdir()
    config, _ = _config("--load", str(folder))
    assert config.training.load == str(folder)


def test_what_is_not_a_checkpoint_folder_is_refused_naming_what_it_is(tmp_path):
    merged = tmp_path / "model.pt"
    merged.write_bytes(b"x")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"x")
    no_latest = tmp_path / "copied"
    (no_latest / "iter_0000002").mkdir(parents=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "latest").write_text("iter_0000009")
    expected = {merged: "is a merged checkpoint file (tools/convert_checkpoint.py merge), not a checkpoint folder",
                hf: "is a Hugging Face model folder (config.json and weights), not a megatron_lite checkpoint",
                no_latest: "has iter_0000002 but no 'latest' file naming the complete one",
                other: "holds files (notes.txt) but no 'latest' file: it is not a megatron_lite checkpoint folder",
                broken: "names 'iter_0000009', but"}
    for path, words in expected.items():
        with pytest.raises(ConfigError) as info:
            _config("--load", str(path))
        assert words in str(info.value) and str(path) in str(info.value), str(info.value)


def test_a_resume_that_changes_the_model_lists_every_difference_by_flag(tmp_path):
    saved, _ = _config()
    folder = _fake_checkpoint(tmp_path / "ckpt", saved)
    with pytest.raises(ConfigError) as info:
        # the same parameter shapes: only the heads say the model is another one
        _config("--load", folder, "--num-attention-heads", "8")
    assert "--num-attention-heads: checkpoint 4, this run 8" in str(info.value)
    with pytest.raises(ConfigError) as info:
        _config("--load", folder, "--hidden-size", "64", "--num-layers", "3", "--untie-embeddings-and-output-weights")
    message = str(info.value)
    for part in ("--num-layers: checkpoint 2, this run 3", "--hidden-size: checkpoint 32, this run 64",
                 "--ffn-hidden-size: checkpoint 128, this run 256",
                 "--untie-embeddings-and-output-weights: checkpoint off, this run on"):
        assert part in message, message


def test_a_resume_that_changes_the_model_is_told_what_works_and_values_read_as_typed(tmp_path):
    """Issue 61, class 9: before, a typed --num-attention-heads 8 was told to add --use-checkpoint-args, which then
    refused it again (a typed flag wins over the checkpoint's, then is compared); and values read "None", "True"."""
    saved, _ = _config()
    folder = _fake_checkpoint(tmp_path / "ckpt", saved)
    with pytest.raises(ConfigError) as info:
        _config("--load", folder, "--num-attention-heads", "8", "--swiglu", "--window-size", "3,0")
    message = str(info.value)
    for part in ("--swiglu: checkpoint off, this run on", "--window-size: checkpoint none, this run 3,0",
                 "give the checkpoint's values, or add --use-checkpoint-args and leave out the model flags that "
                 "differ (one given here overrides the checkpoint's value, then is compared)"):
        assert part in message, message
    with pytest.raises(ConfigError) as info:
        _config("--load", folder, "--num-layers", "3", "--use-checkpoint-args")
    assert str(info.value).endswith("): leave out the model flags that differ (one given here overrides the "
                                    "checkpoint's value, then is compared), or start a new run with another --save")


def test_a_resume_may_change_the_schedule_data_batch_and_regularisation(tmp_path):
    saved, _ = _config()
    folder = _fake_checkpoint(tmp_path / "ckpt", saved)
    config, _ = _config("--load", folder, "--train-iters", "10", "--lr", "3e-4", "--min-lr", "1e-5",
                        "--lr-decay-style", "linear", "--override-opt-param-scheduler",  # resume.py: say which
                        "--global-batch-size", "4", "--hidden-dropout", "0",
                        "--eval-interval", "5", "--save-interval", "5", "--save", str(tmp_path / "new"), "--seed", "9", "--clip-grad", "0.5")
    assert config.optimizer.lr == 3e-4 and config.training.train_iters == 10


def test_a_resume_may_change_the_layout_zero_stage_and_precision_at_zero_0_and_1(tmp_path):
    saved, _ = _config("--pipeline-model-parallel-size", "2", "--zero-stage", "1", world_size=2)
    folder = _fake_checkpoint(tmp_path / "ckpt", saved)
    config, _ = _config("--load", folder, "--tensor-model-parallel-size", "2", "--bf16", world_size=4)
    assert config.parallel.data_parallel_size == 2


def test_a_zero_2_run_takes_only_a_checkpoint_of_its_own_layout_zero_stage_and_precision(tmp_path):
    saved, _ = _config("--pipeline-model-parallel-size", "2", world_size=2)
    folder = _fake_checkpoint(tmp_path / "ckpt", saved)
    with pytest.raises(ConfigError) as info:
        _config("--load", folder, "--zero-stage", "2", "--bf16", world_size=2)
    message = str(info.value)
    for part in ("--pipeline-model-parallel-size: checkpoint 2, this run 1",
                 "the data-parallel size (world size / (TP x CP x PP)): checkpoint 1, this run 2",
                 "--zero-stage: checkpoint 0, this run 2", "precision: checkpoint fp32, this run bf16",
                 "a checkpoint moves between layouts and precisions at ZeRO 0 and 1 only"):
        assert part in message, message


@pytest.fixture(scope="module")
def second_tokenizer(corpus, tmp_path_factory):
    """Another SentencePiece model with the same vocabulary size: only its SHA-256 tells them apart."""
    root = tmp_path_factory.mktemp("tokenizer2")
    jsonl = os.path.join(os.path.dirname(corpus[0]), "corpus.jsonl")
    run_tool("tools/train_tokenizer.py", "--input", jsonl, "--vocab-size", "400", "--model-type", "unigram",
             "--model-prefix", str(root / "other"))
    return str(root / "other.model")


def test_a_resume_with_another_tokenizer_model_is_refused(corpus, second_tokenizer, tmp_path):
    from megatron_lite.data.sidecar import file_sha256

    prefix, model = corpus
    args = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "4", "--data-path", prefix]
    saved, _ = parse_args(args + ["--tokenizer-model", model], world_size=1)
    folder = _fake_checkpoint(tmp_path / "ckpt", saved, tokenizer_sha256=file_sha256(model))
    parse_args(args + ["--tokenizer-model", model, "--load", folder], world_size=1)
    # Megatron data without a sidecar: the data check cannot object, the checkpoint's record does.
    plain = tmp_path / "plain_text_document"
    for suffix in (".bin", ".idx"):
        os.symlink(prefix + suffix, str(plain) + suffix)
    with pytest.raises(ConfigError) as info:
        parse_args([a if a != prefix else str(plain) for a in args] + ["--tokenizer-model", second_tokenizer,
                                                                       "--load", folder], world_size=1)
    assert "--tokenizer-model: checkpoint trained with a model of SHA-256 " in str(info.value)


def test_data_tokenized_with_another_model_is_refused_and_data_without_a_sidecar_gets_a_note(corpus,
                                                                                           second_tokenizer,
                                                                                           tmp_path):
    prefix, model = corpus
    args = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "4"]
    with pytest.raises(ConfigError) as info:
        parse_args(args + ["--data-path", prefix, "--tokenizer-model", second_tokenizer], world_size=1)
    assert f"--data-path {prefix} was tokenized with a SentencePiece model of SHA-256 " in str(info.value)
    assert f"but --tokenizer-model {second_tokenizer} is " in str(info.value)
    plain = tmp_path / "plain_text_document"
    for suffix in (".bin", ".idx"):
        os.symlink(prefix + suffix, str(plain) + suffix)
    _, notes = parse_args(args + ["--data-path", str(plain), "--tokenizer-model", second_tokenizer], world_size=1)
    assert any("no plain_text_document.json sidecar" in n for n in notes), notes


@pytest.mark.slow
def test_a_job_whose_load_is_its_save_starts_at_iteration_0_with_a_line_then_resumes(corpus, tmp_path):
    folder = str(tmp_path / "ckpt")
    first = pretrain_in_one_process(corpus, ["--train-iters", "2", "--eval-iters", "0", "--load", folder,
                                             "--save", folder])
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"--load {folder} holds no checkpoint yet: starting from iteration 0" in first.stdout
    second = pretrain_in_one_process(corpus, ["--train-iters", "3", "--eval-iters", "0", "--load", folder,
                                              "--save", folder, "--override-opt-param-scheduler"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {folder} at iteration 2" in second.stdout
