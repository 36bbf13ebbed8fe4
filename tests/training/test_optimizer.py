import math

import pytest
import torch

from megatron_lite.config import OptimizerConfig
from megatron_lite.checkpoint.optimizer_groups import parameter_groups
from megatron_lite.training.optimizer import ClippedAdamW, build_lr_scheduler, build_optimizer, lr_at


def test_biases_and_norms_get_no_weight_decay():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2, bias=False))
    groups = parameter_groups(model.parameters(), 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert decayed == {id(model[0].weight), id(model[2].weight)}
    assert {id(p) for p in groups[1]["params"]} == {id(model[0].bias), id(model[1].weight), id(model[1].bias)}


@pytest.mark.parametrize("style, it, expected", [
    ("cosine", 0, 0.1), ("cosine", 9, 1.0), ("cosine", 10, 1.0), ("cosine", 55, 0.55), ("cosine", 100, 0.1),
    ("cosine", 150, 0.1), ("linear", 55, 0.55), ("linear", 32.5, 0.775), ("constant", 80, 1.0),
])
def test_lr_schedule_warmup_then_decay_to_min_lr(style, it, expected):
    opt = OptimizerConfig(lr=1.0, min_lr=0.1, lr_decay_style=style, lr_warmup_iters=10, lr_decay_iters=100)
    assert lr_at(it, opt) == pytest.approx(expected)


def test_cosine_midpoint_is_halfway_between_lr_and_min_lr():
    opt = OptimizerConfig(lr=2.0, min_lr=0.0, lr_decay_style="cosine", lr_warmup_iters=0, lr_decay_iters=10)
    assert lr_at(5, opt) == pytest.approx(1.0)
    assert lr_at(2, opt) == pytest.approx(1.0 + math.cos(math.pi * 0.2))


def test_scheduler_state_resumes_the_same_curve():
    opt = OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_iters=3, lr_decay_iters=20)
    model = torch.nn.Linear(2, 2)

    def run(steps, state=None):
        optim = build_optimizer(model, opt)
        sched = build_lr_scheduler(optim, opt)
        if state:  # what a checkpoint restores: optimizer and scheduler together
            optim.load_state_dict(state[0])
            sched.load_state_dict(state[1])
        lrs = []
        for _ in range(steps):
            lrs.append(optim.param_groups[0]["lr"])
            optim.step()
            sched.step()
        return lrs, (optim.state_dict(), sched.state_dict())

    straight, _ = run(10)
    first, state = run(5)
    second, _ = run(5, state)
    assert first + second == pytest.approx(straight)
    assert straight[0] == pytest.approx(lr_at(0, opt))


def _two_equal_models():
    """Two copies of one small model (seed 0): one for the reference optimizer, one for ours."""
    torch.manual_seed(0)
    first = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    second = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    second.load_state_dict(first.state_dict())
    return first, second


def test_clipped_adamw_equals_clip_grad_norm_then_adamw():
    ref, ours = _two_equal_models()
    opt = OptimizerConfig(lr=1e-2, clip_grad=0.05)
    ref_optim = build_optimizer(ref, opt)
    our_optim = build_optimizer(ours, opt, clip_in_optimizer=True)
    assert isinstance(our_optim, ClippedAdamW)
    x = torch.randn(16, 8)
    for _ in range(3):
        for model in (ref, ours):
            model.zero_grad()
            model(x).pow(2).sum().backward()
        expected_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), opt.clip_grad)
        ref_optim.step()
        our_optim.step()
        assert our_optim.last_grad_norm == pytest.approx(expected_norm.item(), rel=1e-6)
        assert expected_norm > opt.clip_grad  # clipping is active in this test
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_adamw_runs_torchs_fused_kernel_with_the_default_kernels_update():
    model, reference = _two_equal_models()
    opt = OptimizerConfig(lr=1e-2, weight_decay=0.1)
    ours = build_optimizer(model, opt)
    theirs = torch.optim.AdamW(parameter_groups(reference.parameters(), 0.1), lr=1e-2, foreach=False)
    assert all(group["fused"] for group in ours.param_groups)
    x = torch.randn(16, 8)
    for _ in range(5):
        for m, o in ((model, ours), (reference, theirs)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
