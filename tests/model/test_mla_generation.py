"""Decoding Multi-head Latent Attention with a KV cache gives the logits of recomputing the whole sequence (both
backends, through a sliding window too; with Multi-Token Prediction's depths, which generation leaves out); the
cache holds every head's key (rotary part turned) and value."""
import pytest

from tests.model.gpt_layouts import tiny_config
from tests.model.test_llama_generation import WINDOW, assert_cached_decoding_gives_the_recomputed_logits
from tests.model.test_mla_parallel import MLA, without


@pytest.mark.parametrize("window", [(), WINDOW], ids=["global", "window"])
@pytest.mark.parametrize("query", ["latent", "plain", "latent-with-mtp"])
@pytest.mark.parametrize("backend", ["sdpa", "fused"])
def test_cached_decoding_of_mla_gives_the_recomputed_logits(backend, query, window):
    flags = without(MLA, "--q-lora-rank") if query == "plain" else MLA
    flags += ("--mtp-num-layers", "2") if query.endswith("mtp") else ()
    caches = assert_cached_decoding_gives_the_recomputed_logits(
        tiny_config(extra=flags + ("--attention-backend", backend) + window))
    assert caches[0].keys.shape == (2, 4, 20, 8 + 4) and caches[0].values.shape == (2, 4, 20, 10)
