"""Which DeepSpeed optimizer runs, decided on purpose (issue 31): `deepspeed_optimizer(config)` names the
one DeepSpeed 0.19 builds for every (precision, ZeRO stage, offload, gradient-accumulation dtype), and
bf16 accumulates and all-reduces its gradients in fp32 by default where DeepSpeed can (ZeRO 1)."""
import pytest

from megatron_lite.arguments import parse_args
from megatron_lite.config import ConfigError
from megatron_lite.deepspeed_config import deepspeed_config, deepspeed_optimizer
from tests.harness import run_distributed

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "64", "--tokenizer-type", "NullTokenizer", "--micro-batch-size", "1",
        "--global-batch-size", "4"]

# (flags beyond TINY, the optimizer class DeepSpeed must build, fp32 gradients)
CASES = [
    ([], "AdamW", False),
    (["--zero-stage", "1"], "DeepSpeedZeroOptimizer", False),
    (["--bf16"], "BF16_Optimizer", False),
    (["--bf16", "--zero-stage", "1"], "BF16_Optimizer", True),
    (["--bf16", "--zero-stage", "1", "--no-accumulate-allreduce-grads-in-fp32"], "DeepSpeedZeroOptimizer", False),
    (["--bf16", "--zero-stage", "2"], "DeepSpeedZeroOptimizer", False),
    (["--bf16", "--zero-stage", "1", "--cpu-offload"], "DeepSpeedZeroOptimizer", False),
    (["--bf16", "--zero-stage", "3"], "DeepSpeedZeroOptimizer_Stage3", False),
    (["--fp16", "--zero-stage", "1"], "DeepSpeedZeroOptimizer", False),
]


def _built_optimizers(cases):
    import torch
    from deepspeed.accelerator import get_accelerator

    from megatron_lite.parallel import state

    # DeepSpeed's CPU accelerator refuses fp16 at initialize; the optimizer choice does not depend on the
    # device (as tests/training/test_fp16_loss_scale.py).
    get_accelerator().is_fp16_supported = lambda: True
    from megatron_lite.training.engine import Engine

    built = []
    for flags, _, _ in cases:
        config = parse_args(TINY + flags, world_size=2)[0]
        state.initialize(config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size)
        engine = Engine(config, with_scheduler=False)
        ds = engine.engine
        accumulators = [t.dtype for t in getattr(ds.optimizer, "fp32_groups_gradients_flat", [])]
        built.append((type(ds.optimizer).__name__, str(ds.communication_data_type),
                      sorted({str(d) for d in accumulators})))
        del engine, ds
        torch.distributed.barrier()
        state.destroy()
    return built


def test_the_named_optimizer_is_the_one_deepspeed_builds_at_every_precision_and_zero_stage():
    built = run_distributed(_built_optimizers, 2, CASES)[0]
    for (flags, expected, fp32_gradients), (name, communication, accumulators) in zip(CASES, built):
        config = parse_args(TINY + flags, world_size=2)[0]
        # "AdamW": DeepSpeed wraps nothing and steps ours (ClippedAdamW where it clips, training/optimizer.py)
        assert deepspeed_optimizer(config) == expected == name.replace("ClippedAdamW", "AdamW"), flags
        assert config.precision.accumulate_allreduce_grads_in_fp32 == fp32_gradients, flags
        if expected == "BF16_Optimizer":
            # its per-micro-batch accumulators, and the dtype the engine all-reduces them in
            want = "torch.float32" if fp32_gradients else "torch.bfloat16"
            assert accumulators == [want] and communication == want, (flags, accumulators, communication)


def test_bf16_at_zero_1_asks_deepspeed_for_fp32_accumulation_and_reduction_by_default():
    on = deepspeed_config(parse_args(TINY + ["--bf16", "--zero-stage", "1"], world_size=2)[0])
    assert on["data_types"] == {"grad_accum_dtype": "fp32"} and on["communication_data_type"] == "fp32"
    off = deepspeed_config(parse_args(TINY + ["--bf16", "--zero-stage", "1",
                                              "--no-accumulate-allreduce-grads-in-fp32"], world_size=2)[0])
    assert "data_types" not in off and "communication_data_type" not in off


@pytest.mark.parametrize("flags, says", [
    (["--accumulate-allreduce-grads-in-fp32"], "applies to --bf16 only"),
    (["--fp16", "--zero-stage", "1", "--accumulate-allreduce-grads-in-fp32"], "applies to --bf16 only"),
    (["--bf16", "--accumulate-allreduce-grads-in-fp32"], "--zero-stage 0 (DeepSpeed 0.19 refuses"),
    (["--bf16", "--zero-stage", "2", "--accumulate-allreduce-grads-in-fp32"], "--zero-stage 2"),
    (["--bf16", "--zero-stage", "1", "--cpu-offload", "--accumulate-allreduce-grads-in-fp32"], "--cpu-offload"),
])
def test_fp32_accumulation_where_deepspeed_cannot_do_it_is_refused_naming_what_would_work(flags, says):
    with pytest.raises(ConfigError, match="accumulate-allreduce-grads-in-fp32") as e:
        parse_args(TINY + flags, world_size=2)
    assert says in str(e.value)
