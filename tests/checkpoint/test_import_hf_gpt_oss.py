"""convert_checkpoint.py import-hf / export-hf for GptOssForCausalLM: gpt-oss-120b's and -20b's config.json read as
their flags (and back), what we cannot represent refused by name; a tiny gpt-oss imported at TP 2 x PP 2 x EP 2
computes transformers' logits, its loss under evaluate.py on the 8 warm ranks that layout takes, its greedy
continuation, and exports back bit for bit into a folder transformers loads. The model-level match (both directions,
the interleaved expert columns, sinks, windows, YaRN): tests/model/test_hf_gpt_oss_reference.py; the MXFP4 release
format: test_import_hf_mxfp4.py."""
import json

import pytest
import torch

from megatron_lite.checkpoint import hf_gpt_oss
from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_gpt_oss import hf_config, model_fields
from tests.checkpoint.conftest import error_line
from tests.checkpoint.hf_models import VOCAB, _perturb
from tests.checkpoint.test_import_hf import _edit_config
from tests.checkpoint.test_import_hf_moe import (
    convert,
    evaluate,
    evaluation_samples,
    import_hf,
    our_logits,
    relative_error,
    tokens,
)

TARGET = (2, 2, 2)  # TP, PP, EP: heads and their sinks, stages, experts all split
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 1024, "rope_theta": 10000.0}


def save_gpt_oss(folder, seed=36, dtype=torch.float32, **overrides):
    """A GptOssForCausalLM: 4 layers (sliding, full, sliding, full) with a window of 4, 4 heads of 16 in 2 key/value
    groups, sinks, q/k/v/o biases, 4 experts of width 16 (top 2) with their biases, a clamp of 1.0 (the release's is
    7: here the experts' halves cross it), YaRN without truncation, an untied head. Every weight perturbed (biases and
    sinks from their zeros), the routers spread so that every expert is chosen."""
    import transformers

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                  swiglu_limit=1.0, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_parameters=dict(YARN),
                  tie_word_embeddings=False, router_aux_loss_coef=0.01)
    fields.update(overrides)
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**fields)
    model = _perturb(transformers.GptOssForCausalLM._from_config(config, attn_implementation="eager",
                                                                 dtype=torch.float32), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.mul_(4.0)
            elif name.endswith("_bias") or name.endswith("proj.bias"):
                p.mul_(0.5)  # small beside the embeddings, which would otherwise route every token alike
    model = model.to(dtype).eval()
    model.save_pretrained(str(folder))
    return model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(save_pretrained folder, the transformers model)."""
    folder = tmp_path_factory.mktemp("hf_gpt_oss") / "hf"
    return folder, save_gpt_oss(folder)


@pytest.fixture(scope="module")
def imported(hf, tmp_path_factory):
    output = tmp_path_factory.mktemp("imported_gpt_oss") / "ckpt"
    import_hf(hf[0], output, *TARGET)
    return output


# gpt-oss-120b's config.json (GptOssConfig's defaults, the release's keys: MODELS-NOTES 3) and -20b's differences.
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4, "experts_per_token": 4,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 18, "swiglu_limit": 7.0,
    "max_position_embeddings": 131072, "initial_context_length": 4096, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
    "router_aux_loss_coef": 0.001, "output_router_logits": False, "tie_word_embeddings": False, "use_cache": True,
    "eos_token_id": 200002, "pad_token_id": 199999,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
GPT_OSS_20B = dict(GPT_OSS_120B, num_hidden_layers=24, num_local_experts=32,
                   layer_types=["sliding_attention", "full_attention"] * 12)


def _imported_config(hf_dict):
    from megatron_lite.checkpoint.hf_import import imported_config
    from megatron_lite.validation import validate

    return imported_config(hf_dict, hf_gpt_oss, 1, 1, None, 4096, "config.json", lambda c: validate(c, 1)[0])[0]


@pytest.mark.parametrize("name, hf_dict, layers, experts", [("120b", GPT_OSS_120B, 36, 128),
                                                            ("20b", GPT_OSS_20B, 24, 32)])
def test_gpt_oss_configs_read_as_megatron_lms_gpt_oss_flags_and_export_writes_them_back(name, hf_dict, layers,
                                                                                        experts):
    """Megatron-LM's gpt-oss recipe (MODELS-NOTES 3): --quick-geglu --glu-linear-offset 1.0
    --activation-func-clamp-value 7.0 --softmax-type learnable --window-size 127,0 --window-attn-skip-freq 2
    --kv-channels 64 --num-query-groups 8 --moe-router-score-function softmax --rotary-base 150000, biases on,
    YaRN at factor 32 from 4096 positions, untruncated."""
    import transformers

    m = _imported_config(hf_dict).model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels, m.head_dim) == (
        layers, 2880, 64, 8, 64, 64)
    assert (m.quick_geglu, m.swiglu, m.glu_linear_offset, m.activation_func_clamp_value, m.add_bias_linear) == (
        True, False, 1.0, 7.0, True)
    assert (m.softmax_type, m.window_size, m.window_attn_skip_freq, m.normalization, m.norm_epsilon) == (
        "learnable", (127, 0), 2, "RMSNorm", 1e-5)
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_router_score_function,
            m.moe_router_pre_softmax, m.moe_aux_loss_coeff, m.moe_layer_freq) == (
        experts, 4, 2880, "softmax", False, 0.001, "1")
    assert (m.rope_type, m.rotary_base, m.rotary_scaling_factor, m.yarn_original_max_position_embeddings,
            m.yarn_beta_fast, m.yarn_beta_slow, m.yarn_correction_range_round_to_int, m.mscale, m.mscale_all_dim) == (
        "yarn", 150000, 32.0, 4096, 32.0, 1.0, False, 1.0, 0.0)
    assert (m.vocab_size, m.max_position_embeddings, m.untie_embeddings_and_output_weights) == (201088, 131072, True)
    # Export's config.json reads back as the same flags and as the same GptOssConfig (less what is not the model's).
    written = hf_config(m)
    for field, value in model_fields(written, "config.json").items():
        assert getattr(m, field) == value or field == "num_query_groups", field
    ours, theirs = (transformers.GptOssConfig.from_dict(c).to_dict() for c in (written, hf_dict))
    left_out = {"eos_token_id", "pad_token_id", "quantization_config", "experts_per_token", "initial_context_length",
                "transformers_version", "dtype", "torch_dtype"}
    assert {k: v for k, v in ours.items() if k not in left_out} == {k: v for k, v in theirs.items()
                                                                     if k not in left_out}


def test_a_config_json_that_leaves_everything_out_is_gptossconfigs_defaults_gpt_oss_120b():
    plain = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"}
    assert model_fields(plain, "config.json") == model_fields(GPT_OSS_120B, "config.json")


def test_layer_types_other_than_alternating_read_as_their_window_flags():
    """All sliding: the window on every layer; all full, or no sliding_window: none; global every third layer:
    --window-attn-skip-freq 3."""
    layers = dict(GPT_OSS_20B)
    for types, window, every in ((["sliding_attention"] * 24, (127, 0), None), (["full_attention"] * 24, None, None),
                                 ((["sliding_attention"] * 2 + ["full_attention"]) * 8, (127, 0), 3)):
        fields = model_fields(dict(layers, layer_types=types), "config.json")
        assert (fields.get("window_size"), fields.get("window_attn_skip_freq")) == (window, every), types
    assert "window_size" not in model_fields(dict(layers, sliding_window=None), "config.json")


REFUSED = {
    "swiglu_alpha": (dict(swiglu_alpha=1.5), "swiglu_alpha = 1.5 is not supported: --quick-geglu gates with "
                                             "sigmoid(1.702 x)"),
    "attention_bias": (dict(attention_bias=False), "attention_bias = false is not supported"),
    "layer_types pattern": (dict(layer_types=["full_attention", "sliding_attention"] * 12),
                            'layer_types = ["full_attention", "sliding_attention", '),
    "layer_types length": (dict(layer_types=["sliding_attention"] * 3), "it must list 24 entries (num_hidden_layers)"),
    "layer_types kind": (dict(layer_types=["chunked_attention"] * 24), 'each "sliding_attention" or "full_attention"'),
    "top-k": (dict(num_experts_per_tok=40), "num_experts_per_tok = 40 is more than the 32 experts"),
    "window": (dict(sliding_window=1), "sliding_window = 1 must be at least 2"),
    "rope type": (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), 'rope_scaling.rope_type = "dynamic"'),
    "attention factor": (dict(rope_scaling=dict(GPT_OSS_120B["rope_scaling"], attention_factor=2.0)),
                         "rope_scaling.attention_factor = 2.0 is not supported"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_gpt_oss_config_fields_we_cannot_represent_are_refused_by_name(case):
    edit, expected = REFUSED[case]
    with pytest.raises(CheckpointError) as refused:
        model_fields(dict(GPT_OSS_20B, **edit), "config.json")
    assert str(refused.value).startswith("config.json: ") and expected in str(refused.value), str(refused.value)


def _model_flags(*extra):
    from megatron_lite.arguments import parse_args

    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--max-position-embeddings", "64", "--vocab-size", str(VOCAB), "--micro-batch-size", "1",
             "--global-batch-size", "1", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
             "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--quick-geglu", "--glu-linear-offset", "1",
             "--activation-func-clamp-value", "7", "--softmax-type", "learnable", "--window-size", "3,0",
             "--window-attn-skip-freq", "2", *extra]
    for flag, values in (("--swiglu", 0), ("--disable-bias-linear", 0), ("--quick-geglu", 0)):
        if f"no{flag}" in extra:
            i = flags.index(flag)
            flags = flags[:i] + flags[i + 1 + values:]
    return parse_args([f for f in flags if not f.startswith("no--")], world_size=1)[0]


EXPORT_REFUSED = {
    "no sinks": (["--softmax-type", "off-by-one"], "has a learned attention sink per head (sinks); this model "
                                                   "was built with --softmax-type off-by-one: use --softmax-type "
                                                   "learnable"),
    "no biases": (["--disable-bias-linear"], "built with --disable-bias-linear: drop it"),
    "offset": (["--glu-linear-offset", "0.5"], "built with --glu-linear-offset 0.5: use --glu-linear-offset 1"),
    "no clamp": (["--activation-func-clamp-value", "7", "no--quick-geglu", "--swiglu"], "built with --swiglu"),
    "pre-softmax": (["--moe-router-pre-softmax"], "built with --moe-router-pre-softmax"),
    "shared expert": (["--moe-shared-expert-intermediate-size", "16"],
                      "built with --moe-shared-expert-intermediate-size"),
    "dense layer": (["--moe-layer-freq", "[1,0]"], "built with --moe-layer-freq [1,0]"),
    "sigmoid router": (["--moe-router-score-function", "sigmoid"], "scores experts by softmax"),
}


@pytest.mark.parametrize("case", list(EXPORT_REFUSED))
def test_export_takes_gpt_oss_for_sinks_or_quick_geglu_and_refuses_what_it_cannot_hold_naming_the_flag(case):
    from megatron_lite.checkpoint import hf_export

    assert hf_export.architecture_of(_model_flags()) is hf_gpt_oss
    extra, expected = EXPORT_REFUSED[case]
    with pytest.raises(CheckpointError) as refused:
        hf_export.architecture_of(_model_flags(*extra))
    assert str(refused.value).startswith("GptOssForCausalLM ") and expected in str(refused.value), str(refused.value)


def test_an_imported_gpt_oss_gives_transformers_logits_at_tp2_pp2_ep2_with_every_expert_chosen(hf, imported):
    _, model = hf
    ids = tokens()
    chosen = [set() for _ in model.model.layers]
    hooks = [layer.mlp.router.register_forward_hook(lambda module, args, out, i=i: chosen[i].update(
        out[2].flatten().tolist())) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        theirs = model(ids).logits
    for hook in hooks:
        hook.remove()
    assert chosen == [set(range(4))] * 4
    assert relative_error(theirs, our_logits(imported, ids)) <= 1e-5
    config = json.loads((imported / "iter_0000000" / "megatron_lite.json").read_text())["config"]["model"]
    assert (config["window_size"], config["window_attn_skip_freq"], config["softmax_type"]) == ([3, 0], 2, "learnable")


def test_export_of_the_import_gives_back_every_tensor_bit_for_bit_and_transformers_loads_it(hf, imported, tmp_path):
    import transformers
    from safetensors.torch import load_file

    folder, model = hf
    assert convert("export-hf", "--load", imported, "--output", tmp_path / "out").returncode == 0
    original, exported = load_file(str(folder / "model.safetensors")), load_file(str(tmp_path / "out" /
                                                                                      "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["architectures"], config["sliding_window"], config["layer_types"], config["swiglu_limit"]) == (
        ["GptOssForCausalLM"], 4, ["sliding_attention", "full_attention"] * 2, 1.0)
    theirs = transformers.GptOssForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").eval()
    ids = tokens(seed=3)
    with torch.no_grad():
        assert relative_error(model(ids).logits, theirs(ids).logits) <= 1e-6


def test_a_bf16_gpt_oss_imports_and_exports_back_bit_for_bit_in_bf16(tmp_path):
    from safetensors.torch import load_file

    save_gpt_oss(tmp_path / "bf16", dtype=torch.bfloat16)
    import_hf(tmp_path / "bf16", tmp_path / "ckpt", 2, 1, 2)
    assert convert("export-hf", "--load", tmp_path / "ckpt", "--output", tmp_path / "out", "--dtype",
                   "bfloat16").returncode == 0
    original = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype == torch.bfloat16 and torch.equal(exported[key], tensor), key


def test_greedy_generation_from_the_import_equals_transformers_greedy_generation(hf, imported):
    """40 new tokens after a prompt of 5: past every sliding window (4) and the imported --seq-length (32), through
    our KV cache and transformers' own."""
    from megatron_lite.checkpoint.dense import load_dense_model
    from megatron_lite.inference.generation import SamplingOptions, generate

    _, model = hf
    prompt = [17, 255, 3, 98, 301]
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, min_new_tokens=40,
                                pad_token_id=0)[0].tolist()
    config, ours = load_dense_model(str(imported))
    got = generate(ours, config, prompt, SamplingOptions(max_new_tokens=40))
    assert got == theirs[len(prompt):] and len(set(got)) > 10  # not one token repeated


@pytest.mark.parametrize("edit, says", [
    (dict(swiglu_alpha=1.0), "swiglu_alpha = 1.0 is not supported"),
    (dict(intermediate_size=8), "model.layers.0.mlp.experts.gate_up_proj is [4, 32, 32], the config needs [4, 16, 32]"),
], ids=["swiglu_alpha", "expert width"])
def test_a_gpt_oss_folder_we_cannot_represent_exits_2_naming_the_field_and_writes_nothing(hf, tmp_path, edit, says):
    folder = _edit_config(hf[0], tmp_path / "in", **edit)
    line = error_line(import_hf(folder, tmp_path / "out", check=False))
    assert says in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_evaluate_on_the_import_at_tp2_pp2_ep2_gives_transformers_loss(hf, imported, corpus):
    from tests.checkpoint.hf_models import hf_loss

    expected = hf_loss(hf[1], evaluation_samples(imported, corpus))
    tp, pp, ep = TARGET  # EP over the data-parallel ranks: world TP x PP x EP
    assert evaluate(imported, corpus, tp * pp * ep, ep) == pytest.approx(expected, rel=1e-5)


def test_yarn_takes_the_releases_4096_original_positions_not_megatron_lms_builders_131072():
    """Megatron-LM's gpt-oss builder (post_training/model_builder.py) sets YaRN's original length to 131072, the
    maximum positions, where the release says 4096 (NeMo fixed the same, #14686): the ramp moves from dimensions
    8.09..17.40 to 17.40..26.70. The imported config keeps 4096 and gives transformers' own inverse frequencies."""
    import transformers
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    from megatron_lite.model.rotary import rotary_frequencies, yarn_correction_range

    m = _imported_config(GPT_OSS_120B).model
    assert m.yarn_original_max_position_embeddings == 4096
    low, high = yarn_correction_range(64, 150000, 4096, 32.0, 1.0, round_to_int=False)
    assert (round(low, 3), round(high, 3)) == (8.093, 17.398)
    bug = yarn_correction_range(64, 150000, 131072, 32.0, 1.0, round_to_int=False)
    assert (round(bug[0], 2), round(bug[1], 2)) == (17.40, 26.70)
    ours, factor = rotary_frequencies(m)
    theirs, their_factor = _compute_yarn_parameters(transformers.GptOssConfig.from_dict(GPT_OSS_120B))
    assert torch.allclose(ours, theirs.float(), rtol=1e-6, atol=0) and factor == pytest.approx(their_factor)
