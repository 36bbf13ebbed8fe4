"""fp16 with dynamic loss scaling through the engine: the scale is reported, overflows skip steps.

DeepSpeed's CPU accelerator refuses fp16 unless the CPU has fp16 kernels (mkldnn); this
machine has none, so the test overrides that one capability flag and runs the real fp16
optimizer path on CPU. Training itself refuses --fp16 on such a device before any process
group exists (tests/test_pretrain_gpt_cli.py).
"""
import math

import pytest

from tests.harness import run_distributed
from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config


def _train_fp16(pp, zero, steps, initial_scale):
    from deepspeed.accelerator import get_accelerator

    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine

    get_accelerator().is_fp16_supported = lambda: True  # see the module docstring
    config = tiny_config(1, pp, 1, ("--fp16", "--zero-stage", str(zero), "--initial-loss-scale", str(initial_scale),
                                    "--loss-scale-window", "1000", "--hysteresis", "1"))
    state.initialize(1, pp)
    engine = Engine(config, with_scheduler=False)
    data = micro_batches(config, global_batches(config, steps), state.get_data_parallel_rank(), 1)
    return [engine.train_step(data) for _ in range(steps)]


@pytest.mark.slow
def test_fp16_reports_its_loss_scale_skips_overflowing_steps_and_trains_on():
    stats = run_distributed(_train_fp16, 2, 2, 1, 6, 2.0 ** 20)[0]
    scales = [s.loss_scale for s in stats]
    skipped = [s.skipped for s in stats]
    # 2^20 overflows this model's fp16 gradients (2^17 does not): the first steps are skipped and the
    # scale halves each time, until a scale fits and the steps apply.
    assert skipped[0] and scales[0] == 2.0 ** 19
    first_applied = skipped.index(False)
    assert scales[:first_applied] == [2.0 ** (19 - i) for i in range(first_applied)]
    assert not any(skipped[first_applied:]) and len(set(scales[first_applied - 1:])) == 1
    assert all(math.isfinite(s.loss) for s in stats[first_applied:])


def _parameter_change_after_one_fp16_step_at_zero0():
    import torch

    from megatron_lite.training.engine import Engine

    from deepspeed.accelerator import get_accelerator

    from megatron_lite.parallel import state

    get_accelerator().is_fp16_supported = lambda: True
    changes = []
    for precision in (("--zero-stage", "1"), ("--fp16", "--zero-stage", "1")):
        # Validation refuses fp16 at ZeRO 0 (that is the point): build at ZeRO 1, then step around it.
        config = tiny_config(1, 1, 1, precision).replace(parallel__zero_stage=0)
        state.initialize(1, 1)
        engine = Engine(config, with_scheduler=False)
        weight = next(engine.module.parameters())
        before = weight.detach().float().clone()
        engine.train_step(micro_batches(config, global_batches(config, 1), 0, 1))
        changes.append(float((weight.detach().float() - before).abs().max()))
        state.destroy()
        torch.manual_seed(0)
    return changes


def test_deepspeed_fp16_at_zero0_does_not_scale_the_loss_which_is_why_validation_refuses_it():
    """DeepSpeed 0.19's engine.backward scales the loss only for ZeRO optimizers; its ZeRO-0 fp16
    optimizer still unscales the gradients in step(), so they come out loss-scale times too small
    and, at the default initial scale 2^32, Adam's epsilon swamps them. When this fails, DeepSpeed fixed it: lift the precision rule."""
    fp32_change, fp16_change = run_distributed(_parameter_change_after_one_fp16_step_at_zero0, 1)[0]
    assert fp16_change < fp32_change / 100


def test_loss_scale_appears_in_the_log_line_and_tensorboard_scalars():
    from megatron_lite.training.metrics import IntervalStats, format_line, interval_scalars

    config = tiny_config(extra=("--fp16", "--zero-stage", "1"))
    stats = IntervalStats(iteration=3, consumed_samples=12, loss=5.0, lr=1e-3, grad_norm=0.5, loss_scale=65536.0,
                          skipped_steps=2, seconds=1.0, iterations=3, samples=12, global_batch_size=4)
    scalars = interval_scalars(stats, config.model, 1)
    assert scalars["loss_scale"] == 65536.0 and scalars["skipped_steps"] == 2
    line = format_line(3, 10, scalars)
    assert "loss scale 65536" in line and "skipped 2" in line
