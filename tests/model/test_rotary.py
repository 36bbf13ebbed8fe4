"""Rotary positions against transformers, which is not ours: YaRN's inverse frequencies and concentration factor
(`_compute_yarn_parameters`) for DeepSeek-V3's, Kimi K2's and gpt-oss's settings, and the rotation itself, whole
and partial (`apply_rotary_pos_emb` of Llama and GLM-4.5), with YaRN's factor on cos and sin."""
import pytest
import torch

from megatron_lite.config import ConfigError
from megatron_lite.model.rotary import RotaryEmbedding, rotary_frequencies, yarn_correction_range
from tests.model.gpt_layouts import tiny_config

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

# (name, rope_theta, rotary dims, factor, original context, beta_fast, beta_slow, mscale, mscale_all_dim, truncate)
SETTINGS = {
    # DeepSeek-V3's 64 rotary dimensions (qk_rope_head_dim): s 40 over 4096; mscale = mscale_all_dim = 1, so the
    # factor on cos and sin is 1 (MLA puts m(s, mscale_all_dim)^2 into the softmax scale instead).
    "deepseek_v3": (10000, 64, 40.0, 4096, 32.0, 1.0, 1.0, 1.0, True),
    # Kimi K2: betas 1 and 1 (Megatron-LM's recipe lost them to the default 32), s 32, theta 50000.
    "kimi_k2": (50000, 64, 32.0, 4096, 1.0, 1.0, 1.0, 1.0, True),
    # gpt-oss: truncate false, no mscale: the factor is 0.1 ln 32 + 1 on cos and sin.
    "gpt_oss": (150000, 64, 32.0, 4096, 32.0, 1.0, 1.0, 0.0, False),
    # Half of each head turned (GLM-4.5's partial RoPE) under YaRN.
    "partial": (10000, 32, 8.0, 2048, 32.0, 1.0, 0.707, 1.0, True),
}


def _ours(theta, dims, factor, original, fast, slow, mscale, mscale_all_dim, truncate, head_dim=64):
    flags = ["--position-embedding-type", "yarn", "--rotary-base", str(theta), "--kv-channels", str(head_dim),
             "--rotary-percent", str(dims / head_dim), "--rotary-scaling-factor", str(factor),
             "--yarn-original-max-position-embeddings", str(original), "--yarn-beta-fast", str(fast),
             "--yarn-beta-slow", str(slow), "--mscale", str(mscale), "--mscale-all-dim", str(mscale_all_dim)]
    return tiny_config(extra=flags + ([] if truncate else ["--no-yarn-correction-range-round-to-int"])).model


def _theirs(theta, dims, factor, original, fast, slow, mscale, mscale_all_dim, truncate, head_dim=64):
    parameters = {"rope_type": "yarn", "rope_theta": float(theta), "factor": factor,
                  "original_max_position_embeddings": original, "beta_fast": fast, "beta_slow": slow,
                  "mscale": mscale, "mscale_all_dim": mscale_all_dim, "truncate": truncate,
                  "partial_rotary_factor": dims / head_dim}
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=original * int(factor), rope_parameters=parameters)
    return ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_yarn_frequencies_and_factor_equal_transformers(name):
    model = _ours(*SETTINGS[name])
    ours, factor = rotary_frequencies(model)
    theirs, their_factor = _theirs(*SETTINGS[name])
    assert model.position_embedding_type == "rope" and model.rope_type == "yarn"
    assert ours.shape == theirs.shape == (SETTINGS[name][1] // 2,)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert factor == pytest.approx(their_factor, rel=1e-12)


def test_the_settings_reach_every_part_of_yarn():
    """Each setting above moves what it should, so the equalities are not vacuous: K2's betas move the ramp (beta_fast
    32 would start it at dimension 8, not 19), truncate moves its ends, the factors differ."""
    k2 = SETTINGS["kimi_k2"]
    assert yarn_correction_range(64, 50000, 4096, 1.0, 1.0, True) == (19, 20)
    assert yarn_correction_range(64, 50000, 4096, 32.0, 1.0, True) == (8, 20)
    with_default_beta = rotary_frequencies(_ours(*k2[:4], 32.0, *k2[5:]))[0]
    assert not torch.allclose(rotary_frequencies(_ours(*k2))[0], with_default_beta)
    gpt_oss = SETTINGS["gpt_oss"]
    truncated = rotary_frequencies(_ours(*gpt_oss[:-1], True))[0]
    assert not torch.allclose(rotary_frequencies(_ours(*gpt_oss))[0], truncated)
    assert rotary_frequencies(_ours(*SETTINGS["deepseek_v3"]))[1] == 1.0
    assert rotary_frequencies(_ours(*gpt_oss))[1] == pytest.approx(1.346574, abs=1e-6)


def test_yarn_at_factor_1_is_plain_rope():
    plain = tiny_config(extra=["--position-embedding-type", "rope", "--kv-channels", "64"]).model
    yarn = tiny_config(extra=["--position-embedding-type", "rope", "--rope-type", "yarn", "--kv-channels", "64"]).model
    assert torch.equal(rotary_frequencies(plain)[0], rotary_frequencies(yarn)[0])
    assert rotary_frequencies(yarn)[1] == 1.0


@pytest.mark.parametrize("name, module", [("gpt_oss", "llama"), ("partial", "glm4_moe")])
def test_the_rotation_equals_transformers_apply_rotary_pos_emb(name, module):
    """Queries and keys [b, heads, s, d] at positions 0..s-1 turned by our RotaryEmbedding and by transformers'
    apply_rotary_pos_emb with its rotary embedding's cos and sin (YaRN's factor included; GLM's partial turn)."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    setting = SETTINGS[name]
    inv_freq, factor = rotary_frequencies(_ours(*setting))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 48, 64, generator=g), torch.randn(2, 2, 48, 64, generator=g)
    positions = torch.arange(48).expand(2, 48)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    theirs = modeling.apply_rotary_pos_emb(q, k, emb.cos() * factor, emb.sin() * factor)
    ours = RotaryEmbedding(inv_freq, factor)(q, k)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    if name == "partial":
        assert torch.equal(ours[0][..., 32:], q[..., 32:])  # the second half of each head passes unturned


def test_documents_restart_yarn_positions_like_one_offset_per_document():
    inv_freq, factor = rotary_frequencies(_ours(*SETTINGS["gpt_oss"]))
    rotary = RotaryEmbedding(inv_freq, factor)
    q = torch.randn(1, 2, 8, 64, generator=torch.Generator().manual_seed(1))
    whole = rotary(q, q, offset=3)[0]
    restarted = rotary(q, q, positions=torch.arange(3, 11)[None])[0]
    torch.testing.assert_close(whole, restarted, rtol=0, atol=1e-6)


@pytest.mark.parametrize("flags, says", [
    (["--position-embedding-type", "yarn", "--rotary-scaling-factor", "40"], "--yarn-original-max-position-embeddings"),
    (["--position-embedding-type", "rope", "--yarn-beta-fast", "1"], "only YaRN reads it"),
    (["--position-embedding-type", "rope", "--mscale-all-dim", "1", "--rotary-scaling-factor", "4"],
     "--rotary-scaling-factor 4, --mscale-all-dim 1: only YaRN reads them"),
    (["--rope-type", "yarn"], "needs --position-embedding-type rope (or yarn); got learned_absolute"),
    (["--position-embedding-type", "yarn", "--use-rope-scaling"], "keep one of them"),
    (["--position-embedding-type", "yarn", "--yarn-beta-fast", "0.5"], "use --yarn-beta-fast 1 or more"),
    (["--rotary-percent", "0.5"], "the positions are learned_absolute"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0.1"], "use --rotary-percent 0.125 (2 dimensions)"),
])
def test_a_rotary_flag_that_would_do_nothing_or_cannot_work_is_refused_naming_it(flags, says):
    with pytest.raises(ConfigError) as refused:
        tiny_config(extra=flags)
    assert says in str(refused.value)


def test_a_rotary_percent_of_zero_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        tiny_config(extra=["--position-embedding-type", "rope", "--rotary-percent", "0"])
    assert "argument --rotary-percent: must be more than 0, got 0" in capsys.readouterr().err
