"""Multi-head Latent Attention's own rules: the softmax scale takes YaRN's m(s, mscale_all_dim), not mscale
(Megatron-LM #1429); the flags MLA reads are refused without it, and what MLA replaces is refused with it; the
down projections are whole on every TP rank and tagged for the TP sum only under sequence parallelism."""
import math

import pytest

from megatron_lite.config import ConfigError
from megatron_lite.model.rotary import yarn_mscale
from tests.model.gpt_layouts import tiny_config
from tests.model.test_mla_parallel import MLA, without


def test_the_softmax_scale_is_mscale_all_dim_squared_over_the_query_key_width():
    from megatron_lite.model.latent_attention import MultiLatentAttention

    config = tiny_config(extra=MLA)  # s 4, mscale 1, mscale_all_dim 0.8; queries and keys 8 + 4 wide
    attention = MultiLatentAttention(config.model, 1)
    m = 0.1 * 0.8 * math.log(4) + 1
    assert attention.scale == pytest.approx(m * m / math.sqrt(12), rel=1e-12)
    assert attention.scale != pytest.approx(yarn_mscale(4, 1.0) ** 2 / math.sqrt(12))  # #1429's mscale
    plain = MultiLatentAttention(tiny_config(extra=without(MLA, "--mscale-all-dim")).model, 1)
    assert plain.scale == pytest.approx(1 / math.sqrt(12))  # mscale_all_dim 0: no factor on the softmax


@pytest.mark.parametrize("flags, says", [
    (["--kv-lora-rank", "16"], "--kv-lora-rank 16: only Multi-head Latent Attention reads it"),
    (["--q-lora-rank", "8", "--v-head-dim", "4"], "--q-lora-rank 8, --v-head-dim 4: only Multi-head Latent"),
    (["--multi-latent-attention", "--position-embedding-type", "rope", "--kv-channels", "16"],
     "--multi-latent-attention with --kv-channels 16"),
    (["--multi-latent-attention", "--position-embedding-type", "rope", "--add-qkv-bias"], "with --add-qkv-bias"),
    (["--multi-latent-attention", "--position-embedding-type", "rope", "--rotary-percent", "0.5"],
     "with --rotary-percent 0.5"),
    (["--multi-latent-attention"], "--position-embedding-type learned_absolute has none"),
    (["--multi-latent-attention", "--position-embedding-type", "rope", "--qk-pos-emb-head-dim", "5"],
     "use --qk-pos-emb-head-dim 6"),
])
def test_an_mla_flag_without_mla_or_a_flag_mla_replaces_is_refused_naming_it(flags, says):
    with pytest.raises(ConfigError) as refused:
        tiny_config(extra=flags)
    assert says in str(refused.value)


def test_mla_accepts_heads_that_do_not_divide_the_hidden_size_and_widths_of_its_own():
    config = tiny_config(extra=MLA + ("--num-attention-heads", "3"))
    assert (config.model.head_dim, config.model.value_head_dim, config.model.rotary_dim) == (12, 10, 4)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_down_projections_are_whole_and_tagged_for_the_tp_sum_only_under_sequence_parallelism(sequence_parallel):
    from megatron_lite.model.latent_attention import MultiLatentAttention
    from megatron_lite.parallel.layers import has_partial_gradient

    attention = MultiLatentAttention(tiny_config(extra=MLA).model, 1, sequence_parallel)
    for name in ("linear_q_down_proj", "linear_kv_down_proj", "q_layernorm", "kv_layernorm"):
        for p in getattr(attention, name).parameters():
            assert not getattr(p, "tensor_model_parallel", False), name
            assert has_partial_gradient(p) == sequence_parallel, name
    assert attention.linear_kv_up_proj.weight.tensor_model_parallel
