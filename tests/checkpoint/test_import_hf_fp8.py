"""A DeepSeek-V3 folder whose linear weights are block-scaled fp8 (the released format: float8_e4m3fn beside
`<name>_scale_inv`, one fp32 scale per block of quantization_config's weight_block_size) imports to exactly the
dequantized weights (fp8 value x its block's scale, in fp32), at TP 2 where a rank's rows start inside a block too;
a quantization we do not read, a scale of the wrong shape or an fp8 weight without scales exits 2 naming it."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoint.conftest import error_line
from tests.checkpoint.hf_models import save_deepseek_v3
from tests.checkpoint.test_import_hf_moe import import_hf

BLOCK = (16, 16)
"""Blocks smaller than the release's 128 x 128, so the tiny model's weights hold several, some cut short (the 24 rows
of kv_a_proj_with_mqa), and a TP 2 rank's rows start where a block does (q_b_proj's 64: 32 each) or inside one (the
dense MLP's 48 gate rows: rank 1 reads from row 24, in the block of rows 16..31)."""
E4M3_MAX = 448.0


def quantize(weight):
    """(fp8 weight, fp32 scales [ceil(out/16), ceil(in/16)]) as DeepSeek's quantizer makes them: per block,
    scale = amax / 448, value / scale rounded to e4m3."""
    out, inner = weight.shape
    scales = torch.empty(-(-out // BLOCK[0]), -(-inner // BLOCK[1]))
    q = torch.empty(out, inner, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
            block = weight[rows, cols].float()
            scales[i, j] = block.abs().max().clamp(min=1e-12) / E4M3_MAX
            q[rows, cols] = (block / scales[i, j]).to(torch.float8_e4m3fn)
    return q, scales


def dequantized_by_block(q, scales):
    out = torch.empty(q.shape)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
            out[rows, cols] = q[rows, cols].float() * scales[i, j]
    return out


def is_quantized(name, tensor):
    """DeepSeek quantizes its projections (attention, experts, shared experts, dense MLPs), not the embedding, head,
    norms or router."""
    return tensor.dim() == 2 and name.endswith("proj.weight") and "embed" not in name


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the fp8 folder, the same model with every quantized weight replaced by its dequantized value in fp32)."""
    root = tmp_path_factory.mktemp("fp8")
    save_deepseek_v3(root / "source")
    weights = load_file(str(root / "source" / "model.safetensors"))
    fp8, plain = {}, {}
    for name, tensor in weights.items():
        if is_quantized(name, tensor):
            q, scales = quantize(tensor)
            fp8[name], fp8[name + "_scale_inv"] = q, scales
            plain[name] = dequantized_by_block(q, scales)
        else:
            fp8[name] = plain[name] = tensor
    config = json.load(open(root / "source" / "config.json"))
    for kind, tensors, extra in (("fp8", fp8, {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                                        "activation_scheme": "dynamic",
                                                                        "weight_block_size": list(BLOCK)}}),
                                 ("plain", plain, {})):
        os.makedirs(root / kind)
        save_file(tensors, str(root / kind / "model.safetensors"))
        json.dump({**config, **extra}, open(root / kind / "config.json", "w"))
    assert sum(t.dtype == torch.float8_e4m3fn for t in fp8.values()) > 20
    return root / "fp8", root / "plain"


def layer_files(checkpoint):
    folder = checkpoint / "iter_0000000"
    return {p.name: torch.load(p, weights_only=True) for p in sorted(folder.iterdir()) if p.name.startswith("layer_")}


def test_an_fp8_block_scaled_folder_imports_to_the_dequantized_weights_exactly_at_tp2(folders, tmp_path):
    fp8, plain = folders
    import_hf(fp8, tmp_path / "from_fp8", 2, 1, 1)
    import_hf(plain, tmp_path / "from_plain", 2, 1, 1)
    got, want = layer_files(tmp_path / "from_fp8"), layer_files(tmp_path / "from_plain")
    assert got.keys() == want.keys()
    for file in want:
        assert got[file].keys() == want[file].keys(), file
        for name in want[file]:
            assert torch.equal(got[file][name], want[file][name]), (file, name)


@pytest.mark.parametrize("edit, says", [
    (lambda c, t: c.update(quantization_config={"quant_method": "bitsandbytes"}),
     'quantization_config {"quant_method": "bitsandbytes"}: only fp8 e4m3 weights with block scales'),
    (lambda c, t: t.update({"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1, 1)}),
     "model.layers.0.self_attn.o_proj.weight_scale_inv has shape [1, 1]"),
    (lambda c, t: t.pop("model.layers.0.self_attn.o_proj.weight_scale_inv"),
     "model.layers.0.self_attn.o_proj.weight is fp8 without model.layers.0.self_attn.o_proj.weight_scale_inv"),
], ids=["other quantization", "scale shape", "no scale"])
def test_fp8_we_cannot_read_exits_2_naming_the_field_or_tensor_and_writes_nothing(folders, tmp_path, edit, says):
    fp8, _ = folders
    os.makedirs(tmp_path / "bad")
    config, tensors = json.load(open(fp8 / "config.json")), load_file(str(fp8 / "model.safetensors"))
    edit(config, tensors)
    json.dump(config, open(tmp_path / "bad" / "config.json", "w"))
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
    result = import_hf(tmp_path / "bad", tmp_path / "out", 1, 1, 1, check=False)
    assert result.returncode == 2 and says in error_line(result), result.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out")
