"""convert_checkpoint.py import-hf / export-hf for Glm4MoeForCausalLM (tests/checkpoint/hf_models.py's tiny GLM-4.5:
partial RoPE, QK-norm, q/k/v biases, head width apart from hidden / heads, DeepSeek-V3's router) with its
multi-token prediction layer as GLM-4.5's release stores it (model.layers.{L}.*: transformers' MtpModel's random
weights under those names, experts one tensor each, with the copies of the embedding and head): imported at
TP 2 x PP 2 x EP 2 it computes transformers' logits and MtpModel's depth logits, exports back bit for bit into a
folder that transformers and its MtpModel load. save_pretrained's folder (num_nextn_predict_layers 1 without the
layer) imports without depths, with a note. The model-level match: tests/model/test_hf_glm4_moe_reference.py and
test_hf_glm4_moe_mtp.py."""
import json

import pytest
import torch

from tests.checkpoint.conftest import error_line
from tests.checkpoint.hf_models import VOCAB, save_glm4_moe
from tests.checkpoint.test_import_hf import _edit_config
from tests.checkpoint.test_import_hf_deepseek_v3_mtp import per_expert
from tests.checkpoint.test_import_hf_moe import _edit_tensors, convert, import_hf, our_logits, relative_error, tokens
from tests.model.test_hf_deepseek_v3_mtp import deepseek_tensors, depth_logits, our_depth_logits
from tests.model.test_hf_glm4_moe_mtp import perturbed_mtp

transformers = pytest.importorskip("transformers")

TARGET = (2, 2, 2)  # TP, PP, EP: heads and key/value groups, stages (the depth on the last), experts
LAYERS = 4  # save_glm4_moe's; its MTP layer is model.layers.4


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(save_pretrained's folder, the folder with the MTP layer, transformers' model, its MtpModel)."""
    from transformers.modeling_layers import MtpModel

    root = tmp_path_factory.mktemp("hf_glm4_moe")
    model = save_glm4_moe(root / "plain")
    mtp = perturbed_mtp(MtpModel(model, 1).eval())
    return root / "plain", _edit_tensors(root / "plain", root / "mtp", add=per_expert(deepseek_tensors(mtp, LAYERS))), \
        model, mtp


@pytest.fixture(scope="module")
def imported(hf, tmp_path_factory):
    """(the MTP folder imported at TARGET, convert_checkpoint's stdout)."""
    output = tmp_path_factory.mktemp("imported_glm4_moe") / "ckpt"
    return output, import_hf(hf[1], output, *TARGET).stdout


def _chosen_experts(gate, run):
    chosen = {}
    handle = gate.register_forward_hook(lambda module, args, out: chosen.update(indices=out[2]))
    out = run()
    handle.remove()
    return out, set(chosen["indices"].flatten().tolist())


def test_an_imported_glm4_moe_gives_transformers_logits_and_depth_logits_at_tp2_pp2_ep2_every_expert_chosen(
        hf, imported):
    from megatron_lite.checkpoint.dense import load_dense_model

    _, _, model, mtp = hf
    assert "its multi-token prediction layer (model.layers.4.*) imported as --mtp-num-layers 1" in imported[1]
    config, ours = load_dense_model(str(imported[0]))
    m = config.model
    assert (m.mtp_num_layers, m.rotary_percent, m.kv_channels, m.qk_layernorm, m.add_qkv_bias) == (1, 0.5, 16, True,
                                                                                                   True)
    ids = tokens()
    with torch.no_grad():  # a wrong expert order cannot hide behind idle experts, in the model or in its depth
        theirs, used = _chosen_experts(model.model.layers[1].mlp.gate, lambda: model(ids).logits)
        assert used == set(range(8))
        depths, used = _chosen_experts(mtp.layers[0].mtp_block.mlp.gate, lambda: depth_logits(model, mtp, ids, 1))
        assert used == set(range(8))
    assert relative_error(theirs, our_logits(imported[0], ids)) <= 1e-5
    assert relative_error(depths, our_depth_logits(ours, ids, 1, VOCAB)) <= 1e-5


def test_export_of_the_import_gives_back_every_tensor_bit_for_bit_and_transformers_and_its_mtp_model_load_it(
        hf, imported, tmp_path):
    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpModel

    _, folder, model, mtp = hf
    assert convert("export-hf", "--load", imported[0], "--output", tmp_path / "out").returncode == 0
    original, exported = load_file(str(folder / "model.safetensors")), load_file(str(tmp_path / "out" /
                                                                                      "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["architectures"], config["partial_rotary_factor"], config["use_qk_norm"],
            config["attention_bias"], config["head_dim"], config["num_nextn_predict_layers"]) == (
        ["Glm4MoeForCausalLM"], 0.5, True, True, 16, 1)
    loaded = transformers.Glm4MoeForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    loaded._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}\..*"]  # GLM-4.5's are layers 92 and 46
    ids = tokens(seed=3)
    assert relative_error(depth_logits(model, mtp, ids, 1),
                          depth_logits(loaded, MtpModel.from_pretrained(loaded).eval(), ids, 1)) <= 1e-6
    # In bf16 the selection bias stays fp32, as transformers keeps it (_keep_in_fp32_modules_strict).
    assert convert("export-hf", "--load", imported[0], "--output", tmp_path / "bf16", "--dtype",
                   "bfloat16").returncode == 0
    dtypes = {k: t.dtype for k, t in load_file(str(tmp_path / "bf16" / "model.safetensors")).items()}
    assert {k for k, d in dtypes.items() if d == torch.float32} == {k for k in dtypes if "e_score_correction" in k}


def test_save_pretrained_folder_imports_without_depths_with_a_note_and_gives_transformers_logits(hf, tmp_path):
    plain, _, model, _ = hf
    result = import_hf(plain, tmp_path / "ckpt")
    assert "num_nextn_predict_layers 1: no weights of its multi-token prediction layers (model.layers.4.*) in the " \
           "folder (transformers' save_pretrained writes none): imported without --mtp-num-layers, the model " \
           "predicts the next token as transformers' Glm4MoeForCausalLM does" in result.stdout
    ids = tokens(seed=1)
    with torch.no_grad():
        assert relative_error(model(ids).logits, our_logits(tmp_path / "ckpt", ids)) <= 1e-5


REFUSALS = {
    "dense model": (lambda f, d: _edit_config(f, d, first_k_dense_replace=4),
                    "first_k_dense_replace = 4 is not supported: it leaves all 4 layers dense"),
    "odd rotary width": (lambda f, d: _edit_config(f, d, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                          "partial_rotary_factor": 0.1}),
                         "config.json: partial_rotary_factor = 0.1 is not supported: it turns int(0.1 x head_dim 16) "
                         "= 1 dimensions"),
    "head copy differs": (lambda f, d: _edit_tensors(f, d, add={"model.layers.4.shared_head.head.weight": torch.zeros(
        VOCAB, 32)}), "model.layers.4.shared_head.head.weight differs from lm_head.weight: our Multi-Token Prediction "
                    "depths share the model's embedding and output head (Glm4MoeForCausalLM's copies"),
    "depth without its q/k norm": (lambda f, d: _edit_tensors(f, d, drop=["model.layers.4.self_attn.k_norm.weight"]),
                                   "lacks the tensor model.layers.4.self_attn.k_norm.weight"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_glm4_moe_folder_we_cannot_hold_exits_2_naming_the_field_or_tensor_and_writes_nothing(case, hf, tmp_path):
    edit, expected = REFUSALS[case]
    result = import_hf(edit(hf[1], tmp_path / "in"), tmp_path / "out", check=False)
    assert expected in error_line(result)
    assert not (tmp_path / "out").exists()
