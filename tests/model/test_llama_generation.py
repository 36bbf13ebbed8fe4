"""Decoding the Llama-family block with a KV cache of query groups gives the logits of recomputing the
whole sequence (fused and SDPA paths alike; with QK-norm, whose keys are cached normalised, and heads wider
than hidden / heads; through a sliding window too)."""
import pytest
import torch

from tests.model.gpt_layouts import tiny_config
from tests.model.test_llama_parallel import LLAMA, QK_HEADS, with_groups


WINDOW = ("--window-size", "5", "--window-attn-skip-freq", "2")  # layers 1 and 3 see 5 tokens back


def assert_cached_decoding_gives_the_recomputed_logits(config):
    """20 tokens decoded 12 then one by one through KV caches give the logits of one pass over all 20; the caches."""
    from megatron_lite.inference.generation import forward_tokens
    from megatron_lite.inference.kv_cache import KVCache
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    model = GPTModel(config).eval()
    model_parallel_seed(config.training.seed, config.model.numbered_layers)
    tokens = torch.randint(0, config.model.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = forward_tokens(model, config, tokens, 0, None)
        caches = [KVCache() for _ in range(config.model.num_layers)]
        first = forward_tokens(model, config, tokens[:, :12], 0, caches)
        rest = [forward_tokens(model, config, tokens[:, i:i + 1], i, caches) for i in range(12, 20)]
    cached = torch.cat([first] + rest, dim=1)
    assert (cached - whole).abs().max() <= 1e-5 * whole.abs().max()
    return caches


@pytest.mark.parametrize("window", [(), WINDOW], ids=["global", "window"])
@pytest.mark.parametrize("groups, heads", [(2, ()), (1, ()), (2, QK_HEADS)], ids=["gqa", "mqa", "qk-norm-wide-heads"])
@pytest.mark.parametrize("backend", ["sdpa", "fused"])
def test_cached_decoding_of_the_llama_block_gives_the_recomputed_logits(groups, heads, backend, window):
    config = tiny_config(extra=with_groups(groups) + heads + ("--attention-backend", backend) + window)
    caches = assert_cached_decoding_gives_the_recomputed_logits(config)
    # the cache holds one key and value per group, not per head
    assert caches[0].keys.shape == (2, groups, 20, config.model.head_dim)
    assert config.model.head_dim == (24 if heads else 16)


def test_llama_flags_parse_as_megatron_lm_names_them():
    config = tiny_config(extra=LLAMA + ("--norm-epsilon", "1e-6"))
    m = config.model
    assert (m.swiglu, m.normalization, m.num_query_groups, m.add_bias_linear, m.use_rope_scaling,
            m.rope_scaling_factor, m.norm_epsilon) == (True, "RMSNorm", 2, False, True, 8.0, 1e-6)
    # --layernorm-epsilon is the older name of the same flag
    assert tiny_config(extra=("--layernorm-epsilon", "1e-6")).model.norm_epsilon == 1e-6
    # without --group-query-attention every head is its own group
    assert tiny_config().model.num_query_groups == tiny_config().model.num_attention_heads


def test_a_windowed_model_decodes_other_logits_than_a_global_one_so_the_window_is_honoured():
    from megatron_lite.inference.generation import forward_tokens
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    tokens = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    logits = {}
    for name, window in (("global", ()), ("window", WINDOW)):
        config = tiny_config(extra=LLAMA + window)
        model_parallel_seed(config.training.seed, config.model.num_layers)
        with torch.no_grad():
            logits[name] = forward_tokens(GPTModel(config).eval(), config, tokens, 0, None)
    same = (logits["global"] - logits["window"]).abs().amax(dim=-1)[0]
    assert same[:6].max() <= 1e-6 and same[6:].min() > 1e-4  # a 5-token window differs from token 6 on
