"""DeepseekV3ForCausalLM's config.json both ways (checkpoint/hf_deepseek_v3_config.py): Kimi K2's shape and the released
configs read as their flags, and what neither side can hold is refused by name. The logits:
tests/model/test_hf_deepseek_v3_reference.py, whose tiny model these reuse."""
import dataclasses

import pytest
import torch

from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_deepseek_v3 import hf_config, model_fields
from megatron_lite.model.rotary import rotary_frequencies
from tests.model.gpt_layouts import tiny_config
from tests.model.test_hf_deepseek_v3_reference import MLA, Q_LORA, ROUTER, YARN, assert_read_back, deepseek_config

transformers = pytest.importorskip("transformers")


def test_a_kimi_k2_shaped_config_round_trips_and_gives_transformers_rotary_frequencies():
    """Kimi K2: one expert group (routing without groups), YaRN's betas both 1.0 (not the defaults 32 and 1),
    factor 32, one dense layer, no MTP layers."""
    k2 = ["--rotary-scaling-factor", "32", "--yarn-original-max-position-embeddings", "640",
          "--max-position-embeddings", str(32 * 640), "--yarn-beta-fast", "1.0", "--yarn-beta-slow", "1.0",
          "--mscale", "1.0", "--moe-router-topk-scaling-factor", "2.827"]
    ungrouped = ROUTER[:ROUTER.index("--moe-router-num-groups")] + ROUTER[ROUTER.index("--moe-router-group-topk") + 2:]
    m = tiny_config(extra=MLA + YARN + Q_LORA + ungrouped + k2 + ["--moe-layer-freq", "([0]*1+[1]*4)"]).model
    c = hf_config(m)
    assert (c["n_group"], c["topk_group"], c["first_k_dense_replace"], c["num_nextn_predict_layers"]) == (1, 1, 1, 0)
    assert {k: c["rope_scaling"][k] for k in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")} == \
        dict(factor=32.0, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    fields = model_fields(dict(c, model_type="kimi_k2"), "config.json")
    assert "moe_router_num_groups" not in fields and fields["moe_router_topk_scaling_factor"] == 2.827
    assert_read_back(fields, m)
    rotary = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(
        transformers.DeepseekV3Config.from_dict(c))
    inv_freq, factor = rotary_frequencies(m)
    torch.testing.assert_close(rotary.inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert rotary.attention_scaling == pytest.approx(factor, rel=1e-12) and factor == 1.0
    # The betas matter here: YaRN's defaults (32 and 1) ramp over other frequencies.
    defaults = dataclasses.replace(m, yarn_beta_fast=32.0, yarn_beta_slow=1.0)
    assert not torch.allclose(rotary_frequencies(defaults)[0], inv_freq)


REFUSED = {
    "attention_bias": (dict(attention_bias=True), "attention_bias = true is not supported: its biases"),
    "kv heads": (dict(num_key_value_heads=2), "num_key_value_heads = 2 is not supported"),
    "eps": (dict(rms_norm_eps=1e-5), "rms_norm_eps = 1e-05 is not supported: transformers normalises the latents"),
    "norm_topk_prob": (dict(norm_topk_prob=False), "norm_topk_prob = false is not supported"),
    "scoring_func": (dict(scoring_func="softmax"), "scoring_func = \"softmax\" is not supported"),
    "topk_method": (dict(topk_method="greedy"), "topk_method = \"greedy\" is not supported"),
    "shared experts": (dict(n_shared_experts=0), "n_shared_experts = 0 must be at least 1"),
    "groups": (dict(topk_group=3), "topk_group = 3 is not supported: it is more than n_group 2"),
    "moe_layer_freq": (dict(moe_layer_freq=2), "moe_layer_freq = 2 is not supported"),
    "mtp count": (dict(num_nextn_predict_layers=-1), "num_nextn_predict_layers = -1 must be at least 0"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_deepseek_v3_config_fields_we_cannot_represent_are_refused_by_name(case):
    edit, expected = REFUSED[case]
    with pytest.raises(CheckpointError, match="^config.json: " + expected.replace("(", r"\(")):
        model_fields(dict(hf_config(deepseek_config().model), **edit), "config.json")


def _without(flags, flag, values=1):
    i = flags.index(flag)
    return flags[:i] + flags[i + 1 + values:]


EXPORT_REFUSED = {
    "no latent norms": (_without(MLA, "--qk-layernorm", 0) + YARN + ROUTER, "built without --qk-layernorm: add it"),
    "norm epsilon": (MLA + YARN + ROUTER + ["--norm-epsilon", "1e-5"],
                     "built with --norm-epsilon 1e-05: use --norm-epsilon 1e-6"),
    "softmax router": (MLA + YARN + _without(_without(ROUTER, "--moe-router-score-function"),
                                      "--moe-router-enable-expert-bias", 0),
                       "built with --moe-router-score-function softmax: use --moe-router-score-function sigmoid"),
    "no expert bias": (MLA + YARN + _without(ROUTER, "--moe-router-enable-expert-bias", 0),
                       "built without --moe-router-enable-expert-bias: add it"),
    "no shared expert": (MLA + YARN + _without(ROUTER, "--moe-shared-expert-intermediate-size"),
                         "built without --moe-shared-expert-intermediate-size: add it, a multiple of 16"),
    "shared expert width": (MLA + YARN + ROUTER + ["--moe-shared-expert-intermediate-size", "24"],
                            "built with --moe-shared-expert-intermediate-size 24: use a multiple of 16"),
    "gated shared expert": (MLA + YARN + ROUTER + ["--moe-shared-expert-gate"],
                            "built with --moe-shared-expert-gate: drop it"),
    "dense layer after experts": (MLA + YARN + ROUTER + ["--moe-layer-freq", "[0,0,1,0,1]"],
                                  "built with --moe-layer-freq [0,0,1,0,1]: use one like ([0]*2+[1]*3)"),
    "window": (MLA + YARN + ["--window-size", "8"], "built with --window-size 8,0: drop it"),
}


@pytest.mark.parametrize("case", list(EXPORT_REFUSED))
def test_export_takes_deepseek_v3_for_mla_and_refuses_what_it_cannot_hold_naming_the_flag(case):
    from megatron_lite.checkpoint import hf_deepseek_v3, hf_export

    assert hf_export.architecture_of(deepseek_config()) is hf_deepseek_v3
    flags, expected = EXPORT_REFUSED[case]
    with pytest.raises(CheckpointError) as refused:
        hf_export.architecture_of(tiny_config(extra=flags))
    assert str(refused.value).startswith("DeepseekV3ForCausalLM ") and str(refused.value).endswith(expected)


# DeepSeek-V3's config.json as released (less its fp8 quantization_config, which a bf16 conversion drops) and Kimi
# K2's differences from it (MODELS-NOTES 1.1).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "ep_size": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 163840, "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True,
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "attention_dropout": 0.0}
KIMI_K2 = dict(DEEPSEEK_V3, model_type="kimi_k2", vocab_size=163840, num_attention_heads=64, num_key_value_heads=64,
               n_routed_experts=384, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.827,
               num_nextn_predict_layers=0, max_position_embeddings=131072, rope_theta=50000.0,
               rope_scaling=dict(DEEPSEEK_V3["rope_scaling"], beta_fast=1.0, beta_slow=1.0, factor=32.0))


def test_the_released_deepseek_v3_and_kimi_k2_configs_read_as_their_megatron_flags():
    """The flags of Megatron-LM's DeepSeek-R1 recipe (MODELS-NOTES 1.4), and Kimi K2's with its own betas."""
    from megatron_lite.checkpoint import hf_deepseek_v3
    from megatron_lite.checkpoint.hf_import import imported_config
    from megatron_lite.validation import validate

    config, _ = imported_config(DEEPSEEK_V3, hf_deepseek_v3, 1, 1, None, 4096, "config.json",
                                lambda c: validate(c, 1)[0])
    m = config.model
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.head_dim) == (
        1536, 512, 128, 64, 128, 192)
    assert (m.moe_layer_freq, m.num_experts, m.moe_router_topk, m.moe_router_num_groups, m.moe_router_group_topk,
            m.moe_router_topk_scaling_factor, m.moe_shared_expert_intermediate_size) == (
        "([0]*3+[1]*58)", 256, 8, 8, 4, 2.5, 2048)
    assert (m.rope_type, m.rotary_scaling_factor, m.mscale, m.mscale_all_dim, m.yarn_beta_fast) == (
        "yarn", 40.0, 1.0, 1.0, 32.0)
    assert hf_config(m)["first_k_dense_replace"] == 3
    k2 = model_fields(KIMI_K2, "config.json")
    assert (k2["yarn_beta_fast"], k2["yarn_beta_slow"], k2["rotary_scaling_factor"], k2["moe_layer_freq"]) == (
        1.0, 1.0, 32.0, "([0]*1+[1]*60)")
    assert "moe_router_num_groups" not in k2 and k2["rotary_base"] == 50000
