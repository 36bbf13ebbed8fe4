"""transformers' own Glm4MoeForCausalLM (GLM-4.5/4.6/4.7) is the external reference for our GPT with grouped-query
attention and DeepSeek-V3's experts: built from hf_glm4_moe.hf_config() and given our weights through to_hf() (or
giving us its weights through from_hf()), it computes our logits on the unpadded vocabulary.

The tiny model has every part that can be mapped wrong: 4 heads in 2 key/value groups of width 24 (not hidden 64 / 4
heads), RoPE over the first half of each head (partial_rotary_factor 0.5), QK-norm, q/k/v biases, one dense layer
then 2 with experts (8 routed, top 2 in the best of 2 groups, sigmoid scores chosen with a selection bias away from
zero, a shared expert, scaling 2.5); norms away from 1 and biases away from 0. GLM-4.5-Air's shape (no QK-norm) is a
variant. The MTP layer: test_hf_glm4_moe_mtp.py."""
import re

import pytest
import torch

from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_glm4_moe import from_hf, hf_config, mapping, model_fields, to_hf
from megatron_lite.model.rotary import rotary_frequencies
from tests.model.gpt_layouts import tiny_config
from tests.model.test_hf_deepseek_v3_reference import assert_read_back
from tests.model.test_hf_deepseek_v3_reference import perturbed as deepseek_perturbed
from tests.model.test_hf_llama_reference import (
    VOCAB,
    load_into_hf,
    logits_of_both,
    our_model,
    random_tokens,
    relative_error,
)

transformers = pytest.importorskip("transformers")

LAYERS = 3
GQA = ["--num-layers", str(LAYERS), "--init-method-std", "0.1", "--vocab-size", str(VOCAB), "--swiglu",
       "--normalization", "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
       "--ffn-hidden-size", "96", "--norm-epsilon", "1e-5", "--max-position-embeddings", "64",
       "--position-embedding-type", "rope", "--rotary-base", "10000", "--group-query-attention", "--num-query-groups",
       "2", "--kv-channels", "24", "--rotary-percent", "0.5"]
QK_NORM_AND_BIASES = ["--qk-layernorm", "--add-qkv-bias"]
ROUTER = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--moe-layer-freq",
          "([0]*1+[1]*2)", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
          "--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5",
          "--moe-shared-expert-intermediate-size", "16"]
VARIANTS = {"glm-4.5": QK_NORM_AND_BIASES, "glm-4.5-air": ["--add-qkv-bias"], "no-biases": ["--qk-layernorm"]}


def glm_config(extra=QK_NORM_AND_BIASES):
    return tiny_config(extra=GQA + ROUTER + list(extra))


def hf_model(hf_dict, attention="eager"):
    config = transformers.Glm4MoeConfig.from_dict(hf_dict)
    return transformers.Glm4MoeForCausalLM._from_config(config, attn_implementation=attention,
                                                        dtype=torch.float32).eval()


def perturbed(model, seed=5):
    """DeepSeek-V3's perturbation (norms, the selection bias) and the q/k/v biases away from their zeros."""
    deepseek_perturbed(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith(("query_key_value.bias", "q_proj.bias", "k_proj.bias", "v_proj.bias")):
                t.copy_(0.3 * torch.randn(t.shape, generator=g))
    return model


def ours_and_hf(config, attention="eager", hf_dict=None):
    """Our perturbed model and transformers' with its weights (in transformers' in-memory spelling)."""
    torch.manual_seed(2)
    ours = perturbed(our_model(config))
    hf = hf_model(hf_dict or hf_config(config.model), attention)
    load_into_hf(hf, to_hf(ours.state_dict(), config.model, fused=True))
    return ours, hf


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_glm4_moe_with_our_weights_through_to_hf_gives_our_logits(attention, variant):
    ours, hf = ours_and_hf(glm_config(VARIANTS[variant]), attention)
    expected, theirs = logits_of_both(ours, hf, random_tokens())
    assert relative_error(theirs, expected[..., :VOCAB]) <= 1e-5


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_our_model_with_hf_glm4_moe_weights_through_from_hf_gives_its_logits(attention):
    config = glm_config()
    torch.manual_seed(3)
    hf = perturbed(hf_model(hf_config(config.model), attention))
    ours = our_model(config)
    ours.load_state_dict(from_hf(hf.state_dict(), config.model), strict=True)
    expected, theirs = logits_of_both(ours, hf, random_tokens(1))
    assert relative_error(expected[..., :VOCAB], theirs) <= 1e-5


def test_the_match_depends_on_which_half_of_each_head_turns_the_biases_and_the_selection_bias():
    """RoPE over whole heads, no q/k/v biases or no selection bias on transformers' side moves the logits by far more
    than the tolerance; and transformers' rotary table is ours (the first r = 12 of 24 dimensions)."""
    config = glm_config()
    tokens = random_tokens()
    ours, hf = ours_and_hf(config)
    expected = logits_of_both(ours, hf, tokens)[0][..., :VOCAB]
    hf_dict, weights = hf_config(config.model), to_hf(ours.state_dict(), config.model, fused=True)
    for edit, zeroed in ((dict(partial_rotary_factor=1.0), ()), ({}, ("q_proj.bias", "k_proj.bias")),
                         ({}, ("e_score_correction_bias",))):
        other = hf_model(dict(hf_dict, **edit))
        load_into_hf(other, {k: torch.zeros_like(v) if k.endswith(zeroed) and zeroed else v
                             for k, v in weights.items()})
        assert relative_error(logits_of_both(ours, other, tokens)[1], expected) > 1e-3, (edit, zeroed)
    inv_freq, factor = rotary_frequencies(config.model)
    assert inv_freq.numel() == 6 and factor == 1.0
    torch.testing.assert_close(hf.model.rotary_emb.inv_freq, inv_freq, rtol=1e-6, atol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_to_hf_then_from_hf_gives_back_every_weight_exactly_and_the_config_reads_back(variant):
    config = glm_config(VARIANTS[variant])
    m = config.model
    dense = perturbed(our_model(config)).state_dict()
    for name in ("layers.0.word_embeddings.weight", f"layers.{LAYERS + 2}.output.weight"):
        dense[name][VOCAB:] = 0  # the rows padding the vocabulary, which Hugging Face has not: zeros on the way in
    hf = to_hf(dense, m)
    attention = "model.layers.0.self_attn."
    assert hf[attention + "q_proj.weight"].shape == (4 * 24, 64) and hf[attention + "k_proj.weight"].shape == (48, 64)
    assert (attention + "q_norm.weight" in hf) == m.qk_layernorm and (attention + "v_proj.bias" in hf) == m.add_qkv_bias
    assert attention + "o_proj.bias" not in hf
    assert hf["model.layers.1.mlp.gate.e_score_correction_bias"].shape == (8,)
    assert hf["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (16, 64)
    back = from_hf(hf, m)
    assert list(back) == [e.ours for e in mapping(m)] and set(back) == set(dense)
    for name, tensor in back.items():
        assert torch.equal(tensor, dense[name]), name
    assert_read_back(model_fields(hf_config(m), "config.json"), m)


# GLM-4.5's config.json as released (zai-org/GLM-4.5) and GLM-4.5-Air's differences from it.
GLM_4_5 = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1536,
    "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "num_hidden_layers": 92, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_qk_norm": True, "vocab_size": 151552}
GLM_4_5_AIR = dict(GLM_4_5, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                   n_routed_experts=128, routed_scaling_factor=1.0, first_k_dense_replace=1, num_hidden_layers=46,
                   use_qk_norm=False)


@pytest.mark.parametrize("released, expected", [
    (GLM_4_5, dict(num_layers=92, kv_channels=128, qk_layernorm=True, num_experts=160, moe_ffn_hidden_size=1536,
                   moe_shared_expert_intermediate_size=1536, moe_layer_freq="([0]*3+[1]*89)",
                   moe_router_topk_scaling_factor=2.5)),
    (GLM_4_5_AIR, dict(num_layers=46, kv_channels=128, num_experts=128, moe_ffn_hidden_size=1408,
                       moe_shared_expert_intermediate_size=1408, moe_layer_freq="([0]*1+[1]*45)"))],
    ids=["GLM-4.5", "GLM-4.5-Air"])
def test_the_released_configs_read_as_their_flags(released, expected):
    fields = model_fields(released, "config.json")
    common = dict(num_attention_heads=96, num_query_groups=8, rotary_percent=0.5, add_qkv_bias=True,
                  rotary_base=1000000, norm_epsilon=1e-5, moe_router_topk=8, moe_router_score_function="sigmoid",
                  moe_router_enable_expert_bias=True, untie_embeddings_and_output_weights=True, vocab_size=151552)
    assert {k: fields.get(k) for k in {**common, **expected}} == {**common, **expected}
    assert "moe_router_num_groups" not in fields and ("qk_layernorm" in fields) == released["use_qk_norm"]
    # Glm4MoeConfig's defaults where config.json says nothing: half of each head turns, eps 1e-5, 8 key/value heads.
    bare = {k: v for k, v in released.items() if k not in ("partial_rotary_factor", "rms_norm_eps",
                                                           "num_key_value_heads")}
    assert {k: model_fields(bare, "c")[k] for k in ("rotary_percent", "norm_epsilon", "num_query_groups")} == {
        "rotary_percent": 0.5, "norm_epsilon": 1e-5, "num_query_groups": 8}
    # transformers 5 writes the rotary share into rope_parameters, where it wins over the top-level key.
    nested = dict(bare, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
                  partial_rotary_factor=0.5)
    assert model_fields(nested, "c")["rotary_percent"] == 0.25


REFUSED = {
    "use_qk_norm": (dict(use_qk_norm="yes"), "use_qk_norm = \"yes\" must be true or false"),
    "norm_topk_prob": (dict(norm_topk_prob=False), "norm_topk_prob = false is not supported"),
    "scoring_func": (dict(scoring_func="softmax"), "scoring_func = \"softmax\" is not supported: transformers' "
                                                   "Glm4MoeForCausalLM"),
    "shared experts": (dict(n_shared_experts=0), "n_shared_experts = 0 must be at least 1"),
    "groups": (dict(topk_group=3), "topk_group = 3 is not supported: it is more than n_group 2"),
    "dense": (dict(first_k_dense_replace=3), "first_k_dense_replace = 3 is not supported: it leaves all 3 layers "
                                             "dense"),
    "window": (dict(sliding_window=8), "sliding_window = 8 is not supported: transformers' Glm4MoeForCausalLM "
                                       "attends over the whole causal context"),
    "rotary share": (dict(partial_rotary_factor=0.0), "partial_rotary_factor = 0.0 must be"),
    "odd rotary width": (dict(partial_rotary_factor=0.3), "partial_rotary_factor = 0.3 is not supported: it turns "
                                                          "int(0.3 x head_dim 24) = 7 dimensions of each head"),
    "hidden_act": (dict(hidden_act="gelu"), "hidden_act = \"gelu\" is not supported"),
    "mtp count": (dict(num_nextn_predict_layers=-1), "num_nextn_predict_layers = -1 must be at least 0"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_glm4_moe_config_fields_we_cannot_represent_are_refused_by_name(case):
    edit, expected = REFUSED[case]
    with pytest.raises(CheckpointError, match="^config.json: " + re.escape(expected)):
        model_fields(dict(hf_config(glm_config().model), **edit), "config.json")


def _without(flags, flag, values=1):
    i = flags.index(flag)
    return flags[:i] + flags[i + 1 + values:]


EXPORT_REFUSED = {
    "gated shared expert": (ROUTER + ["--moe-shared-expert-gate"], "built with --moe-shared-expert-gate: drop it"),
    "shared expert width": (ROUTER + ["--moe-shared-expert-intermediate-size", "24"],
                            "built with --moe-shared-expert-intermediate-size 24: use a multiple of 16"),
    "dense layer after experts": (ROUTER + ["--moe-layer-freq", "[0,1,0]"],
                                  "built with --moe-layer-freq [0,1,0]: use one like ([0]*1+[1]*2)"),
    "window": (ROUTER + ["--window-size", "8"], "built with --window-size 8,0: drop it"),
}


@pytest.mark.parametrize("case", list(EXPORT_REFUSED))
def test_export_takes_glm4_moe_for_deepseek_v3_experts_without_mla_and_refuses_what_it_cannot_hold(case):
    from megatron_lite.checkpoint import hf_deepseek_v3, hf_export, hf_glm4_moe, hf_mixtral, hf_qwen3_moe

    for variant in VARIANTS.values():
        assert hf_export.architecture_of(glm_config(variant)) is hf_glm4_moe
    # The choices it leaves alone: MLA is DeepSeek-V3's; a softmax router, or a sigmoid one without the selection bias
    # or the shared expert, stays with the Qwen/Mixtral families (which refuse the latter, as before).
    from tests.model.test_hf_deepseek_v3_reference import deepseek_config
    assert hf_export.architecture_of(deepseek_config()) is hf_deepseek_v3
    softmax = ["--num-experts", "8", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2"]
    assert hf_export.architecture_of(tiny_config(extra=_without(GQA, "--rotary-percent") + softmax)) is hf_mixtral
    assert hf_export.architecture_of(tiny_config(extra=_without(GQA, "--rotary-percent") + softmax + [
        "--qk-layernorm"])) is hf_qwen3_moe
    unshared = _without(ROUTER, "--moe-shared-expert-intermediate-size")
    with pytest.raises(CheckpointError, match="^MixtralForCausalLM scores experts by softmax"):
        hf_export.architecture_of(tiny_config(extra=_without(GQA, "--rotary-percent") + unshared))
    flags, expected = EXPORT_REFUSED[case]
    with pytest.raises(CheckpointError) as refused:
        hf_export.architecture_of(tiny_config(extra=GQA + flags))
    assert str(refused.value).startswith("Glm4MoeForCausalLM ") and str(refused.value).endswith(expected)
