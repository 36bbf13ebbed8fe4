"""convert_checkpoint.py import-hf / export-hf for DeepseekV3ForCausalLM (tests/checkpoint/hf_models.py's tiny one:
MLA with interleaved rotary rows, YaRN, DeepSeek-V3's router): an import at TP 2 x PP 2 x EP 2 computes transformers'
logits and loss, exports back bit for bit into a folder transformers loads; save_pretrained's num_nextn_predict_layers
1 without weights imports no depths, with a note, and a folder with the multi-token prediction layer imports it as a
depth (transformers' MtpModel against it: test_import_hf_deepseek_v3_mtp.py). The model-level match (both
directions, the permutation, the refusals): tests/model/test_hf_deepseek_v3_reference.py; the shared MoE tool tests:
test_import_hf_moe.py, whose helpers these use."""
import json
import shutil

import pytest
import torch

from tests.checkpoint.conftest import error_line
from tests.checkpoint.hf_models import save_deepseek_v3
from tests.checkpoint.test_import_hf import _edit_config
from tests.checkpoint.test_import_hf_moe import (
    _edit_tensors,
    convert,
    evaluate,
    evaluation_samples,
    import_hf,
    our_logits,
    relative_error,
    tokens,
)

TARGET = (2, 2, 2)  # TP, PP, EP: every split the mapping meets (heads, rows of the rotary tensors, stages, experts)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(save_pretrained folder, the transformers model)."""
    folder = tmp_path_factory.mktemp("hf_deepseek_v3") / "hf"
    return folder, save_deepseek_v3(folder)


@pytest.fixture(scope="module")
def imported(hf, tmp_path_factory):
    """(checkpoint imported at TARGET, convert_checkpoint's stdout)."""
    output = tmp_path_factory.mktemp("imported_deepseek_v3") / "ckpt"
    return output, import_hf(hf[0], output, *TARGET).stdout


def layer_files(checkpoint):
    folder = checkpoint / "iter_0000000"
    return {p.name: torch.load(p, weights_only=True) for p in sorted(folder.iterdir()) if p.name.startswith("layer_")}


def test_an_imported_deepseek_v3_gives_transformers_logits_at_tp2_pp2_ep2_with_every_expert_chosen(hf, imported):
    _, model = hf
    ids = tokens()
    chosen = {}
    gate = model.model.layers[1].mlp.gate  # the first MoE layer: a wrong expert order cannot hide behind idle ones
    handle = gate.register_forward_hook(lambda module, args, out: chosen.update(indices=out[2]))
    with torch.no_grad():
        theirs = model(ids).logits
    handle.remove()
    assert set(chosen["indices"].flatten().tolist()) == set(range(8))
    assert relative_error(theirs, our_logits(imported[0], ids)) <= 1e-5
    # save_pretrained wrote num_nextn_predict_layers 1 without its weights: said, not failed
    assert "num_nextn_predict_layers 1: no weights of its multi-token prediction layers (model.layers.4.*) in the " \
           "folder (transformers' save_pretrained writes none): imported without --mtp-num-layers" in imported[1]


def test_export_of_the_import_gives_back_every_tensor_bit_for_bit_and_transformers_loads_it(hf, imported, tmp_path):
    import transformers
    from safetensors.torch import load_file

    folder, model = hf
    assert convert("export-hf", "--load", imported[0], "--output", tmp_path / "out").returncode == 0
    original, exported = load_file(str(folder / "model.safetensors")), load_file(str(tmp_path / "out" /
                                                                                      "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["architectures"], config["rope_interleave"], config["num_nextn_predict_layers"]) == (
        ["DeepseekV3ForCausalLM"], True, 0)
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = tokens(seed=3)
    with torch.no_grad():
        assert relative_error(model(ids).logits, theirs(ids).logits) <= 1e-6
    # In bf16 the selection bias stays fp32, as DeepSeek-V3's checkpoints keep it.
    assert convert("export-hf", "--load", imported[0], "--output", tmp_path / "bf16", "--dtype",
                   "bfloat16").returncode == 0
    dtypes = {k: t.dtype for k, t in load_file(str(tmp_path / "bf16" / "model.safetensors")).items()}
    assert {k for k, d in dtypes.items() if d == torch.float32} == {k for k in dtypes if "e_score_correction" in k}


def _with_mtp_layer(src, dst, layers=4, layer=4):
    """The folder plus what a released DeepSeek-V3 stores as its MTP module: a whole decoder layer at index L
    and its own norms, projection and copies of the embedding and head (MODELS-NOTES 2.3)."""
    from safetensors.torch import load_file

    tensors = load_file(str(src / "model.safetensors"))
    mtp = {k.replace(".layers.1.", f".layers.{layer}."): v.clone() for k, v in tensors.items() if ".layers.1." in k}
    mtp.update({f"model.layers.{layer}.{n}": torch.ones(32) for n in ("enorm.weight", "hnorm.weight",
                                                                      "shared_head.norm.weight")})
    mtp.update({f"model.layers.{layer}.eh_proj.weight": torch.zeros(32, 64),
                f"model.layers.{layer}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                f"model.layers.{layer}.shared_head.head.weight": tensors["lm_head.weight"].clone()})
    return _edit_tensors(src, dst, add=mtp)


def test_a_folder_with_its_mtp_layer_imports_it_as_a_depth_and_the_rest_as_without_it(hf, tmp_path):
    """The depth (layer 1's weights, our layer file 02) is file L + 3 = 07, after the final norm's (05) and the
    embedding's second use (06, no file: the depths read the shared embedding), under depths.0.layer.; the head
    moves from file 06 to 08; every other file is the plain import's."""
    folder, _ = hf
    import_hf(folder, tmp_path / "plain")
    result = import_hf(_with_mtp_layer(folder, tmp_path / "mtp"), tmp_path / "ckpt")
    assert "its multi-token prediction layer (model.layers.4.*) imported as --mtp-num-layers 1" in result.stdout
    ours, plain = layer_files(tmp_path / "ckpt"), layer_files(tmp_path / "plain")
    file = "layer_{:02d}-model_00-model_states.pt".format
    assert sorted(ours) == sorted(file(spec) for spec in (0, 1, 2, 3, 4, 5, 7, 8))
    for spec, plain_spec in [(s, s) for s in range(6)] + [(8, 6)]:
        assert sorted(ours[file(spec)]) == sorted(plain[file(plain_spec)]), spec
        assert all(torch.equal(ours[file(spec)][k], t) for k, t in plain[file(plain_spec)].items()), spec
    depth = ours[file(7)]
    assert all(torch.equal(depth["depths.0.layer." + k], t) for k, t in plain[file(2)].items())
    assert torch.equal(depth["depths.0.eh_proj.weight"], torch.zeros(32, 64))
    # A layer past the MTP ones is no MTP layer: refused as any unexpected tensor is.
    beyond = _with_mtp_layer(folder, tmp_path / "beyond", layer=5)
    line = error_line(import_hf(beyond, tmp_path / "refused", check=False))
    assert "has the tensor model.layers.5." in line and not (tmp_path / "refused").exists()


def test_transformers_fused_spelling_of_the_experts_imports_as_save_pretrained_files_do(hf, imported, tmp_path):
    from safetensors.torch import save_file

    folder, model = hf
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(folder / "config.json", fused / "config.json")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(fused / "model.safetensors"),
              metadata={"format": "pt"})
    import_hf(fused, tmp_path / "ckpt", *TARGET)
    ours, reference = layer_files(tmp_path / "ckpt"), layer_files(imported[0])
    assert sorted(ours) == sorted(reference)
    for file, tensors in reference.items():
        assert sorted(ours[file]) == sorted(tensors) and all(torch.equal(ours[file][k], t)
                                                             for k, t in tensors.items()), file


def test_a_deepseek_v3_folder_we_cannot_represent_exits_2_naming_the_field_and_writes_nothing(hf, tmp_path):
    folder = _edit_config(hf[0], tmp_path / "in", rms_norm_eps=1e-5)
    line = error_line(import_hf(folder, tmp_path / "out", check=False))
    assert "rms_norm_eps = 1e-05 is not supported" in line and "--norm-epsilon 1e-6" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_evaluate_on_the_import_at_tp2_pp2_ep2_gives_transformers_loss(hf, imported, corpus):
    from tests.checkpoint.hf_models import hf_loss

    expected = hf_loss(hf[1], evaluation_samples(imported[0], corpus))
    tp, pp, ep = TARGET  # EP over the data-parallel ranks: world TP x PP x EP
    assert evaluate(imported[0], corpus, tp * pp * ep, ep) == pytest.approx(expected, rel=1e-5)
