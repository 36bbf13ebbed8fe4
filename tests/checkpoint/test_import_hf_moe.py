"""convert_checkpoint.py import-hf / export-hf for Mixture-of-Experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): an
import at any TP x PP x EP computes transformers' logits and loss, exports back bit for bit in either spelling
of the experts, trains the same under every layout, and what no table holds is refused by name."""
import contextlib
import io
import json
import shutil
import subprocess

import pytest
import torch

from tests.checkpoint.conftest import error_line, run_tool
from tests.checkpoint.hf_models import VOCAB, save_mixtral, save_qwen2_moe, save_qwen3_moe
from tests.checkpoint.test_import_hf import _edit_config
from tests.data.corpus_mix import load_tool

MODELS = {"mixtral": save_mixtral, "qwen2_moe": save_qwen2_moe, "qwen3_moe": save_qwen3_moe}
LAYOUTS = ((1, 1, 1), (2, 2, 1), (1, 2, 2))  # (TP, PP, EP)
SEQ = 32

convert_checkpoint = load_tool("convert_checkpoint")


def convert(*argv):
    """convert_checkpoint.py's main() in this process: a CompletedProcess of its exit status, stdout and stderr."""
    argv = [str(a) for a in argv]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = convert_checkpoint.main(argv)
    return subprocess.CompletedProcess(argv, code, stdout.getvalue(), stderr.getvalue())


def import_hf(source, output, tp=1, pp=1, ep=1, check=True):
    result = convert("import-hf", "--input", source, "--output", output, "--target-tensor-model-parallel-size", tp,
                     "--target-pipeline-model-parallel-size", pp, "--target-expert-model-parallel-size", ep,
                     "--seq-length", SEQ)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """name -> (save_pretrained folder, the transformers model)."""
    root = tmp_path_factory.mktemp("hf_moe")
    return {name: (root / name, save(root / name)) for name, save in MODELS.items()}


class Imports(dict):
    """(name, tp, pp, ep) -> imported checkpoint folder, imported on first use (a test of one model imports
    only that model's layouts)."""

    def __init__(self, hf, root):
        super().__init__()
        self.hf, self.root = hf, root

    def __missing__(self, key):
        name, *layout = key
        self[key] = folder = self.root / "_".join(map(str, key))
        import_hf(self.hf[name][0], folder, *layout)
        return folder


@pytest.fixture(scope="module")
def imported(hf, tmp_path_factory):
    return Imports(hf, tmp_path_factory.mktemp("imported_moe"))


def tokens(seed=0, batch=2):
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def our_logits(checkpoint, ids):
    from megatron_lite.checkpoint.dense import load_dense_model

    _, model = load_dense_model(str(checkpoint))
    with torch.no_grad():
        return model.eval()(ids, torch.arange(ids.shape[1]).expand_as(ids))[..., :VOCAB]


def relative_error(theirs, ours):
    return ((ours - theirs).norm() / theirs.norm()).item()


def test_the_routers_send_tokens_to_every_expert_so_a_wrong_expert_order_cannot_hide(hf):
    """Each model's first MoE layer routes some of the test tokens to each of its experts: a mapping that swapped
    two experts, or gate with up, changes the logits the other tests compare."""
    for name, (_, model) in hf.items():
        captured = {}
        gate = next(m for n, m in model.named_modules() if n.endswith("mlp.gate") or n.endswith("block_sparse_moe.gate"))
        handle = gate.register_forward_hook(lambda module, args, out: captured.update(indices=out[2]))
        with torch.no_grad():
            model(tokens())
        handle.remove()
        assert set(captured["indices"].flatten().tolist()) == set(range(gate.weight.shape[0])), name


@pytest.mark.parametrize("name", list(MODELS))
def test_an_imported_moe_model_gives_transformers_logits_at_every_target_layout(name, hf, imported):
    _, model = hf[name]
    ids = tokens()
    with torch.no_grad():
        theirs = model(ids).logits
    for layout in LAYOUTS:
        assert relative_error(theirs, our_logits(imported[(name, *layout)], ids)) <= 1e-5, layout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_import_then_export_gives_back_every_tensor_bit_for_bit(name, dtype, hf, tmp_path):
    from safetensors.torch import load_file

    folder, model = hf[name]
    if dtype == "bfloat16":
        model = MODELS[name](tmp_path / "fp32")
        model.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
        folder = tmp_path / "bf16"
    import_hf(folder, tmp_path / "ckpt", 2, 2, 2)
    run_tool("tools/convert_checkpoint.py", "export-hf", "--load", str(tmp_path / "ckpt"), "--output",
             str(tmp_path / "out"), "--dtype", dtype)
    original, exported = load_file(str(folder / "model.safetensors")), load_file(str(tmp_path / "out" /
                                                                                      "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == list(model.config.architectures) and config["vocab_size"] == VOCAB


@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_fused_spelling_of_the_experts_imports_as_save_pretrained_files_do(name, hf, imported,
                                                                                       tmp_path):
    """transformers 5's state_dict() holds each layer's experts fused (mlp.experts.gate_up_proj [E, 2F, h],
    down_proj [E, h, F]) and Mixtral's router as mlp.gate: a folder written from it imports to the same files."""
    from safetensors.torch import save_file

    folder, model = hf[name]
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(folder / "config.json", fused / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    import_hf(fused, tmp_path / "ckpt", 2, 2, 1)
    ours, reference = tmp_path / "ckpt" / "iter_0000000", imported[(name, 2, 2, 1)] / "iter_0000000"
    layer_files = sorted(p.name for p in reference.iterdir() if p.name.startswith("layer_"))
    assert layer_files and sorted(p.name for p in ours.iterdir() if p.name.startswith("layer_")) == layer_files
    for file in layer_files:
        a, b = torch.load(ours / file, weights_only=True), torch.load(reference / file, weights_only=True)
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), file


@pytest.mark.parametrize("name", list(MODELS))
def test_from_hf_takes_either_spelling_of_the_experts_to_the_imported_weights(name, hf, imported):
    """from_hf() (a state dict in memory: transformers 5's fused one, or save_pretrained's per-expert file) gives
    the weights the streaming importer wrote."""
    from safetensors.torch import load_file

    from megatron_lite.checkpoint.dense import load_dense_model
    from megatron_lite.checkpoint.hf_import import ARCHITECTURES

    folder, model = hf[name]
    config, ours = load_dense_model(str(imported[(name, 1, 1, 1)]))
    module, dense = ARCHITECTURES[model.config.architectures[0]], ours.state_dict()
    for spelling in (dict(model.state_dict()), load_file(str(folder / "model.safetensors"))):
        got = module.from_hf(spelling, config.model)
        assert any(".experts.weight1" in k for k in got)
        for key, tensor in got.items():
            assert torch.equal(tensor, dense[key]), key


def _edit_tensors(src, dst, drop=(), add=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


REFUSALS = {
    "missing expert": ("mixtral", lambda f, d: _edit_tensors(f, d, drop=["model.layers.1.block_sparse_moe.experts.3.w3"
                                                                         ".weight"]),
                       "lacks the tensor model.layers.1.block_sparse_moe.experts.3.w3.weight"),
    "extra expert": ("qwen3_moe", lambda f, d: _edit_tensors(f, d, add={"model.layers.1.mlp.experts.4.up_proj.weight":
                                                                        torch.zeros(16, 32)}),
                     "has the tensor model.layers.1.mlp.experts.4.up_proj.weight"),
    "expert shape": ("qwen2_moe", lambda f, d: _edit_config(f, d, moe_intermediate_size=8),
                     "model.layers.0.mlp.experts.0.gate_proj.weight is [16, 32], the config needs [8, 32]"),
    "router jitter": ("mixtral", lambda f, d: _edit_config(f, d, router_jitter_noise=0.1),
                      "router_jitter_noise = 0.1 is not supported"),
    "no sparse layer": ("qwen3_moe", lambda f, d: _edit_config(f, d, decoder_sparse_step=5),
                        "leave no layer with experts"),
    "top-k past the experts": ("mixtral", lambda f, d: _edit_config(f, d, num_experts_per_tok=5),
                               "num_experts_per_tok = 5 is more than the 4 experts"),
    "qwen2-moe window": ("qwen2_moe", lambda f, d: _edit_config(f, d, use_sliding_window=True, sliding_window=16),
                         "use_sliding_window / layer_types ask for sliding-window layers"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_an_moe_folder_we_cannot_represent_exits_2_naming_the_field_or_tensor_and_writes_nothing(case, hf, tmp_path):
    name, make, expected = REFUSALS[case]
    folder = make(hf[name][0], tmp_path / "in")
    line = error_line(import_hf(folder, tmp_path / "out", check=False))
    assert expected in line, line
    assert not (tmp_path / "out").exists()


def test_a_target_ep_that_does_not_divide_the_experts_is_refused_naming_the_flag(hf, tmp_path):
    line = error_line(import_hf(hf["mixtral"][0], tmp_path / "out", ep=3, check=False))
    assert "--target-expert-model-parallel-size 3 does not divide the model's 4 experts" in line, line
    assert "use one of 1, 2, 4" in line and not (tmp_path / "out").exists()


EXPORT_REFUSALS = {
    "sigmoid router": (["--moe-router-score-function", "sigmoid"], "scores experts by softmax"),
    "expert bias": (["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"],
                    "scores experts by softmax"),
    "groups": (["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"], "routes without expert groups"),
    "mixtral pre-softmax": (["--moe-router-pre-softmax"], "this model was built with --moe-router-pre-softmax"),
    "mixtral dense layer": (["--moe-layer-freq", "[1,0]"], "this model was built with --moe-layer-freq [1,0]"),
    "qwen2-moe ungated shared expert": (["--moe-shared-expert-intermediate-size", "24"],
                                        # it has the width: only the gate is missing (before: both were named)
                                        "this model was built without --moe-shared-expert-gate (Mixtral"),
    "qwen3-moe shared expert": (["--qk-layernorm", "--moe-shared-expert-intermediate-size", "24",
                                 "--moe-shared-expert-gate"], "Qwen3MoeForCausalLM has no shared expert"),
    "gelu experts": (["--no-swiglu"], None),
}


@pytest.mark.parametrize("case", list(EXPORT_REFUSALS))
def test_export_refuses_an_moe_model_no_architecture_holds_naming_the_flag(case):
    from megatron_lite.arguments import parse_args
    from megatron_lite.checkpoint.format import CheckpointError
    from megatron_lite.checkpoint.hf_export import architecture_of

    extra, expected = EXPORT_REFUSALS[case]
    llama = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "rope"]
    if "--no-swiglu" in extra:
        llama, extra = [f for f in llama if f != "--swiglu"], []
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--max-position-embeddings", "16", "--vocab-size", str(VOCAB), "--num-experts", "4",
             "--moe-ffn-hidden-size", "16", "--micro-batch-size", "1", "--global-batch-size", "1", *llama, *extra]
    config = parse_args(flags, world_size=1)[0]
    with pytest.raises(CheckpointError) as refused:
        architecture_of(config)
    assert (expected or "needs the Llama-family block; this model was built without --swiglu") in str(refused.value)


def evaluate(ckpt, corpus, nproc, ep):
    import re

    from tests.entry_points import run_entry

    result = run_entry(["tools/evaluate.py", "--load", ckpt, "--data-path", corpus[0], "--split", SPLIT,
                        "--eval-iters", "1", "--expert-model-parallel-size", ep, "--global-batch-size", EVAL_BATCH],
                       nproc=nproc, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return float(re.search(r"loss (\d+\.\d+)", result.stdout).group(1))


def evaluation_samples(ckpt, corpus):
    from megatron_lite.config import parse_data_path, parse_split
    from megatron_lite.inference.evaluation import evaluation_samples

    return evaluation_samples(str(ckpt), parse_data_path([corpus[0]]), parse_split(SPLIT), "valid", 1,
                              EVAL_BATCH)


SPLIT = "90,10,0"
EVAL_BATCH = 2  # samples evaluated: two data-parallel ranks at EP 2 take one each


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_evaluate_on_an_imported_moe_model_gives_transformers_loss_at_every_layout(name, hf, imported, corpus):
    from tests.checkpoint.hf_models import hf_loss

    _, model = hf[name]
    expected = hf_loss(model, evaluation_samples(imported[(name, 1, 1, 1)], corpus))
    for tp, pp, ep in LAYOUTS:  # EP over the data-parallel ranks: world TP x PP x EP
        loss = evaluate(imported[(name, tp, pp, ep)], corpus, tp * pp * ep, ep)
        assert loss == pytest.approx(expected, rel=1e-5), (tp, pp, ep)


def _train(corpus, ckpt, tp, pp, dp, ep, save, tb):
    from tests.checkpoint.conftest import data_args, scalars
    from tests.checkpoint.test_import_hf import TRAIN
    from tests.entry_points import run_entry

    args = ["pretrain_gpt.py", *TRAIN, *data_args(corpus), "--tensor-model-parallel-size", tp,
            "--pipeline-model-parallel-size", pp, "--expert-model-parallel-size", ep, "--load", ckpt,
            "--use-checkpoint-args", "--save", save, "--tensorboard-dir", tb, "--zero-stage", "1"]
    result = run_entry([str(a) for a in args], tp * pp * dp, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return scalars(tb, "train/loss")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_training_from_an_moe_import_gives_the_same_losses_at_dp2_ep2_and_tp2_pp2_and_transformers_loads_its_export(
        name, hf, imported, corpus, tmp_path):
    import transformers

    ep2 = _train(corpus, imported[(name, 1, 1, 1)], 1, 1, 2, 2, tmp_path / "ep2", tmp_path / "tb_ep2")
    tp2pp2 = _train(corpus, imported[(name, 2, 2, 1)], 2, 2, 1, 1, tmp_path / "tp2pp2", tmp_path / "tb_tp2pp2")
    assert sorted(ep2) == sorted(tp2pp2) == [1, 2] and ep2[1] != ep2[2]
    for step in ep2:
        assert ep2[step] == pytest.approx(tp2pp2[step], rel=1e-5), step
    run_tool("tools/convert_checkpoint.py", "export-hf", "--load", str(tmp_path / "ep2"), "--output",
             str(tmp_path / "hf_out"))
    architecture = hf[name][1].config.architectures[0]
    theirs = getattr(transformers, architecture).from_pretrained(str(tmp_path / "hf_out")).eval()
    ids = tokens(seed=3)
    with torch.no_grad():
        got = theirs(ids).logits
    assert relative_error(got, our_logits(tmp_path / "ep2", ids)) <= 1e-5
    assert not torch.equal(our_logits(tmp_path / "ep2", ids), our_logits(imported[(name, 1, 1, 1)], ids))


@pytest.mark.slow
def test_greedy_generation_from_a_mixtral_imported_without_tokenizer_files_equals_transformers_greedy_tokens(
        hf, imported, corpus):
    """The folder has no tokenizer files (save_pretrained of a model alone): generate.py is told the tokenizer
    by flags. transformers' continuation is its own forward's argmax, token by token."""
    import sentencepiece

    _, model = hf["mixtral"]
    sp = sentencepiece.SentencePieceProcessor(model_file=corpus[1])
    prompt, new = "def main(self):", 32
    ids = sp.encode(prompt)
    with torch.no_grad():
        theirs = torch.tensor([ids])
        for _ in range(new):
            theirs = torch.cat([theirs, model(theirs).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", corpus[1]]
    result = run_tool("tools/generate.py", "--load", str(imported[("mixtral", 1, 1, 1)]), "--prompt", prompt,
                      "--max-new-tokens", str(new), "--no-stop-at-eod", *flags)
    assert result.stdout.strip().splitlines()[-1] == sp.decode(theirs[0].tolist())
    # The ids themselves, without a tokenizer (the import's NullTokenizer reads and writes ids).
    result = run_tool("tools/generate.py", "--load", str(imported[("mixtral", 1, 1, 1)]), "--prompt",
                      " ".join(map(str, ids)), "--max-new-tokens", str(new), "--no-stop-at-eod")
    assert [int(i) for i in result.stdout.strip().splitlines()[-1].split()] == theirs[0].tolist()
