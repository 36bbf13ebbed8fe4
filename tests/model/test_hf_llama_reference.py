"""transformers' own LlamaForCausalLM is the external reference for our Llama-family GPT: built from
hf_config() and given our weights through to_hf() (or giving us its weights through from_hf()), it
computes our logits on the unpadded vocabulary. transformers' Qwen2ForCausalLM (Llama's block with
biases on q_proj, k_proj and v_proj alone) is the reference for --add-qkv-bias."""
import pytest
import torch

from megatron_lite.checkpoint import hf_mapping
from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_llama import FLAGS, from_hf, hf_config, mapping, table, to_hf, with_qkv_biases
from megatron_lite.model.gpt import GPTModel
from megatron_lite.model.rotary import rotary_frequencies
from megatron_lite.parallel.random import model_parallel_seed
from tests.model.gpt_layouts import tiny_config

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 100, 2, 32  # 100 rows padded to 128 (multiple of 32)


def llama_flags(groups=2, rope_scaling=True, untie=True):
    # Weights of std 0.1, not 0.02: attention is then far from uniform, so positions (RoPE and its
    # scaling) move the logits by much more than the tolerance.
    flags = ["--num-layers", "2", "--init-method-std", "0.1", "--vocab-size", str(VOCAB), "--swiglu",
             "--normalization", "RMSNorm", "--group-query-attention", "--num-query-groups", str(groups),
             "--disable-bias-linear", "--position-embedding-type", "rope", "--rotary-base", "500000",
             "--ffn-hidden-size", "96"]
    return flags + (["--use-rope-scaling"] if rope_scaling else []) + (
        ["--untie-embeddings-and-output-weights"] if untie else [])


def hf_model(hf_dict, attention):
    config = transformers.LlamaConfig.from_dict(hf_dict)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=attention,
                                                      dtype=torch.float32).eval()


def our_model(config):
    """GPTModel in eval mode; its layers' dropout streams (which draw nothing in eval) must exist."""
    model = GPTModel(config)
    model_parallel_seed(config.training.seed, config.model.numbered_layers)
    return model.eval()


def load_into_hf(model, state):
    """A tied model's lm_head.weight is the embedding's parameter: loading the embedding sets it."""
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= ({"lm_head.weight"} if model.config.tie_word_embeddings else set())


def random_tokens(seed=0):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def relative_error(theirs, ours):
    return ((theirs - ours).abs().max() / ours.abs().max()).item()


def logits_of_both(ours, hf, tokens):
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    with torch.no_grad():
        return ours(tokens, positions), hf(tokens).logits


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("groups, untie", [(2, True), (1, True), (4, False)],
                         ids=["gqa-2-groups", "mqa-1-group", "mha-tied-head"])
def test_hf_llama_with_our_weights_through_to_hf_gives_our_logits(attention, groups, untie):
    config = tiny_config(extra=llama_flags(groups, untie=untie))
    ours = our_model(config)
    hf = hf_model(hf_config(config.model), attention)
    load_into_hf(hf, to_hf(ours.state_dict(), config.model))

    expected, theirs = logits_of_both(ours, hf, random_tokens())
    assert expected.shape == (BATCH, SEQ, config.model.padded_vocab_size) and theirs.shape == (BATCH, SEQ, VOCAB)
    assert relative_error(theirs, expected[..., :VOCAB]) <= 1e-5


def test_hf_llama_with_a_head_dim_apart_from_hidden_over_heads_is_our_kv_channels():
    """Llama's config.json head_dim (here 24, not 64 / 4) is --kv-channels, both ways."""
    from megatron_lite.checkpoint.hf_llama import model_fields

    config = tiny_config(extra=llama_flags() + ["--kv-channels", "24"])
    ours = our_model(config)
    hf = hf_model(hf_config(config.model), "sdpa")
    load_into_hf(hf, to_hf(ours.state_dict(), config.model))
    assert hf.model.layers[0].self_attn.head_dim == 24
    expected, theirs = logits_of_both(ours, hf, random_tokens())
    assert relative_error(theirs, expected[..., :VOCAB]) <= 1e-5
    assert model_fields(hf_config(config.model), "config.json")["kv_channels"] == 24
    assert model_fields(hf_config(tiny_config(extra=llama_flags()).model), "config.json")["kv_channels"] is None


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_our_model_with_hf_llama_weights_through_from_hf_gives_its_logits(attention):
    config = tiny_config(extra=llama_flags())
    torch.manual_seed(3)
    hf = hf_model(hf_config(config.model), attention)
    ours = our_model(config)
    ours.load_state_dict(from_hf(hf.state_dict(), config.model), strict=True)

    expected, theirs = logits_of_both(ours, hf, random_tokens(1))
    assert relative_error(expected[..., :VOCAB], theirs) <= 1e-5
    assert torch.equal(expected[..., VOCAB:], torch.zeros(BATCH, SEQ, 128 - VOCAB))  # zero padded rows


def test_the_match_depends_on_llama3_rope_scaling():
    """Llama 3.1's scaling changes these logits by over 100x the tolerance, so the matches above are not
    vacuous: an HF model without it (or ours without it) disagrees."""
    config = tiny_config(extra=llama_flags())
    unscaled = tiny_config(extra=llama_flags(rope_scaling=False))
    ours = our_model(config)
    tokens = random_tokens()

    without = dict(hf_config(config.model), rope_scaling=None)
    assert hf_config(unscaled.model) == without
    hf = hf_model(hf_config(config.model), "eager")
    hf_unscaled = hf_model(without, "eager")
    for model in (hf, hf_unscaled):
        load_into_hf(model, to_hf(ours.state_dict(), config.model))
    expected, theirs = logits_of_both(ours, hf, tokens)
    _, theirs_unscaled = logits_of_both(ours, hf_unscaled, tokens)
    assert relative_error(theirs, expected[..., :VOCAB]) <= 1e-5
    assert relative_error(theirs_unscaled, expected[..., :VOCAB]) > 1e-3

    ours_unscaled = our_model(unscaled)
    ours_unscaled.load_state_dict(ours.state_dict())
    expected_unscaled, _ = logits_of_both(ours_unscaled, hf, tokens)
    assert relative_error(theirs, expected_unscaled[..., :VOCAB]) > 1e-3

    ours_inv_freq, factor = rotary_frequencies(config.model)
    assert factor == 1.0
    torch.testing.assert_close(hf.model.rotary_emb.inv_freq, ours_inv_freq, rtol=1e-6, atol=0)
    assert not torch.allclose(hf_unscaled.model.rotary_emb.inv_freq, ours_inv_freq)


YARN = ["--rotary-base", "10000", "--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
        "--yarn-original-max-position-embeddings", "1000", "--yarn-beta-fast", "8", "--mscale", "1",
        "--mscale-all-dim", "0.5"]
"""YaRN whose ramp falls inside a head of 16 (it runs over 2 to 5 of its 8 frequencies) and whose factor on cos and sin
takes both mscales, (0.1 ln 4 + 1) / (0.05 ln 4 + 1)."""


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_hf_llama_with_yarn_gives_our_logits_and_its_config_gives_back_our_yarn(attention):
    from megatron_lite.checkpoint.hf_llama import model_fields

    config = tiny_config(extra=llama_flags(rope_scaling=False) + YARN)
    m = config.model
    ours = our_model(config)
    hf = hf_model(hf_config(m), attention)
    load_into_hf(hf, to_hf(ours.state_dict(), m))
    expected, theirs = logits_of_both(ours, hf, random_tokens())
    assert relative_error(theirs, expected[..., :VOCAB]) <= 1e-5

    fields = model_fields(hf_config(m), "config.json")
    for name in ("rope_type", "rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
                 "yarn_beta_slow", "yarn_correction_range_round_to_int", "mscale", "mscale_all_dim", "rotary_base"):
        assert fields[name] == getattr(m, name), name
    plain = hf_model(dict(hf_config(m), rope_scaling=None), attention)
    load_into_hf(plain, to_hf(ours.state_dict(), m))
    assert relative_error(logits_of_both(ours, plain, random_tokens())[1], expected[..., :VOCAB]) > 1e-3


def test_a_yarn_attention_factor_of_its_own_or_a_partial_turn_is_refused_naming_the_field():
    from megatron_lite.checkpoint.hf_llama import model_fields

    m = tiny_config(extra=llama_flags(rope_scaling=False) + YARN).model
    c = hf_config(m)
    with pytest.raises(CheckpointError, match=r"rope_scaling.attention_factor = 2.0 is not supported"):
        model_fields(dict(c, rope_scaling=dict(c["rope_scaling"], attention_factor=2.0)), "config.json")
    partial = tiny_config(extra=llama_flags() + ["--rotary-percent", "0.5"]).model
    with pytest.raises(CheckpointError, match=r"--rotary-percent 1"):
        hf_config(partial)


def test_hf_config_is_the_llama_3_1_shape():
    config = tiny_config(extra=llama_flags() + ["--rope-scaling-factor", "16", "--norm-epsilon", "1e-6"])
    hf = hf_config(config.model)
    assert hf["rope_scaling"] == {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert (hf["rope_theta"], hf["rms_norm_eps"], hf["num_key_value_heads"], hf["intermediate_size"]) == (
        500000.0, 1e-6, 2, 96)
    assert (hf["vocab_size"], hf["tie_word_embeddings"], hf["attention_bias"], hf["mlp_bias"]) == (
        VOCAB, False, False, False)
    assert hf["max_position_embeddings"] == config.model.max_position_embeddings


def test_to_hf_then_from_hf_gives_back_every_weight_with_zero_padding_rows():
    config = tiny_config(extra=llama_flags())
    dense = GPTModel(config).state_dict()
    back = from_hf(to_hf(dense, config.model), config.model)
    assert list(back) == [e.ours for e in mapping(config.model)] and set(back) == set(dense)
    for name, tensor in dense.items():
        if name in ("layers.0.word_embeddings.weight", "layers.4.output.weight"):
            assert torch.equal(back[name][:VOCAB], tensor[:VOCAB]) and not back[name][VOCAB:].any()
        else:
            assert torch.equal(back[name], tensor), name


def test_a_gpt2_shaped_model_or_a_mismatched_hf_model_is_refused_with_the_flag():
    gpt2 = tiny_config()
    with pytest.raises(CheckpointError, match="--swiglu, --normalization RMSNorm, --disable-bias-linear"):
        hf_config(gpt2.model)
    config = tiny_config(extra=llama_flags())
    hf = to_hf(GPTModel(config).state_dict(), config.model)
    hf["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)  # 4 key/value heads, not 2
    with pytest.raises(CheckpointError, match=r"k_proj.weight is \[64, 64\], the config needs \[32, 64\]"):
        from_hf(hf, config.model)
    tied = tiny_config(extra=llama_flags(untie=False))
    with pytest.raises(CheckpointError, match="--untie-embeddings-and-output-weights"):
        from_hf(to_hf(GPTModel(config).state_dict(), config.model), tied.model)
    with pytest.raises(CheckpointError, match="LlamaForCausalLM has no QK-norm.*Qwen3ForCausalLM holds it"):
        mapping(tiny_config(extra=llama_flags() + ["--qk-layernorm"]).model)


def qwen2_model(plain, attention):
    """Qwen2ForCausalLM with the config of our model less its QKV bias (`plain`): Llama's keys Qwen2 shares."""
    shared = {k: v for k, v in hf_config(plain).items()
              if k not in ("pretraining_tp", "mlp_bias", "attention_bias", "head_dim")}
    config = transformers.Qwen2Config.from_dict(dict(shared, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                                                     use_sliding_window=False))
    return transformers.Qwen2ForCausalLM._from_config(config, attn_implementation=attention,
                                                      dtype=torch.float32).eval()


def qwen2_state(dense, m):
    """Our dense state dict -> Qwen2ForCausalLM's: Llama's table, and each layer's fused QKV bias cut into
    q_proj, k_proj and v_proj biases as its weight's rows are (what Qwen2-MoE's table does)."""
    return hf_mapping.to_hf(dense, with_qkv_biases(table(m)), FLAGS)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_hf_qwen2_with_our_qkv_bias_alone_gives_our_logits(attention):
    config = tiny_config(extra=llama_flags(rope_scaling=False) + ["--add-qkv-bias"])
    ours = our_model(config)
    with torch.no_grad():  # the biases start at zero: make them count
        g = torch.Generator().manual_seed(4)
        for layer in ours.layers[1:1 + config.model.num_layers]:
            bias = layer.attention.query_key_value.bias
            bias.copy_(0.5 * torch.randn(bias.shape, generator=g))
    assert not any(name.endswith(".bias") and "query_key_value" not in name for name, _ in ours.named_parameters())
    hf = qwen2_model(tiny_config(extra=llama_flags(rope_scaling=False)).model, attention)
    state = qwen2_state(ours.state_dict(), config.model)
    hf.load_state_dict(state, strict=True)  # every q/k/v bias of Qwen2's, none of o_proj or the MLP

    expected, theirs = logits_of_both(ours, hf, random_tokens())
    assert relative_error(theirs, expected[..., :VOCAB]) <= 1e-5
    hf.load_state_dict({k: torch.zeros_like(t) if k.endswith(".bias") else t for k, t in state.items()})
    _, without_bias = logits_of_both(ours, hf, random_tokens())
    assert relative_error(without_bias, expected[..., :VOCAB]) > 1e-3  # the match above depends on the bias


def test_a_model_with_the_qkv_bias_alone_is_refused_as_llama_and_qwen3_naming_the_flag():
    from megatron_lite.checkpoint import hf_export, hf_qwen3

    qwen2 = tiny_config(extra=llama_flags() + ["--add-qkv-bias"])
    for refused in (lambda: mapping(qwen2.model), lambda: hf_config(qwen2.model),
                    lambda: hf_export.architecture_of(qwen2)):
        with pytest.raises(CheckpointError, match="LlamaForCausalLM has no bias on q_proj, k_proj and v_proj alone "
                                                  r".*built with --add-qkv-bias"):
            refused()
    with pytest.raises(CheckpointError, match="Qwen3ForCausalLM has no bias .*--add-qkv-bias"):
        hf_qwen3.hf_config(tiny_config(extra=llama_flags() + ["--add-qkv-bias", "--qk-layernorm"]).model)
    # With biases everywhere the flag changes nothing: GPT-2's block still exports as GPT2LMHeadModel.
    assert hf_export.architecture_of(tiny_config(extra=["--add-qkv-bias"])).__name__.endswith("hf_gpt2")


def packed_documents(eod, lengths, seed=1):
    """One row of documents of these lengths, each closed by `eod`: (packed tokens [1, s], the documents)."""
    g = torch.Generator().manual_seed(seed)
    documents = [torch.randint(0, eod, (n,), generator=g) for n in lengths]
    for d in documents:
        d[-1] = eod
    return torch.cat(documents)[None], documents


@pytest.mark.parametrize("path", ["mask", "segments"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_packed_micro_batch_with_document_masking_gives_transformers_logits_of_each_document_alone(attention, path,
                                                                                                   monkeypatch):
    from megatron_lite.model import attention_mask
    from tests.model.gpt_layouts import documents_of

    monkeypatch.setattr(attention_mask, "SEGMENTS_PER_TOKEN", 1.0 if path == "segments" else 0.0)
    config = tiny_config(extra=llama_flags() + ["--reset-attention-mask", "--reset-position-ids"])
    ours = our_model(config)
    hf = hf_model(hf_config(config.model), attention)
    load_into_hf(hf, to_hf(ours.state_dict(), config.model))
    eod = VOCAB - 1
    tokens, documents = packed_documents(eod, [9, 3, 14, 6])  # 32 tokens, four documents
    positions, ids = documents_of(config, tokens, eod)
    with torch.no_grad():
        packed = ours(tokens, positions, document_ids=ids)[..., :VOCAB]
        alone = torch.cat([hf(d[None]).logits for d in documents], dim=1)
        unmasked = ours(tokens, torch.arange(SEQ)[None])[..., :VOCAB]
    assert relative_error(alone, packed) <= 1e-5
    assert relative_error(alone, unmasked) > 1e-2  # without the document mask the later documents differ


@pytest.mark.parametrize("window", [4, 7])
def test_a_mistral_sliding_window_gives_transformers_eager_logits_at_four_times_the_window(window):
    from megatron_lite.checkpoint.hf_import import imported_config
    from megatron_lite.checkpoint import hf_llama as module
    from megatron_lite.validation import validate

    seq = 4 * window
    config = tiny_config(extra=llama_flags())
    hf_dict = dict(hf_config(config.model), architectures=["MistralForCausalLM"], model_type="mistral",
                   sliding_window=window, max_position_embeddings=64)
    imported, notes = imported_config(hf_dict, module, 1, 1, None, seq, "config.json",
                                      lambda c: validate(c, 1)[0])
    assert imported.model.window_size == (window - 1, 0), notes
    ours = our_model(imported)
    hf = transformers.MistralForCausalLM._from_config(transformers.MistralConfig.from_dict(hf_dict),
                                                      attn_implementation="eager", dtype=torch.float32).eval()
    load_into_hf(hf, to_hf(ours.state_dict(), imported.model))
    tokens = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ours(tokens, torch.arange(seq).expand(BATCH, seq))[..., :VOCAB]
        theirs = hf(tokens).logits
    assert relative_error(theirs, expected) <= 1e-5
