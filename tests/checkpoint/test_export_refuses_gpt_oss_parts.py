"""An export to an architecture without gpt-oss's sinks, clamped offset quick-GeGLU or a gated MLP is refused by
name, before anything is written: before these checks a --swiglu or --quick-geglu model went to GPT2LMHeadModel's
table and a Llama-block model with sinks or a clamp exported as LlamaForCausalLM without them."""
import pytest

from megatron_lite.checkpoint import hf_gpt2, hf_llama
from megatron_lite.checkpoint.format import CheckpointError
from tests.model.gpt_layouts import tiny_config

LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "rope"]


@pytest.mark.parametrize("extra, says", [
    (["--softmax-type", "learnable"], "--softmax-type learnable"),
    (["--softmax-type", "off-by-one"], "--softmax-type off-by-one"),
    (["--activation-func-clamp-value", "7"], "--activation-func-clamp-value 7.0"),
    (["--glu-linear-offset", "1"], "--glu-linear-offset 1"),
])
def test_a_llama_block_model_with_a_gpt_oss_part_is_refused_as_llama(extra, says):
    with pytest.raises(CheckpointError, match="LlamaForCausalLM has no place for " + says):
        hf_llama.check_llama(tiny_config(extra=LLAMA + extra).model)


@pytest.mark.parametrize("extra, says", [(["--quick-geglu"], "no place for --quick-geglu"),
                                         (["--swiglu"], "MLP is gated"),
                                         (["--softmax-type", "learnable"], "no place for --softmax-type")])
def test_a_gated_or_sinked_model_is_refused_as_gpt2(extra, says):
    with pytest.raises(CheckpointError, match=says):
        hf_gpt2.check_gpt2(tiny_config(extra=extra).model)
