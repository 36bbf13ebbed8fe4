"""convert_checkpoint.py import-hf / export-hf of a DeepseekV3ForCausalLM folder holding its multi-token prediction
layer as DeepSeek's release does (model.layers.{L}.*: transformers' MtpModel's random weights under DeepSeek's
names, experts one tensor each, with the copies of the embedding and head): imported at TP 2 x PP 2 x EP 2 it
computes transformers' logits and MtpModel's depth logits, exports back bit for bit into a folder that transformers
and its MtpModel load, and --use-checkpoint-args carries its depths. A folder without the layer (save_pretrained's):
tests/checkpoint/test_import_hf_deepseek_v3.py; the mapping: tests/model/test_hf_deepseek_v3_mtp.py."""
import json

import pytest
import torch

from tests.checkpoint.conftest import error_line
from tests.checkpoint.hf_models import VOCAB, save_deepseek_v3
from tests.checkpoint.test_import_hf import _edit_config
from tests.checkpoint.test_import_hf_moe import _edit_tensors, convert, import_hf, tokens
from tests.model.test_hf_deepseek_v3_mtp import deepseek_tensors, depth_logits, our_depth_logits, perturbed_mtp
from tests.model.test_hf_llama_reference import relative_error

transformers = pytest.importorskip("transformers")

TARGET = (2, 2, 2)  # TP, PP, EP: the depth's heads, rotary rows and experts split, on the last of two stages
LAYERS = 4  # save_deepseek_v3's; its MTP layer is model.layers.4


def per_expert(tensors):
    """transformers' fused experts ([E, 2F, h], gate rows first; [E, h, F]) one tensor per expert and projection,
    as save_pretrained and DeepSeek's release write them."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".experts.gate_up_proj"):
            base, ffn = name[:-len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :ffn].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, ffn:].clone()
        elif name.endswith(".experts.down_proj"):
            out.update({f"{name[:-len('down_proj')]}{e}.down_proj.weight": t[e].clone() for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(folder with the MTP layer, transformers' model, its MtpModel)."""
    from transformers.modeling_layers import MtpModel

    root = tmp_path_factory.mktemp("hf_deepseek_v3_mtp")
    model = save_deepseek_v3(root / "plain")
    mtp = perturbed_mtp(MtpModel(model, 1).eval())
    # The split by hand is save_pretrained's (checked on the main model's first MoE layer).
    from safetensors.torch import load_file
    saved, fused = load_file(str(root / "plain" / "model.safetensors")), model.state_dict()
    assert all(torch.equal(saved[k], t) for k, t in per_expert({k: v for k, v in fused.items()
                                                                  if ".layers.1.mlp.experts." in k}).items())
    return _edit_tensors(root / "plain", root / "hf", add=per_expert(deepseek_tensors(mtp, LAYERS))), model, mtp


@pytest.fixture(scope="module")
def imported(hf, tmp_path_factory):
    output = tmp_path_factory.mktemp("imported_deepseek_v3_mtp") / "ckpt"
    return output, import_hf(hf[0], output, *TARGET).stdout


def test_an_imported_mtp_layer_gives_transformers_depth_logits_at_tp2_pp2_ep2_with_every_expert_chosen(hf, imported):
    from megatron_lite.checkpoint.dense import load_dense_model

    _, model, mtp = hf
    assert "its multi-token prediction layer (model.layers.4.*) imported as --mtp-num-layers 1" in imported[1]
    config, ours = load_dense_model(str(imported[0]))
    assert config.model.mtp_num_layers == 1
    chosen = {}
    handle = mtp.layers[0].mtp_block.mlp.gate.register_forward_hook(
        lambda module, args, out: chosen.update(indices=out[2]))
    ids = tokens()
    theirs = depth_logits(model, mtp, ids, 1)
    handle.remove()
    assert set(chosen["indices"].flatten().tolist()) == set(range(8))  # no idle expert hides a wrong order
    assert relative_error(theirs, our_depth_logits(ours, ids, 1, VOCAB)) <= 1e-5


def test_export_of_the_import_gives_back_every_tensor_bit_for_bit_and_transformers_mtp_model_loads_it(
        hf, imported, tmp_path):
    """Also after a reshard to TP 1 x PP 1 (the depth's layer file moves from the second stage's ranks to one)."""
    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpModel

    folder, model, mtp = hf
    assert convert("reshard", "--load", imported[0], "--save", tmp_path / "tp1", "--target-tensor-model-parallel-size",
                   1, "--target-pipeline-model-parallel-size", 1).returncode == 0
    original = load_file(str(folder / "model.safetensors"))
    for source, out in ((imported[0], tmp_path / "out"), (tmp_path / "tp1", tmp_path / "out_tp1")):
        assert convert("export-hf", "--load", source, "--output", out).returncode == 0
        exported = load_file(str(out / "model.safetensors"))
        assert sorted(exported) == sorted(original)
        for key, tensor in original.items():
            assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), (out.name, key)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    loaded = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    loaded._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}\..*"]  # DeepSeek-V3's is layer 61
    ids = tokens(seed=3)
    assert relative_error(depth_logits(model, mtp, ids, 1),
                          depth_logits(loaded, MtpModel.from_pretrained(loaded).eval(), ids, 1)) <= 1e-6


REFUSALS = {
    "head copy differs": (lambda f, d: _edit_tensors(f, d, add={"model.layers.4.shared_head.head.weight": torch.zeros(
        VOCAB, 32)}), "model.layers.4.shared_head.head.weight differs from lm_head.weight: our Multi-Token Prediction "
                    "depths share the model's embedding and output head"),
    "dense model": (lambda f, d: _edit_config(f, d, first_k_dense_replace=4),
                    "first_k_dense_replace = 4 leaves every layer dense, but the folder holds multi-token prediction "
                    "layers (model.layers.4.*), which transformers builds with experts"),
    "depth without its norm": (lambda f, d: _edit_tensors(f, d, drop=["model.layers.4.shared_head.norm.weight"]),
                               "lacks the tensor model.layers.4.shared_head.norm.weight"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_an_mtp_folder_we_cannot_hold_exits_2_naming_the_tensor_or_field_and_writes_nothing(case, hf, tmp_path):
    edit, expected = REFUSALS[case]
    result = import_hf(edit(hf[0], tmp_path / "in"), tmp_path / "out", check=False)
    assert expected in error_line(result)
    assert not (tmp_path / "out").exists()


def test_use_checkpoint_args_takes_the_depths_and_a_run_may_change_their_loss_factor_but_not_their_number(imported):
    from megatron_lite.arguments import parse_args
    from megatron_lite.config import ConfigError

    base = ["--load", str(imported[0]), "--use-checkpoint-args", "--seq-length", "16", "--micro-batch-size", "1",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    m = parse_args(base, world_size=4)[0].model
    assert (m.mtp_num_layers, m.mtp_loss_scaling_factor, m.num_experts) == (1, 0.1, 8)
    assert parse_args(base + ["--mtp-loss-scaling-factor", "0.3"], world_size=4)[0].model.mtp_loss_scaling_factor == 0.3
    with pytest.raises(ConfigError, match=r"--mtp-num-layers: checkpoint 1, this run 2"):
        parse_args(base + ["--mtp-num-layers", "2"], world_size=4)


@pytest.mark.slow
def test_training_from_the_import_at_pp2_logs_the_depth_loss_and_transformers_mtp_model_gives_its_depth_logits(
        hf, corpus, tmp_path):
    """The depth's layer files as training's engine writes them (not the importer) export to what MtpModel loads."""
    from transformers.modeling_layers import MtpModel

    from megatron_lite.checkpoint.dense import load_dense_model
    from tests.checkpoint.conftest import data_args, scalars
    from tests.checkpoint.test_import_hf import TRAIN
    from tests.entry_points import run_entry

    import_hf(hf[0], tmp_path / "ckpt", 1, 2)
    result = run_entry(["pretrain_gpt.py", *TRAIN, *data_args(corpus), "--pipeline-model-parallel-size", "2",
                        "--load", tmp_path / "ckpt", "--use-checkpoint-args", "--save", tmp_path / "trained",
                        "--tensorboard-dir", tmp_path / "tb"], 2, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "mtp | depth 1 loss" in result.stdout
    assert sorted(scalars(tmp_path / "tb", "train/mtp/depth1_loss")) == [1, 2]
    assert convert("export-hf", "--load", tmp_path / "trained", "--output", tmp_path / "out").returncode == 0
    loaded = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    loaded._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}\..*"]
    _, ours = load_dense_model(str(tmp_path / "trained"))
    ids = tokens(seed=4)
    assert relative_error(depth_logits(loaded, MtpModel.from_pretrained(loaded).eval(), ids, 1),
                          our_depth_logits(ours, ids, 1, VOCAB)) <= 1e-5
