"""DeepSeek-V3's multi-token prediction layers (model.layers.{L + k - 1}.*) are our --mtp-num-layers depths
(checkpoint/hf_deepseek_v3_mtp.py): to_hf then from_hf gives back every weight, the depths' included, at D = 1 and 2;
transformers' own MtpModel computes our depths' logits, loading an exported folder by its own names
(MtpModel.from_pretrained) or handing us its weights through from_hf; the depths' copies of the embedding and head
must be the model's; the config carries D, and what neither side can hold is refused."""
import json

import pytest
import torch

from megatron_lite.checkpoint import hf_deepseek_v3
from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_deepseek_v3 import file_fields, from_hf, hf_config, to_hf
from megatron_lite.data.mtp import mtp_arrays
from tests.model.gpt_layouts import tiny_config
from tests.model.test_hf_deepseek_v3_reference import MLA, Q_LORA, ROUTER, YARN, deepseek_config, hf_model, perturbed
from tests.model.test_hf_llama_reference import VOCAB, our_model, random_tokens, relative_error

transformers = pytest.importorskip("transformers")

LAYERS = 5  # deepseek_config's: 3 dense layers, then 2 with experts (the depths' kind)
MTP_PARTS = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
             "shared_head.head.weight"}


def mtp_config(depths, untie=True):
    """test_hf_deepseek_v3_reference's DeepSeek-V3 (MLA, YaRN, its router) with `depths` depths."""
    mla = MLA if untie else [f for f in MLA if f != "--untie-embeddings-and-output-weights"]
    return tiny_config(extra=mla + YARN + Q_LORA + ROUTER + ["--mtp-num-layers", str(depths)])


def deepseek_tensors(mtp, layers):
    """transformers' MtpModel's weights under the names DeepSeek-V3's release stores them, renamed by hand (the
    reverse of transformers' conversion mapping for MtpModel): model.layers.{L + j}.* for its layer j, post_norm as
    shared_head.norm, and the copies of the embedding and head. Experts in transformers' fused spelling."""
    out = {}
    for name, tensor in mtp.state_dict().items():
        if not name.startswith("layers."):  # the main model's embedding and head, which it shares
            continue
        _, j, rest = name.split(".", 2)
        rest = rest.removeprefix("mtp_block.")
        rest = "shared_head.norm." + rest[len("post_norm."):] if rest.startswith("post_norm.") else rest
        out[f"model.layers.{layers + int(j)}.{rest}"] = tensor.detach().clone()
    for j in range(len(mtp.layers)):
        out[f"model.layers.{layers + j}.embed_tokens.weight"] = mtp.embed_tokens.weight.detach().clone()
        out[f"model.layers.{layers + j}.shared_head.head.weight"] = mtp.shared_head.weight.detach().clone()
    return out


def perturbed_mtp(mtp, seed=7):
    """Its own layers' weights (not the embedding and head it shares) away from their initial values: norms around
    1, matrices and the selection bias random, routers wide enough that every expert is chosen."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*mtp.named_parameters(), *mtp.named_buffers()]:
            if not name.startswith("layers."):
                continue
            if name.endswith("norm.weight"):
                t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.1 * torch.rand(t.shape, generator=g))
            elif t.dim() > 1:
                t.copy_((0.6 if name.endswith("gate.weight") else 0.15) * torch.randn(t.shape, generator=g))
    return mtp


def depth_logits(hf, mtp, tokens, depths):
    """transformers' logits of the main model and of each depth, stacked along the batch as ours are; depth k reads
    the token k ahead (the positions past the end: 0, as data/mtp.py fills them)."""
    b, s = tokens.shape
    ahead = mtp_arrays(tokens, tokens, torch.ones(b, s), None, depths)[0]
    positions = torch.arange(s).expand(b, s)
    with torch.no_grad():
        hidden = hf.model(tokens).last_hidden_state  # after the final norm, as our depths read it
        logits = [hf.lm_head(hidden)]
        for k in range(depths):
            hidden = mtp.forward_layer(k, hidden, positions, None, input_ids=ahead[:, k])
            logits.append(mtp._project_to_logits(hidden))
    return torch.cat(logits)


def our_depth_logits(model, tokens, depths, vocab=VOCAB):
    """Our logits of the main model and each depth (stacked along the batch), on the unpadded vocabulary."""
    b, s = tokens.shape
    arrays = mtp_arrays(tokens, tokens, torch.ones(b, s), None, depths)
    with torch.no_grad():
        return model(tokens, torch.arange(s).expand(b, s), mtp=arrays)[..., :vocab]


@pytest.mark.parametrize("depths, untie", [(1, True), (2, True), (1, False)], ids=["D1", "D2", "D1-tied-head"])
def test_to_hf_then_from_hf_gives_back_every_weight_the_depths_included(depths, untie):
    config = mtp_config(depths, untie)
    torch.manual_seed(2)
    dense = perturbed(our_model(config)).state_dict()
    hf = to_hf(dense, config.model)
    last = {n[len(f"model.layers.{LAYERS - 1}."):] for n in hf if n.startswith(f"model.layers.{LAYERS - 1}.")}
    for k in range(depths):  # depth k + 1: the whole decoder layer under the usual names, with the MTP parts
        layer = f"model.layers.{LAYERS + k}."
        assert {n[len(layer):] for n in hf if n.startswith(layer)} == last | MTP_PARTS
        assert torch.equal(hf[layer + "embed_tokens.weight"], hf["model.embed_tokens.weight"])
        assert torch.equal(hf[layer + "shared_head.head.weight"], hf["lm_head.weight" if untie else
                                                                        "model.embed_tokens.weight"])
    assert not any(n.startswith(f"model.layers.{LAYERS + depths}.") for n in hf)
    back = from_hf(hf, config.model)
    assert back.keys() == dense.keys()
    for name, tensor in dense.items():
        rows = VOCAB if name.endswith(("word_embeddings.weight", "output.weight")) else None  # padding: zeros back
        assert torch.equal(back[name][:rows], tensor[:rows]), name
    assert hf_config(config.model)["num_nextn_predict_layers"] == depths


@pytest.mark.parametrize("depths", [1, 2])
def test_transformers_loads_an_exported_folder_and_its_mtp_model_gives_our_depths_logits(depths, tmp_path):
    """from_pretrained loads the main model and reports the MTP layers as unexpected (its ignore pattern is
    DeepSeek-V3's model.layers.61.*, so only at L = 61 are they silent); MtpModel.from_pretrained, told where they
    are, loads them by their names and gives our logits."""
    config = mtp_config(depths)
    torch.manual_seed(2)
    assert exported_depths_error(perturbed(our_model(config)), config, hf_deepseek_v3,
                                 transformers.DeepseekV3ForCausalLM, tmp_path, LAYERS) <= 1e-5


def test_our_depths_with_transformers_mtp_weights_through_from_hf_give_its_logits():
    config = mtp_config(1)
    torch.manual_seed(3)
    assert from_hf_depths_error(config, hf_deepseek_v3, perturbed(hf_model(hf_config(config.model))), perturbed_mtp,
                                LAYERS) <= 1e-5


def exported_depths_error(ours, config, module, model_class, folder, layers):
    """Our model exported by `module` (to_hf, hf_config) into `folder`: transformers' `model_class` loads it and
    reports the MTP layers as unexpected (its ignore patterns name the released models' layers, not ours); MtpModel,
    told where they are, loads them by their names. Its logits' relative error against ours (main model and depths,
    on the unpadded vocabulary)."""
    from safetensors.torch import save_file
    from transformers.modeling_layers import MtpModel

    depths = config.model.mtp_num_layers
    tensors = module.to_hf(ours.state_dict(), config.model)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(module.hf_config(config.model)))
    hf, info = model_class.from_pretrained(str(folder), output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert {".".join(n.split(".")[:3]) for n in info["unexpected_keys"]} == {f"model.layers.{layers + k}"
                                                                           for k in range(depths)}
    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{layers + k}\..*" for k in range(depths)]
    mtp = MtpModel.from_pretrained(hf.eval()).eval()
    tokens = random_tokens()
    return relative_error(depth_logits(hf, mtp, tokens, depths), our_depth_logits(ours, tokens, depths))


def from_hf_depths_error(config, module, hf, perturb_mtp, layers):
    """transformers' model `hf` with an MtpModel of one layer (perturbed by `perturb_mtp`), both under the release's
    names, through `module`.from_hf into our model: the relative error of our logits (main model and depth) against
    theirs."""
    from transformers.modeling_layers import MtpModel

    mtp = perturb_mtp(MtpModel(hf, 1).eval())
    ours = our_model(config)
    ours.load_state_dict(module.from_hf({**hf.state_dict(), **deepseek_tensors(mtp, layers)}, config.model),
                         strict=True)
    tokens = random_tokens(1)
    return relative_error(depth_logits(hf, mtp, tokens, 1), our_depth_logits(ours, tokens, 1))


def test_a_depths_copy_of_the_embedding_or_head_that_differs_is_refused_naming_it():
    config = mtp_config(1)
    hf = to_hf(our_model(config).state_dict(), config.model)
    for copy in ("embed_tokens.weight", "shared_head.head.weight"):
        name = f"model.layers.{LAYERS}.{copy}"
        with pytest.raises(CheckpointError, match=rf"{name} differs from (model.embed_tokens|lm_head).weight: our "
                                                  "Multi-Token Prediction depths share"):
            from_hf({**hf, name: hf[name] + 1}, config.model)
    # Without the copies (nothing to contradict) the depths import all the same.
    bare = {k: v for k, v in hf.items() if not (k.startswith(f"model.layers.{LAYERS}.") and k.endswith(
        ("embed_tokens.weight", "shared_head.head.weight")))}
    assert from_hf(bare, config.model).keys() == our_model(config).state_dict().keys()


def test_the_folders_weights_decide_whether_the_depths_import_and_a_dense_model_has_none():
    c = dict(hf_config(mtp_config(1).model))
    names = ["model.embed_tokens.weight", "model.layers.4.input_layernorm.weight"]
    assert file_fields(c, names, "config.json")[0] == {}  # save_pretrained's folder: num_nextn_predict_layers 1
    assert "no weights of its multi-token prediction layers (model.layers.5.*)" in file_fields(c, names, "c")[1][0]
    names.append("model.layers.5.enorm.weight")
    assert file_fields(c, names, "config.json") == ({"mtp_num_layers": 1}, [
        "num_nextn_predict_layers 1: its multi-token prediction layer (model.layers.5.*) imported as "
        "--mtp-num-layers 1"])
    assert file_fields(dict(c, num_nextn_predict_layers=0), names, "config.json") == ({}, [])
    with pytest.raises(CheckpointError, match="first_k_dense_replace = 5 leaves every layer dense, but the folder "
                                              r"holds multi-token prediction layers \(model.layers.5.\*\)"):
        file_fields(dict(c, first_k_dense_replace=5), names, "config.json")
    with pytest.raises(CheckpointError, match=r"has experts in its multi-token prediction layers; this model was "
                                              r"built with --mtp-num-layers 1 and no --num-experts"):
        hf_config(deepseek_config(experts=False, extra=["--mtp-num-layers", "1"]).model)
