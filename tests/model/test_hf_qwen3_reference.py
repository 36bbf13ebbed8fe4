"""transformers' own Qwen3ForCausalLM is the external reference for our Llama-family GPT with --qk-layernorm
and --kv-channels: built from hf_qwen3.hf_config() and given our weights through to_hf() (or giving us its
weights through from_hf()), it computes our logits on the unpadded vocabulary."""
import pytest
import torch

from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_qwen3 import from_hf, hf_config, mapping, model_fields, to_hf
from megatron_lite.model.gpt import GPTModel
from tests.model.gpt_layouts import tiny_config
from tests.model.test_hf_llama_reference import (
    BATCH,
    SEQ,
    VOCAB,
    llama_flags,
    load_into_hf,
    logits_of_both,
    our_model,
    random_tokens,
    relative_error,
)

transformers = pytest.importorskip("transformers")

QWEN3 = ["--qk-layernorm", "--kv-channels", "24"]  # heads of 24, not hidden 64 / 4 heads = 16


def qwen3_flags(groups=2, untie=True):
    return llama_flags(groups, rope_scaling=False, untie=untie) + QWEN3


def hf_model(hf_dict, attention):
    config = transformers.Qwen3Config.from_dict(hf_dict)
    return transformers.Qwen3ForCausalLM._from_config(config, attn_implementation=attention,
                                                      dtype=torch.float32).eval()


def perturbed_norms(model, seed=5):
    """QK-norm weights away from 1 (their initial value), so a norm left out or misplaced changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("_norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("groups, untie", [(2, True), (4, False)], ids=["gqa-2-groups", "mha-tied-head"])
def test_hf_qwen3_with_our_weights_through_to_hf_gives_our_logits(attention, groups, untie):
    config = tiny_config(extra=qwen3_flags(groups, untie))
    ours = perturbed_norms(our_model(config))
    hf = hf_model(hf_config(config.model), attention)
    load_into_hf(hf, to_hf(ours.state_dict(), config.model))
    assert hf.model.layers[0].self_attn.head_dim == 24

    expected, theirs = logits_of_both(ours, hf, random_tokens())
    assert theirs.shape == (BATCH, SEQ, VOCAB)
    assert relative_error(theirs, expected[..., :VOCAB]) <= 1e-5


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_our_model_with_hf_qwen3_weights_through_from_hf_gives_its_logits(attention):
    config = tiny_config(extra=qwen3_flags())
    torch.manual_seed(3)
    hf = perturbed_norms(hf_model(hf_config(config.model), attention))
    ours = our_model(config)
    ours.load_state_dict(from_hf(hf.state_dict(), config.model), strict=True)

    expected, theirs = logits_of_both(ours, hf, random_tokens(1))
    assert relative_error(expected[..., :VOCAB], theirs) <= 1e-5


def test_the_match_depends_on_the_qk_norm():
    """Our logits without the QK-norm (same other weights) are far from Qwen3's: the match above is not vacuous."""
    config = tiny_config(extra=qwen3_flags())
    ours = perturbed_norms(our_model(config))
    hf = hf_model(hf_config(config.model), "eager")
    load_into_hf(hf, to_hf(ours.state_dict(), config.model))
    plain = our_model(tiny_config(extra=llama_flags(rope_scaling=False) + ["--kv-channels", "24"]))
    plain.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.endswith(("q_layernorm.weight",
                                                                                          "k_layernorm.weight"))})
    expected, theirs = logits_of_both(plain, hf, random_tokens())
    assert relative_error(theirs, expected[..., :VOCAB]) > 1e-3


def test_to_hf_then_from_hf_gives_back_every_weight_and_the_config_reads_back():
    config = tiny_config(extra=qwen3_flags())
    dense = GPTModel(config).state_dict()
    hf = to_hf(dense, config.model)
    assert hf["model.layers.0.self_attn.q_norm.weight"].shape == (24,)
    assert hf["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 24, 64)
    assert hf["model.layers.0.self_attn.o_proj.weight"].shape == (64, 4 * 24)
    back = from_hf(hf, config.model)
    assert list(back) == [e.ours for e in mapping(config.model)] and set(back) == set(dense)
    c = hf_config(config.model)
    assert (c["architectures"], c["head_dim"], c["use_sliding_window"], c["attention_bias"]) == (
        ["Qwen3ForCausalLM"], 24, False, False)
    fields = model_fields(c, "config.json")
    assert (fields["kv_channels"], fields["qk_layernorm"], fields["num_query_groups"]) == (24, True, 2)


def test_qwen3_config_fields_we_cannot_represent_are_refused_by_name():
    c = hf_config(tiny_config(extra=qwen3_flags()).model)
    with pytest.raises(CheckpointError, match="use_sliding_window = true is not supported"):
        model_fields(dict(c, use_sliding_window=True, sliding_window=16), "config.json")
    with pytest.raises(CheckpointError, match='layer_types has "sliding_attention" layers'):
        model_fields(dict(c, layer_types=["full_attention", "sliding_attention"]), "config.json")
    with pytest.raises(CheckpointError, match="attention_bias = true is not supported"):
        model_fields(dict(c, attention_bias=True), "config.json")
    with pytest.raises(CheckpointError, match="head_dim = 0 must be at least 1"):
        model_fields(dict(c, head_dim=0), "config.json")
    # Qwen3Config's own default head width, not hidden / heads
    assert model_fields({k: v for k, v in c.items() if k != "head_dim"}, "config.json")["kv_channels"] == 128


def test_export_takes_qwen3_for_qk_norm_and_refuses_what_no_architecture_holds_with_the_flag():
    from megatron_lite.checkpoint import hf_export, hf_llama, hf_qwen3

    assert hf_export.architecture_of(tiny_config(extra=qwen3_flags())) is hf_qwen3
    assert hf_export.architecture_of(tiny_config(extra=llama_flags() + ["--kv-channels", "24"])) is hf_llama
    with pytest.raises(CheckpointError, match="built without --qk-layernorm"):
        hf_config(tiny_config(extra=llama_flags()).model)
    with pytest.raises(CheckpointError, match="Qwen3ForCausalLM needs the Llama-family block; this model was built "
                                              "without --swiglu"):
        hf_export.architecture_of(tiny_config(extra=QWEN3))
    with pytest.raises(CheckpointError, match=r"--kv-channels 24 wide; GPT2LMHeadModel's are n_embd / n_head = 16"):
        hf_export.architecture_of(tiny_config(extra=["--kv-channels", "24"]))
