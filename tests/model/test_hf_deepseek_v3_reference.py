"""transformers' own DeepseekV3ForCausalLM is the external reference for our GPT with Multi-head Latent Attention and
DeepSeek-V3's router: built from hf_deepseek_v3.hf_config() and given our weights through to_hf() (or giving us its
weights through from_hf()), it computes our logits on the unpadded vocabulary.

The tiny model has every part that can be mapped wrong: 3 dense layers then 2 with experts (8 routed, top 2 in the
best of 2 groups, sigmoid scores chosen with a selection bias away from zero, a shared expert, scaling 2.5), latent
norms away from 1, the rotary rows interleaved in Hugging Face's layout (rope_interleave) and YaRN with mscale 0.8
and mscale_all_dim 1.0 (swapped, both the softmax scale and the cos/sin factor change)."""
import pytest
import torch

from megatron_lite.checkpoint.hf_deepseek_v3 import from_hf, hf_config, mapping, model_fields, table_options, to_hf
from tests.model.gpt_layouts import tiny_config
from tests.model.test_hf_llama_reference import (
    VOCAB,
    load_into_hf,
    logits_of_both,
    our_model,
    random_tokens,
    relative_error,
)

transformers = pytest.importorskip("transformers")

MLA = ["--num-layers", "5", "--init-method-std", "0.1", "--vocab-size", str(VOCAB), "--swiglu", "--normalization",
       "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96",
       "--norm-epsilon", "1e-6", "--max-position-embeddings", "64", "--multi-latent-attention", "--kv-lora-rank", "16",
       "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--qk-layernorm"]
YARN = ["--position-embedding-type", "yarn", "--rotary-base", "10000", "--rotary-scaling-factor", "4",
        "--yarn-original-max-position-embeddings", "16", "--mscale", "0.8", "--mscale-all-dim", "1.0"]
ROUTER = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--moe-layer-freq",
          "([0]*3+[1]*2)", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
          "--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5",
          "--moe-shared-expert-intermediate-size", "16"]
Q_LORA = ["--q-lora-rank", "24"]


def deepseek_config(q_lora=True, experts=True, extra=()):
    return tiny_config(extra=MLA + YARN + (Q_LORA if q_lora else []) + (ROUTER if experts else []) + list(extra))


def hf_model(hf_dict, attention="eager"):
    config = transformers.DeepseekV3Config.from_dict(hf_dict)
    return transformers.DeepseekV3ForCausalLM._from_config(config, attn_implementation=attention,
                                                           dtype=torch.float32).eval()


def perturbed(model, seed=5):
    """Latent and layer norms away from 1 and the selection bias away from 0 (their initial values), in either
    model, so that a norm or bias left out or misplaced changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("layernorm.weight", "norm.weight")):
                t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=g))
            elif name.endswith(("expert_bias", "e_score_correction_bias")):
                t.copy_(0.1 * torch.rand(t.shape, generator=g))
    return model


def ours_and_hf(config, attention="eager", **to_hf_options):
    """Our perturbed model and transformers' with its weights (in transformers' in-memory spelling)."""
    torch.manual_seed(2)
    ours = perturbed(our_model(config))
    hf = hf_model(hf_config(config.model), attention)
    load_into_hf(hf, to_hf(ours.state_dict(), config.model, fused=True, **to_hf_options))
    return ours, hf


VARIANTS = {"q-lora": dict(), "no-q-lora": dict(q_lora=False), "dense-mla": dict(experts=False)}


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_deepseek_v3_with_our_weights_through_to_hf_gives_our_logits(attention, variant):
    ours, hf = ours_and_hf(deepseek_config(**VARIANTS[variant]), attention)
    expected, theirs = logits_of_both(ours, hf, random_tokens())
    assert relative_error(theirs, expected[..., :VOCAB]) <= 1e-5


@pytest.mark.parametrize("attention, q_lora", [("eager", True), ("sdpa", False)])
def test_our_model_with_hf_deepseek_v3_weights_through_from_hf_gives_its_logits(attention, q_lora):
    config = deepseek_config(q_lora)
    torch.manual_seed(3)
    hf = perturbed(hf_model(hf_config(config.model), attention))
    ours = our_model(config)
    ours.load_state_dict(from_hf(hf.state_dict(), config.model), strict=True)
    expected, theirs = logits_of_both(ours, hf, random_tokens(1))
    assert relative_error(expected[..., :VOCAB], theirs) <= 1e-5


def test_the_match_depends_on_the_rope_row_permutation_the_selection_bias_and_yarns_mscales():
    """Without the permutation transformers' interleaved RoPE pairs the wrong dimensions (its non-interleaved
    RoPE then matches: nothing else differs); with no selection bias, or mscale and mscale_all_dim swapped, the
    logits move by far more than the tolerance."""
    config = deepseek_config()
    tokens = random_tokens()
    ours, hf = ours_and_hf(config, interleaved=False)
    expected, theirs = logits_of_both(ours, hf, tokens)
    assert relative_error(theirs, expected[..., :VOCAB]) > 1e-3
    plain = hf_model(dict(hf_config(config.model), rope_interleave=False))
    load_into_hf(plain, hf.state_dict())
    assert relative_error(logits_of_both(ours, plain, tokens)[1], expected[..., :VOCAB]) <= 1e-5
    # Such a checkpoint (rope_interleave false) imports unpermuted.
    assert table_options({"rope_interleave": False}) == {"interleaved": False} == {
        "interleaved": not table_options({})["interleaved"]}
    dense = ours.state_dict()
    for name, tensor in from_hf(plain.state_dict(), config.model, **table_options(plain.config.to_dict())).items():
        rows = VOCAB if name.endswith(("word_embeddings.weight", "output.weight")) else None  # no padding rows there
        assert torch.equal(tensor[:rows], dense[name][:rows]), name

    hf_dict = hf_config(config.model)
    swapped = hf_model(dict(hf_dict, rope_scaling=dict(hf_dict["rope_scaling"], mscale=1.0, mscale_all_dim=0.8)))
    load_into_hf(swapped, to_hf(ours.state_dict(), config.model, fused=True))
    assert relative_error(logits_of_both(ours, swapped, tokens)[1], expected[..., :VOCAB]) > 1e-3
    unbiased = hf_model(hf_dict)
    load_into_hf(unbiased, {k: torch.zeros_like(v) if k.endswith("e_score_correction_bias") else v
                            for k, v in to_hf(ours.state_dict(), config.model, fused=True).items()})
    assert relative_error(logits_of_both(ours, unbiased, tokens)[1], expected[..., :VOCAB]) > 1e-3


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_to_hf_then_from_hf_gives_back_every_weight_exactly_and_the_config_reads_back(variant):
    config = deepseek_config(**VARIANTS[variant])
    m = config.model
    dense = perturbed(our_model(config)).state_dict()
    for name in ("layers.0.word_embeddings.weight", "layers.7.output.weight"):
        dense[name][VOCAB:] = 0  # the rows padding the vocabulary, which Hugging Face has not: zeros on the way in
    hf = to_hf(dense, m)
    attention = "model.layers.0.self_attn."
    assert hf[attention + "kv_a_proj_with_mqa.weight"].shape == (16 + 8, 64)
    assert hf[attention + "kv_b_proj.weight"].shape == (4 * (8 + 12), 16)
    assert hf[attention + ("q_b_proj.weight" if m.q_lora_rank else "q_proj.weight")].shape[0] == 4 * (8 + 8)
    back = from_hf(hf, m)
    assert list(back) == [e.ours for e in mapping(m)] and set(back) == set(dense)
    for name, tensor in back.items():
        assert torch.equal(tensor, dense[name]), name
    assert_read_back(model_fields(hf_config(m), "config.json"), m)


def assert_read_back(fields, m):
    """config.json's fields are the model's (num_query_groups: validation fills it in)."""
    for name, value in fields.items():
        assert getattr(m, name) == value or name == "num_query_groups", name
