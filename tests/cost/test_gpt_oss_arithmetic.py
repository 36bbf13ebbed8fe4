"""gpt-oss-120b's and -20b's parameter counts from our arithmetic equal the releases' (116,829,156,672 and
20,914,757,184: what their safetensors hold, MXFP4 experts counted dequantized), sinks, router and expert biases
included; without the sinks or the router bias they would not."""
import dataclasses

import pytest

from megatron_lite.arguments import parse_args
from megatron_lite.cost import arithmetic

GPT_OSS = ("--hidden-size 2880 --num-attention-heads 64 --group-query-attention --num-query-groups 8 --kv-channels 64 "
           "--seq-length 4096 --max-position-embeddings 131072 --vocab-size 201088 --make-vocab-size-divisible-by 1 "
           "--normalization RMSNorm --untie-embeddings-and-output-weights --softmax-type learnable --quick-geglu "
           "--glu-linear-offset 1 --activation-func-clamp-value 7 --window-size 127,0 --window-attn-skip-freq 2 "
           "--position-embedding-type yarn --rotary-base 150000 --rotary-scaling-factor 32 "
           "--yarn-original-max-position-embeddings 4096 --no-yarn-correction-range-round-to-int --moe-router-topk 4 "
           "--moe-ffn-hidden-size 2880 --ffn-hidden-size 2880 --moe-router-score-function softmax "
           "--micro-batch-size 1 --global-batch-size 8").split()


@pytest.mark.parametrize("layers, experts, released", [(36, 128, 116_829_156_672), (24, 32, 20_914_757_184)])
def test_gpt_oss_parameter_counts_equal_the_releases(layers, experts, released):
    config = parse_args(GPT_OSS + ["--num-layers", str(layers), "--num-experts", str(experts)], world_size=1)[0]
    assert arithmetic.total_parameters(config) == released
    # Active per token: all but E - 4 experts per layer, each gate_up [2880, 5760] + its bias and down [2880, 2880] +
    # its bias (the releases' model cards say 5.1B and 3.6B: these less one 201,088 x 2,880 table)
    expert = 2880 * 5760 + 5760 + 2880 * 2880 + 2880
    assert arithmetic.active_parameters(config) == released - (experts - 4) * expert * layers
    vanilla = dataclasses.replace(config, model=dataclasses.replace(config.model, softmax_type="vanilla"))
    assert arithmetic.total_parameters(vanilla) == released - 64 * layers
