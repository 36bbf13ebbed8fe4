"""A gpt-oss folder whose expert stacks are MXFP4 (the released format: `<name>_blocks` [E, out, in/32, 16] uint8, two
E2M1 codes a byte, beside `<name>_scales` [E, out, in/32] uint8 E8M0 exponents) imports to exactly the weights
transformers' own loader dequantizes (from_pretrained with Mxfp4Config(dequantize=True), its
convert_moe_packed_tensors), at TP 2 x PP 2 x EP 2, with transformers' logits; every code and scale decodes as
transformers' does; the stacks are read one expert at a time; what is not a pair of blocks and scales exits 2 naming
the tensor."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_lite.checkpoint import hf_folder
from megatron_lite.checkpoint.hf_mxfp4 import dequantize
from tests.checkpoint.conftest import error_line
from tests.checkpoint.test_import_hf_gpt_oss import save_gpt_oss
from tests.checkpoint.test_import_hf_moe import import_hf, our_logits, relative_error, tokens

transformers = pytest.importorskip("transformers")

MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
"""E2M1's non-negative values, codes 0..7 (8..15: the same, negative)."""
QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def quantize(weight):
    """[E, in, out] (transformers' bf16 layout) -> (blocks [E, out, in/32, 16], scales [E, out, in/32]), both uint8:
    per 32 weights along `in`, the power of two that brings their largest magnitude to at most 6, each weight
    rounded to the nearest E2M1 value, two codes a byte, the even weight in the low nibble."""
    w = weight.transpose(1, 2).float()
    experts, out, inner = w.shape
    groups = w.reshape(experts, out, inner // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -100) / 6.0))
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.abs().unsqueeze(-1) - MAGNITUDES).abs().argmin(-1) | ((scaled < 0).long() << 3)
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the MXFP4 folder, the transformers model from_pretrained dequantizes it into, in fp32)."""
    root = tmp_path_factory.mktemp("mxfp4")
    # Widths of 64: two blocks of 32 along each stack's input (gpt-oss's 2880: 90).
    save_gpt_oss(root / "source", hidden_size=64, intermediate_size=64)
    tensors = {}
    for name, tensor in load_file(str(root / "source" / "model.safetensors")).items():
        if name.endswith(STACKS):
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize(tensor)
        else:
            tensors[name] = tensor
    os.makedirs(root / "mxfp4")
    save_file(tensors, str(root / "mxfp4" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((root / "source" / "config.json").read_text())
    (root / "mxfp4" / "config.json").write_text(json.dumps(dict(config, quantization_config=QUANTIZATION)))
    model = transformers.GptOssForCausalLM.from_pretrained(
        str(root / "mxfp4"), quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager").eval()
    return root / "mxfp4", model


def test_every_code_and_scale_decodes_as_transformers_convert_moe_packed_tensors_low_nibble_first():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    # Row r of 256 holds every byte value (16 blocks of 16) under scale r: every code at every exponent.
    blocks = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(1, 256, 16, 16).contiguous()
    scales = torch.arange(256, dtype=torch.uint8).view(1, 256, 1).expand(1, 256, 16).contiguous()
    ours = dequantize(blocks, scales)
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert ours.shape == theirs.shape == (1, 512, 256)
        assert torch.equal(ours.to(dtype).view(torch.uint8), theirs.view(torch.uint8)), dtype  # bits, NaN included
    # By hand: byte 0x2F (low nibble 15: -6, high nibble 2: 1.0) at scale 128 (x2) is input columns 0 and 1 of the
    # row: [E, in, out] holds them at [0, 0, row] and [0, 1, row].
    one = dequantize(torch.tensor([0x2F] + [0] * 15, dtype=torch.uint8).view(1, 1, 1, 16),
                     torch.tensor([[[128]]], dtype=torch.uint8))
    assert one.shape == (1, 32, 1) and one[0, :2, 0].tolist() == [-12.0, 2.0] and not one[0, 2:].any()


def test_an_mxfp4_folder_imports_to_transformers_dequantized_weights_exactly_at_tp2_pp2_ep2(folders, tmp_path):
    from megatron_lite.checkpoint.dense import load_dense_model
    from megatron_lite.checkpoint.hf_gpt_oss import from_hf

    folder, model = folders
    import_hf(folder, tmp_path / "ckpt", 2, 2, 2)
    config, ours = load_dense_model(str(tmp_path / "ckpt"))
    dense, expected = ours.state_dict(), from_hf(model.state_dict(), config.model)
    assert set(dense) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(dense[name], tensor), name
    # MXFP4 rounded the stacks far from the source's values: the comparison is not vacuous.
    source = transformers.GptOssForCausalLM.from_pretrained(str(folder.parent / "source")).state_dict()
    stack = "model.layers.1.mlp.experts.gate_up_proj"
    assert (source[stack] - model.state_dict()[stack]).abs().max() > 1e-2
    ids = tokens()
    with torch.no_grad():
        theirs = model(ids).logits
    assert relative_error(theirs, our_logits(tmp_path / "ckpt", ids)) <= 1e-5


def test_the_importer_reads_an_mxfp4_stack_one_expert_at_a_time(folders, tmp_path, monkeypatch):
    """Its blocks and scales are never read whole: each read is one expert's rows (for each TP rank that takes a
    piece of it), as the importer's memory bound (hf_import.py) needs."""
    folder, _ = folders
    reads = []
    whole, rows = hf_folder.WeightFiles.read, hf_folder.WeightFiles.read_rows
    monkeypatch.setattr(hf_folder.WeightFiles, "read", lambda self, name: reads.append((name, None)) or
                        whole(self, name))
    monkeypatch.setattr(hf_folder.WeightFiles, "read_rows", lambda self, name, start, stop: reads.append(
        (name, stop - start)) or rows(self, name, start, stop))
    import_hf(folder, tmp_path / "ckpt", 2, 1, 1)
    quantized = [(name, count) for name, count in reads if name.endswith(("_blocks", "_scales"))]
    # 4 layers x 2 stacks x (blocks, scales) x 4 experts x 2 TP ranks
    assert len(quantized) == 4 * 2 * 2 * 4 * 2 and {count for _, count in quantized} == {1}


def _edited(folder, dst, drop=(), add=None):
    os.makedirs(dst)
    tensors = load_file(str(folder / "model.safetensors"))
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((folder / "config.json").read_text())
    return dst


REFUSED = {
    "no scales": (dict(drop=["model.layers.0.mlp.experts.down_proj_scales"]),
                  "lacks the tensor model.layers.0.mlp.experts.down_proj"),
    "scale shape": (dict(add={"model.layers.0.mlp.experts.down_proj_scales": torch.zeros(4, 64, 1, dtype=torch.uint8)}),
                    "model.layers.0.mlp.experts.down_proj_blocks [4, 64, 2, 16] and "
                    "model.layers.0.mlp.experts.down_proj_scales [4, 64, 1] are not an MXFP4 expert stack"),
    "blocks dtype": (dict(add={"model.layers.0.mlp.experts.down_proj_blocks": torch.zeros(4, 64, 2, 16)}),
                     "model.layers.0.mlp.experts.down_proj_blocks is torch.float32, MXFP4 stores uint8"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_mxfp4_we_cannot_read_exits_2_naming_the_tensor_and_writes_nothing(folders, tmp_path, case):
    edit, says = REFUSED[case]
    bad = _edited(folders[0], tmp_path / "bad", **edit)
    result = import_hf(bad, tmp_path / "out", 1, 1, 1, check=False)
    assert says in error_line(result), result.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out")
