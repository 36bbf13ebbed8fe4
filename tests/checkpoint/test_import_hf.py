"""convert_checkpoint.py import-hf: a Hugging Face model becomes a checkpoint of ours at any TP x PP that
computes transformers' loss, trains the same under every layout, and exports back bit for bit."""
import contextlib
import io
import json
import os
import re
import subprocess

import pytest
import torch

from megatron_lite.checkpoint.format import METADATA
from tests.checkpoint.conftest import data_args, error_line, run_tool, scalars
from tests.checkpoint.hf_models import VOCAB, hf_loss, save_gpt2, save_llama, save_qwen3
from tests.data.corpus_mix import load_tool
from tests.entry_points import run_entry

SPLIT = "90,10,0"
TRAIN = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
         "--lr-warmup-iters", "1", "--train-iters", "2", "--log-interval", "1", "--eval-interval", "2",
         "--eval-iters", "1", "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5"]
MODELS = {"llama": save_llama, "gpt2": save_gpt2, "qwen3": save_qwen3}
HF_CLASSES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "qwen3": "Qwen3ForCausalLM"}


convert_checkpoint = load_tool("convert_checkpoint")


def import_hf(source, output, tp=1, pp=1, check=True, flags=()):
    """convert_checkpoint.py import-hf, its main() in this process (a CompletedProcess of its exit status and
    stderr): the same code path as the command line, without an interpreter's start-up per import."""
    argv = ["import-hf", "--input", str(source), "--output", str(output), "--target-tensor-model-parallel-size",
            str(tp), "--target-pipeline-model-parallel-size", str(pp), "--seq-length", "32", *map(str, flags)]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = convert_checkpoint.main(argv)
    result = subprocess.CompletedProcess(argv, code, stdout.getvalue(), stderr.getvalue())
    if check:
        assert code == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """name -> (folder, the transformers model)."""
    root = tmp_path_factory.mktemp("hf")
    return {name: (root / name, save(root / name)) for name, save in MODELS.items()}


@pytest.fixture(scope="module")
def imported(hf, tmp_path_factory):
    """(name, tp, pp) -> imported checkpoint folder, for every model at (1,1), (2,2) and (4,1)."""
    root = tmp_path_factory.mktemp("imported")
    out = {}
    for name, (folder, _) in hf.items():
        for tp, pp in ((1, 1), (2, 2), (4, 1)):
            out[(name, tp, pp)] = str(root / f"{name}_tp{tp}pp{pp}")
            import_hf(folder, out[(name, tp, pp)], tp, pp)
    return out


def evaluate(ckpt, corpus, nproc):
    result = run_entry(["tools/evaluate.py", "--load", ckpt, "--data-path", corpus[0], "--split", SPLIT,
                           "--eval-iters", "1"], nproc=nproc, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return float(re.search(r"loss (\d+\.\d+)", result.stdout).group(1))


def evaluation_samples(ckpt, corpus):
    from megatron_lite.config import parse_data_path, parse_split
    from megatron_lite.inference.evaluation import evaluation_samples

    return evaluation_samples(ckpt, parse_data_path([corpus[0]]), parse_split(SPLIT), "valid", 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_evaluate_on_an_imported_model_gives_transformers_loss_at_every_layout(name, hf, imported, corpus):
    _, model = hf[name]
    expected = hf_loss(model, evaluation_samples(imported[(name, 1, 1)], corpus))
    for tp, pp in ((1, 1), (2, 2), (4, 1)):
        loss = evaluate(imported[(name, tp, pp)], corpus, tp * pp)
        assert loss == pytest.approx(expected, rel=1e-5), (tp, pp)


@pytest.mark.parametrize("name", list(MODELS))
def test_import_then_export_gives_back_every_tensor_bit_for_bit(name, hf, imported, tmp_path):
    from safetensors.torch import load_file

    folder, _ = hf[name]
    run_tool("tools/convert_checkpoint.py", "export-hf", "--load", imported[(name, 2, 2)], "--output",
             str(tmp_path / "out"))
    original, exported = load_file(str(folder / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["vocab_size"] == VOCAB


def test_each_tp_rank_file_of_an_import_holds_only_its_slice(imported):
    folder = os.path.join(imported[("llama", 2, 2)], "iter_0000000")
    for name in os.listdir(folder):
        if name.startswith("layer_"):
            for key, tensor in torch.load(os.path.join(folder, name), weights_only=True).items():
                assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), (name, key)


def test_a_bfloat16_model_exports_back_bit_for_bit_with_dtype_bfloat16(tmp_path):
    from safetensors.torch import load_file

    model = save_llama(tmp_path / "fp32", seed=21)
    model.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    import_hf(tmp_path / "bf16", tmp_path / "ckpt", 2, 1)
    run_tool("tools/convert_checkpoint.py", "export-hf", "--load", str(tmp_path / "ckpt"), "--output",
             str(tmp_path / "out"), "--dtype", "bfloat16")
    original, exported = load_file(str(tmp_path / "bf16" / "model.safetensors")), \
        load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(exported[k].dtype == torch.bfloat16 and torch.equal(exported[k], t) for k, t in original.items())


def _train(corpus, ckpt, tp, pp, save, tb, *extra):
    args = ["pretrain_gpt.py", *TRAIN, *data_args(corpus), "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--load", ckpt, "--use-checkpoint-args", "--save", str(save),
            "--tensorboard-dir", str(tb), *extra]
    result = run_entry(args, tp * pp, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result, scalars(tb, "train/loss")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_training_from_an_import_gives_the_same_losses_at_tp2_pp2_and_tp1_exports_to_transformers_and_finetunes(
        name, hf, imported, corpus, tmp_path):
    import transformers

    from megatron_lite.checkpoint.dense import load_dense_model

    result, losses22 = _train(corpus, imported[(name, 2, 2)], 2, 2, tmp_path / "c22", tmp_path / "tb22")
    assert "iteration 0, a fresh optimizer" in result.stdout, result.stdout[-2000:]
    _, losses11 = _train(corpus, imported[(name, 4, 1)], 1, 1, tmp_path / "c11", tmp_path / "tb11")
    assert sorted(losses22) == sorted(losses11) == [1, 2]
    for step in losses22:
        assert losses22[step] == pytest.approx(losses11[step], rel=1e-5), step
    # The first step's loss is the imported model's loss on the first batch: transformers' model's.
    assert losses22[1] != losses22[2]

    run_tool("tools/convert_checkpoint.py", "export-hf", "--load", str(tmp_path / "c22"), "--output",
             str(tmp_path / "hf_out"))
    cls = getattr(transformers, HF_CLASSES[name])
    theirs = cls.from_pretrained(str(tmp_path / "hf_out")).eval()
    assert json.loads((tmp_path / "hf_out" / "config.json").read_text())["architectures"] == [HF_CLASSES[name]]
    _, ours = load_dense_model(str(tmp_path / "c22"))
    samples = evaluation_samples(str(tmp_path / "c22"), corpus)
    tokens = torch.tensor([s["tokens"].tolist() for s in samples])
    with torch.no_grad():
        expected = ours(tokens, torch.arange(tokens.shape[1]).expand_as(tokens))[..., :VOCAB]
        got = theirs(tokens).logits
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    if name != "llama":
        return
    # --finetune of the trained checkpoint starts where an import of its export starts: the same weights,
    # iteration 0, a fresh optimizer and the data from its start.
    result, finetuned = _train(corpus, str(tmp_path / "c22"), 1, 1, tmp_path / "ft", tmp_path / "tb_ft",
                               "--finetune")
    assert "(--finetune): iteration 0, a fresh optimizer" in result.stdout, result.stdout[-2000:]
    import_hf(tmp_path / "hf_out", tmp_path / "reimported")
    _, from_import = _train(corpus, str(tmp_path / "reimported"), 1, 1, tmp_path / "ri", tmp_path / "tb_ri")
    assert sorted(finetuned) == [1, 2]
    for step in finetuned:
        assert finetuned[step] == pytest.approx(from_import[step], rel=1e-5), step


def test_use_checkpoint_args_takes_the_model_flags_and_refuses_a_flag_that_disagrees(imported):
    from megatron_lite.arguments import parse_args
    from megatron_lite.config import ConfigError

    ckpt = imported[("llama", 2, 2)]
    base = ["--load", ckpt, "--use-checkpoint-args", "--seq-length", "16", "--micro-batch-size", "1",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    config, _ = parse_args(base, world_size=4)
    m = config.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size) == (4, 32, 4, 2, 64)
    assert (m.swiglu, m.normalization, m.add_bias_linear, m.position_embedding_type, m.use_rope_scaling) == \
        (True, "RMSNorm", False, "rope", True)
    assert (m.vocab_size, m.max_position_embeddings, m.seq_length, m.untie_embeddings_and_output_weights) == \
        (VOCAB, 16384, 16, True)
    with pytest.raises(ConfigError, match=r"--hidden-size: checkpoint 32, this run 64"):
        parse_args(base + ["--hidden-size", "64"], world_size=4)
    with pytest.raises(ConfigError, match="add --use-checkpoint-args"):
        parse_args([a for a in base if a != "--use-checkpoint-args"], world_size=4)
    with pytest.raises(ConfigError, match="--use-checkpoint-args takes the model flags from --load's checkpoint"):
        parse_args(["--use-checkpoint-args"], world_size=1)
    with pytest.raises(ConfigError, match="--finetune loads the weights of --load's checkpoint; give --load"):
        parse_args(["--finetune"], world_size=1)


def test_use_checkpoint_args_takes_qwen3s_head_width_and_qk_norm_and_a_run_without_them_is_refused(imported):
    from megatron_lite.arguments import parse_args
    from megatron_lite.config import ConfigError

    ckpt = imported[("qwen3", 2, 2)]
    base = ["--load", ckpt, "--seq-length", "16", "--micro-batch-size", "1", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2"]
    m = parse_args(base + ["--use-checkpoint-args"], world_size=4)[0].model
    assert (m.kv_channels, m.qk_layernorm, m.hidden_size) == (16, True, 32)
    assert not m.untie_embeddings_and_output_weights
    with pytest.raises(ConfigError, match=r"--kv-channels \(the head width\): checkpoint 16, this run 8"):
        parse_args(base + ["--use-checkpoint-args", "--kv-channels", "8"], world_size=4)
    with pytest.raises(ConfigError, match=r"--qk-layernorm: checkpoint on, this run off"):
        parse_args(base, world_size=4)


K2_YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 512, "beta_fast": 1.0,
           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
"""Kimi K2's rope_scaling (betas 1 and 1; its context 4096 scaled down with the tiny model): the betas Megatron-LM's
own K2 recipe lost to the default 32, because its flag reached only non-MLA YaRN."""


def test_kimi_k2s_yarn_betas_survive_the_import_the_checkpoint_and_use_checkpoint_args(tmp_path):
    from megatron_lite.arguments import parse_args
    from megatron_lite.config import ConfigError

    save_llama(tmp_path / "hf", rope_scaling=dict(K2_YARN), max_position_embeddings=16384)
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    base = ["--load", str(tmp_path / "ckpt"), "--seq-length", "16", "--micro-batch-size", "1"]
    m = parse_args(base + ["--use-checkpoint-args"], world_size=1)[0].model
    assert (m.position_embedding_type, m.rope_type, m.rotary_scaling_factor) == ("rope", "yarn", 32.0)
    assert (m.yarn_beta_fast, m.yarn_beta_slow, m.yarn_original_max_position_embeddings) == (1.0, 1.0, 512)
    assert (m.mscale, m.mscale_all_dim, m.yarn_correction_range_round_to_int) == (1.0, 1.0, True)
    with pytest.raises(ConfigError, match=r"--yarn-beta-fast: checkpoint 1.0, this run 32.0"):
        parse_args(base + ["--use-checkpoint-args", "--yarn-beta-fast", "32"], world_size=1)


class Payload:
    """Unpickling this runs os.system: what a malicious pytorch_model.bin does."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_payload_in_pytorch_model_bin_does_not_run_and_nothing_is_written(tmp_path):
    folder = tmp_path / "evil"
    model = save_gpt2(folder)
    (folder / "model.safetensors").unlink()
    state = dict(model.state_dict())
    state["transformer.wte.weight"] = Payload(tmp_path / "ran")
    torch.save(state, str(folder / "pytorch_model.bin"))
    line = error_line(import_hf(folder, tmp_path / "out", check=False))
    assert "pytorch_model.bin: refused" in line and "could run code" in line, line
    assert not (tmp_path / "ran").exists()
    assert not (tmp_path / "out").exists()


def test_a_clean_pytorch_model_bin_imports_like_its_safetensors(hf, tmp_path):
    from megatron_lite.checkpoint.merge import dense_state_dict
    from megatron_lite.checkpoint.reader import CheckpointReader

    folder, model = hf["llama"]
    (tmp_path / "bin").mkdir()
    for name in ("config.json",):
        (tmp_path / "bin" / name).write_text((folder / name).read_text())
    torch.save(model.state_dict(), str(tmp_path / "bin" / "pytorch_model.bin"))
    import_hf(folder, tmp_path / "a")
    import_hf(tmp_path / "bin", tmp_path / "b")
    a = dense_state_dict(CheckpointReader(str(tmp_path / "a")))[1]
    b = dense_state_dict(CheckpointReader(str(tmp_path / "b")))[1]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _edit_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _drop_tensor(src, dst, name):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


REFUSALS = {
    "architecture": (lambda f, d: _edit_config(f, d, architectures=["BertForMaskedLM"]),
                     'architectures = ["BertForMaskedLM"] is not supported'),
    "missing weight": (lambda f, d: _drop_tensor(f, d, "model.layers.1.mlp.up_proj.weight"),
                       "lacks the tensor model.layers.1.mlp.up_proj.weight"),
    "shape": (lambda f, d: _edit_config(f, d, intermediate_size=96),
              # import-hf takes no model flag: the refusal names config.json's fields (before: "the model flags")
              "model.layers.0.mlp.gate_proj.weight is [64, 32], the config needs [96, 32]: the fields of "),
    "shape names the field": (lambda f, d: _edit_config(f, d, intermediate_size=96), "intermediate_size 96"),
    # validation's refusal in config.json's terms (before: "Use --num-query-groups ...", a flag import-hf lacks)
    "key/value heads named as config.json names them": (lambda f, d: _edit_config(f, d, num_key_value_heads=3),
                                                         "num_key_value_heads 3 does not divide num_attention_heads"),
    "rope scaling": (lambda f, d: _edit_config(f, d, rope_scaling={"rope_type": "dynamic", "factor": 4.0},
                                               rope_parameters=None),
                     'rope_scaling.rope_type = "dynamic" is not supported'),
    "yarn without its original context": (
        lambda f, d: _edit_config(f, d, rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None),
        "original_max_position_embeddings"),
    "biases": (lambda f, d: _edit_config(f, d, attention_bias=True), "attention_bias = true is not supported"),
    "tied head": (lambda f, d: _edit_config(f, d, tie_word_embeddings=True),
                  "ties the output head to the embedding (tie_word_embeddings), but lm_head.weight differs"),
    "sliding window of 1": (lambda f, d: _edit_config(f, d, architectures=["MistralForCausalLM"],
                                                      model_type="mistral", sliding_window=1),
                            "sliding_window = 1 must be at least 2"),
    "qwen3 sliding window": (lambda f, d: _edit_config(f, d, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                                                       use_sliding_window=True, sliding_window=16),
                             "use_sliding_window = true is not supported"),
    "qwen3 without qk-norm weights": (lambda f, d: _edit_config(f, d, architectures=["Qwen3ForCausalLM"],
                                                                model_type="qwen3"),
                                      "lacks the tensor model.layers.0.self_attn.k_norm.weight and 7 more"),
    "no heads": (lambda f, d: _edit_config(f, d, num_attention_heads=0),
                 "num_attention_heads = 0 must be at least 1"),
    "no heads (Mistral)": (lambda f, d: _edit_config(f, d, architectures=["MistralForCausalLM"], model_type="mistral",
                                                     num_attention_heads=0),
                           "num_attention_heads = 0 must be at least 1"),
    "infinite layers": (lambda f, d: _edit_config(f, d, num_hidden_layers=float("inf")),
                        "num_hidden_layers"),
    "nan epsilon": (lambda f, d: _edit_config(f, d, rms_norm_eps=float("nan")), "rms_norm_eps = NaN must be a finite "
                                                                                "number"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_an_hf_folder_we_cannot_represent_exits_2_naming_the_field_or_tensor_and_writes_nothing(case, hf, tmp_path):
    make, expected = REFUSALS[case]
    folder = make(hf["llama"][0], tmp_path / "in")
    line = error_line(import_hf(folder, tmp_path / "out", check=False))
    assert expected in line, line
    assert not (tmp_path / "out").exists()


def _convert(*argv):
    """convert_checkpoint.py's main() in this process: (exit status, its one error line or '')."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = convert_checkpoint.main([str(a) for a in argv])
    return error_line(subprocess.CompletedProcess(argv, code, stdout.getvalue(), stderr.getvalue()))


def test_an_unknown_partition_method_is_refused_naming_the_target_flag_in_import_hf_and_reshard(hf, imported,
                                                                                                 tmp_path):
    line = _convert("import-hf", "--input", hf["llama"][0], "--output", tmp_path / "a",
                    "--target-pipeline-partition-method", "bogus")
    assert "--target-pipeline-partition-method 'bogus' is not one of cost" in line, line
    line = _convert("reshard", "--load", imported[("llama", 1, 1)], "--save", tmp_path / "b",
                    "--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "2",
                    "--target-pipeline-partition-method", "bogus")
    assert "--target-pipeline-partition-method 'bogus' is not one of cost" in line, line
    line = _convert("reshard", "--load", imported[("llama", 1, 1)], "--save", tmp_path / "c",
                    "--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "2",
                    "--target-pipeline-partition-method", "type:(")
    assert "--target-pipeline-partition-method type:( is not a regular expression" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_seq_length_past_the_models_positions_names_import_hfs_own_flag_and_the_config_field(hf, tmp_path):
    line = _convert("import-hf", "--input", hf["llama"][0], "--output", tmp_path / "out", "--seq-length", "100000")
    assert "--seq-length 100000 is longer than" in line and "max_position_embeddings 16384" in line, line
    assert "use --seq-length 16384 or less" in line and "--max-position-embeddings" not in line, line
    assert not (tmp_path / "out").exists()


def _converted(*argv):
    """Whether convert_checkpoint.py's main() in this process exits 0."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return convert_checkpoint.main([str(a) for a in argv]) == 0


def _files(folder):
    """Every file under `folder` with its bytes: what a replaced or refused output holds."""
    return {os.path.relpath(os.path.join(root, n), folder): open(os.path.join(root, n), "rb").read()
            for root, _, names in os.walk(folder) for n in names}


def test_checkpoint_commands_replace_an_earlier_output_only_with_overwrite_and_never_their_source(hf, imported,
                                                                                                 tmp_path):
    source, out = imported[("llama", 1, 1)], tmp_path / "resharded"
    reshard = ["reshard", "--load", source, "--save", out, "--target-tensor-model-parallel-size", "1",
               "--no-optimizer"]
    assert _converted(*reshard, "--target-pipeline-model-parallel-size", "1")
    first = _files(out)
    line = _convert(*reshard, "--target-pipeline-model-parallel-size", "2")
    assert f"--save {out} already exists" in line and "--overwrite" in line, line
    assert _files(out) == first
    assert _converted(*reshard, "--target-pipeline-model-parallel-size", "2", "--overwrite")
    assert _files(out) != first and json.loads((out / "iter_0000000" / METADATA).read_text())["layout"]["pipeline_model_parallel_size"] == 2
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary, no previous copy left
    before = _files(source)
    line = _convert("reshard", "--load", source, "--save", source, "--target-tensor-model-parallel-size", "1",
                    "--target-pipeline-model-parallel-size", "2", "--overwrite")
    assert f"--save {source} is where --load {source} is read from" in line, line
    line = _convert("import-hf", "--input", hf["llama"][0], "--output", hf["llama"][0], "--overwrite")
    assert f"--output {hf['llama'][0]} is where --input {hf['llama'][0]} is read from" in line, line
    line = _convert("merge", "--load", source, "--output", os.path.join(source, "latest"), "--overwrite")
    assert "is where --load" in line, line
    assert _files(source) == before


def test_a_mistral_with_a_sliding_window_imports_as_a_window_and_exports_back_as_mistral_bit_for_bit(tmp_path):
    import transformers
    from safetensors.torch import load_file

    from tests.checkpoint.hf_models import _perturb, llama_config

    fields = llama_config(rope_scaling=None).to_dict()
    fields.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=8)
    torch.manual_seed(13)
    mistral = _perturb(transformers.MistralForCausalLM(transformers.MistralConfig.from_dict(fields)), 13).eval()
    mistral.save_pretrained(str(tmp_path / "hf"))
    import_hf(tmp_path / "hf", tmp_path / "ckpt", tp=2, pp=2)
    saved = json.loads((tmp_path / "ckpt" / "iter_0000000" / METADATA).read_text())["config"]["model"]
    assert saved["window_size"] == [7, 0] and saved["window_attn_skip_freq"] is None
    assert _converted("export-hf", "--load", tmp_path / "ckpt", "--output", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"] and config["sliding_window"] == 8
    original, exported = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "out"))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], t) for k, t in original.items())


def _generated(ckpt, prompt, *flags):
    """generate.py's greedy text (prompt and 8 new tokens, whatever the end-of-document id) for the checkpoint."""
    result = run_tool("tools/generate.py", "--load", ckpt, "--prompt", prompt, "--max-new-tokens", "8",
                      "--no-stop-at-eod", *flags)
    return result.stdout.strip().splitlines()[-1]  # DeepSpeed may log a line before it


def test_generate_reads_an_import_without_tokenizer_files_with_tokenizer_flags_as_with_the_one_recorded_at_import(
        hf, imported, corpus, tmp_path):
    import sentencepiece

    spm = corpus[1]
    flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", spm]
    import_hf(hf["llama"][0], tmp_path / "recorded", flags=flags)
    prompt = "def main(self):"
    by_flags = _generated(imported[("llama", 1, 1)], prompt, *flags)
    recorded = _generated(str(tmp_path / "recorded"), prompt)
    # Without a tokenizer the import reads and writes ids (NullTokenizer): the same ids, decoded here.
    sp = sentencepiece.SentencePieceProcessor(model_file=spm)
    ids = [int(i) for i in _generated(imported[("llama", 1, 1)], " ".join(map(str, sp.encode(prompt)))).split()]
    assert len(ids) == len(sp.encode(prompt)) + 8
    assert by_flags == recorded == sp.decode(ids), (by_flags, recorded, ids)


def test_import_hf_records_the_tokenizer_its_flags_name_for_generate_evaluate_and_pretrain_gpt(hf, corpus, tmp_path,
                                                                                                monkeypatch):
    from megatron_lite.arguments import parse_args
    from megatron_lite.data.sidecar import tokenizer_sha256

    folder, model = hf["llama"]
    spm = corpus[1]
    monkeypatch.chdir(os.path.dirname(spm))  # a relative path, recorded absolute: the tools run from anywhere
    result = import_hf(folder, tmp_path / "ckpt", flags=["--tokenizer-model", os.path.basename(spm)])
    assert f"tokenizer: --tokenizer-type SentencePieceTokenizer --tokenizer-model {spm}, recorded" in result.stdout
    metadata = json.loads((tmp_path / "ckpt" / "iter_0000000" / METADATA).read_text())
    data = metadata["config"]["data"]
    assert (data["tokenizer_type"], data["tokenizer_model"], data["vocab_file"]) == ("SentencePieceTokenizer", spm,
                                                                                      None)
    assert metadata["tokenizer_sha256"] == tokenizer_sha256("SentencePieceTokenizer", spm)
    config, _ = parse_args(["--load", str(tmp_path / "ckpt"), "--use-checkpoint-args", "--seq-length", "16",
                            "--micro-batch-size", "1"], world_size=1)
    assert (config.data.tokenizer_type, config.data.tokenizer_model) == ("SentencePieceTokenizer", spm)
    # evaluate.py with no tokenizer flag reads the data with it (its sidecar is checked against it)
    loss = evaluate(str(tmp_path / "ckpt"), corpus, 1)
    assert loss == pytest.approx(hf_loss(model, evaluation_samples(str(tmp_path / "ckpt"), corpus)), rel=1e-5)


def test_a_tokenizer_with_more_ids_than_the_models_vocabulary_is_refused_naming_the_flag(corpus, tmp_path):
    spm = corpus[1]  # 400 pieces
    save_llama(tmp_path / "hf", vocab_size=300)
    line = _convert("import-hf", "--input", tmp_path / "hf", "--output", tmp_path / "refused", "--tokenizer-model", spm)
    said = f"--tokenizer-model {spm} (SentencePieceTokenizer) has 400 pieces, but the model"
    assert said in line and f"of {tmp_path / 'hf' / 'config.json'} has a vocabulary of 300" in line, line
    assert not (tmp_path / "refused").exists()
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    for tool, flags in (("tools/generate.py", ["--prompt", "def"]), ("tools/evaluate.py", ["--data-path", corpus[0]])):
        line = error_line(run_tool(tool, "--load", tmp_path / "ckpt", *flags, "--tokenizer-model", spm, check=False))
        assert said in line and f"in {tmp_path / 'ckpt'} has a vocabulary of 300" in line, line


@pytest.mark.parametrize("flags, said", [
    (["--tokenizer-model", "{missing}"], "--tokenizer-model {missing}: no such file"),
    (["--tokenizer-type", "SentencePieceTokenizer", "--vocab-file", "{spm}"],
     "--vocab-file {spm} is not read by --tokenizer-type SentencePieceTokenizer, which takes --tokenizer-model"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{spm}"],
     "--tokenizer-type GPT2BPETokenizer needs --vocab-file VOCAB.json and --merge-file MERGES.txt"),
])
def test_import_hf_refuses_tokenizer_flags_that_name_no_usable_tokenizer_and_writes_nothing(hf, corpus, tmp_path,
                                                                                            flags, said):
    paths = {"missing": str(tmp_path / "missing.model"), "spm": corpus[1]}
    line = _convert("import-hf", "--input", hf["llama"][0], "--output", tmp_path / "out",
                    *[f.format(**paths) for f in flags])
    assert said.format(**paths) in line, line
    assert not (tmp_path / "out").exists()


def test_export_hf_copies_the_tokenizer_its_flags_name_for_a_model_without_one_after_checking_its_vocabulary(
        imported, corpus, tmp_path):
    """Issue 61, class 6: before, --tokenizer-model was dropped without a word for a NullTokenizer model (an import
    without tokenizer files), and a tokenizer of another vocabulary was copied beside any model."""
    from tokenizers import Tokenizer, models

    ckpt = imported[("llama", 1, 1)]
    out = tmp_path / "with_tokenizer"
    run_tool("tools/convert_checkpoint.py", "export-hf", "--load", ckpt, "--output", out, "--tokenizer-model",
             corpus[1])
    assert (out / "tokenizer.model").read_bytes() == open(corpus[1], "rb").read()
    other = tmp_path / "other" / "tokenizer.json"
    other.parent.mkdir()
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(10)}, unk_token="w0")).save(str(other))
    refused = tmp_path / "refused"
    line = error_line(run_tool("tools/convert_checkpoint.py", "export-hf", "--load", ckpt, "--output", refused,
                               "--tokenizer-model", str(other.parent), check=False))
    assert f"--tokenizer-model {other.parent} (HuggingFaceTokenizer) has 10 tokens, but the model in {ckpt} has a " \
           f"vocabulary of {VOCAB}" in line, line
    assert not refused.exists()
