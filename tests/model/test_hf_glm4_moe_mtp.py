"""GLM-4.5's multi-token prediction layers (model.layers.{L + k - 1}.*, stored as DeepSeek-V3's:
checkpoint/hf_deepseek_v3_mtp.py) are our --mtp-num-layers depths: to_hf then from_hf gives back every weight, the
depths' included; transformers' own MtpModel, built on Glm4MoeForCausalLM, computes our depths' logits, loading an
exported folder by its own names or handing us its weights through from_hf. The main model's match:
test_hf_glm4_moe_reference.py, whose tiny model (partial RoPE, QK-norm, q/k/v biases, DeepSeek-V3's experts) this
uses."""
import pytest
import torch

from megatron_lite.checkpoint import hf_glm4_moe
from megatron_lite.checkpoint.hf_glm4_moe import file_fields, from_hf, hf_config, to_hf
from tests.model.gpt_layouts import tiny_config
from tests.model.test_hf_deepseek_v3_mtp import MTP_PARTS, exported_depths_error, from_hf_depths_error
from tests.model.test_hf_deepseek_v3_mtp import perturbed_mtp as deepseek_perturbed_mtp
from tests.model.test_hf_glm4_moe_reference import GQA, LAYERS, QK_NORM_AND_BIASES, ROUTER, hf_model, perturbed
from tests.model.test_hf_llama_reference import VOCAB, our_model

transformers = pytest.importorskip("transformers")


def mtp_config(depths, untie=True):
    gqa = GQA if untie else [f for f in GQA if f != "--untie-embeddings-and-output-weights"]
    return tiny_config(extra=gqa + ROUTER + QK_NORM_AND_BIASES + ["--mtp-num-layers", str(depths)])


def perturbed_mtp(mtp, seed=7):
    """DeepSeek-V3's test's perturbation of the MTP layers, and their q/k/v biases away from zero."""
    deepseek_perturbed_mtp(mtp, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in mtp.named_parameters():
            if name.startswith("layers.") and name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                t.copy_(0.3 * torch.randn(t.shape, generator=g))
    return mtp


@pytest.mark.parametrize("depths, untie", [(1, True), (2, True), (1, False)], ids=["D1", "D2", "D1-tied-head"])
def test_to_hf_then_from_hf_gives_back_every_weight_the_depths_included(depths, untie):
    config = mtp_config(depths, untie)
    torch.manual_seed(2)
    dense = perturbed(our_model(config)).state_dict()
    hf = to_hf(dense, config.model)
    last = {n[len(f"model.layers.{LAYERS - 1}."):] for n in hf if n.startswith(f"model.layers.{LAYERS - 1}.")}
    assert {"self_attn.q_norm.weight", "self_attn.q_proj.bias", "mlp.gate.e_score_correction_bias"} <= last
    for k in range(depths):  # depth k + 1: the whole decoder layer under the usual names, with the MTP parts
        layer = f"model.layers.{LAYERS + k}."
        assert {n[len(layer):] for n in hf if n.startswith(layer)} == last | MTP_PARTS
    back = from_hf(hf, config.model)
    assert back.keys() == dense.keys()
    for name, tensor in dense.items():
        rows = VOCAB if name.endswith(("word_embeddings.weight", "output.weight")) else None  # padding: zeros back
        assert torch.equal(back[name][:rows], tensor[:rows]), name
    assert hf_config(config.model)["num_nextn_predict_layers"] == depths


@pytest.mark.parametrize("depths", [1, 2])
def test_transformers_loads_an_exported_folder_and_its_mtp_model_gives_our_depths_logits(depths, tmp_path):
    """from_pretrained loads the main model and reports the MTP layers as unexpected (Glm4Moe's ignore patterns are
    GLM-4.5's model.layers.92.* and GLM-4.5-Air's model.layers.46.*); MtpModel.from_pretrained, told where they are,
    loads them by their names and gives our logits."""
    config = mtp_config(depths)
    torch.manual_seed(2)
    assert exported_depths_error(perturbed(our_model(config)), config, hf_glm4_moe, transformers.Glm4MoeForCausalLM,
                                 tmp_path, LAYERS) <= 1e-5


def test_our_depths_with_transformers_mtp_weights_through_from_hf_give_its_logits():
    config = mtp_config(1)
    torch.manual_seed(3)
    assert from_hf_depths_error(config, hf_glm4_moe, perturbed(hf_model(hf_config(config.model))), perturbed_mtp,
                                LAYERS) <= 1e-5


def test_the_folders_weights_decide_whether_the_depths_import_with_glm_4_5s_defaults():
    """Glm4MoeConfig's num_nextn_predict_layers is 1 when config.json says nothing (num_mtp_layers is its other
    name); the note names the architecture."""
    c = {k: v for k, v in hf_config(mtp_config(1).model).items() if k != "num_nextn_predict_layers"}
    names = ["model.embed_tokens.weight", f"model.layers.{LAYERS}.enorm.weight"]
    assert file_fields(c, names, "config.json")[0] == {"mtp_num_layers": 1}
    assert file_fields(dict(c, num_mtp_layers=0), names, "config.json") == ({}, [])
    assert "the model predicts the next token as transformers' Glm4MoeForCausalLM does" in \
        file_fields(c, names[:1], "config.json")[1][0]
