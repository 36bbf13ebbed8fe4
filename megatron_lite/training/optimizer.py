"""AdamW with Megatron's parameter groups and global-norm clipping, and the learning-rate schedule.

Both are plain torch objects handed to `deepspeed.initialize`, so DeepSpeed
steps and checkpoints them (the schedule is a LambdaLR: its state is the step
count, so a resumed run continues on the same curve).

Clipping: DeepSpeed's fp32 ZeRO-0 path counts a replicated parameter only on
rank 0 of the whole TP x PP group, so with PP > 1 it leaves out every later
stage's LayerNorms and biases; its bf16 ZeRO-0 path does not clip at all. Where
DeepSpeed would hand our optimizer the model's own gradients (ZeRO 0, no fp16
loss scaling), `ClippedAdamW` clips with `global_grad_norm`, which counts each
parameter once over TP and PP, and DeepSpeed's own clipping is switched off.

AdamW runs torch's fused kernel (one pass over each parameter, its gradient and moments) on
CPU and CUDA parameters: on the 2-core CPU it took 2.2 ms per step for the 3.7M-parameter
benchmark GPT against 8.0 ms for torch's default per-operator loop (benchmarks/bench_single_peers.py).
"""
from __future__ import annotations

import math

import torch

from megatron_lite.checkpoint.optimizer_groups import adamw_kwargs, parameter_groups
from megatron_lite.config import OptimizerConfig
from megatron_lite.deepspeed_compat.experts import expert_optimizer_groups
from megatron_lite.parallel.grad_norm import clip_to_global_norm
from megatron_lite.training.muon import Muon


class ClippedAdamW(torch.optim.AdamW):
    """AdamW whose step first scales the gradients so their global norm is at most `clip_grad`."""

    def __init__(self, params, clip_grad: float, **kwargs):
        super().__init__(params, **kwargs)
        self.clip_grad = clip_grad
        self.last_grad_norm = None

    @torch.no_grad()
    def step(self, closure=None):
        self.last_grad_norm = clip_to_global_norm([p for group in self.param_groups for p in group["params"]],
                                                  self.clip_grad)
        return super().step(closure)


FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def build_optimizer(model: torch.nn.Module, opt: OptimizerConfig,
                    clip_in_optimizer: bool = False, experts: bool = False) -> torch.optim.Optimizer:
    """AdamW, or with --optimizer muon our Muon (training/muon.py: AdamW on every group but Muon's).
    experts: the model's expert parameters are marked for DeepSpeed (deepspeed_compat.experts.mark_expert_parameters)
    and go into groups of their own."""
    muon = opt.optimizer == "muon"
    groups = parameter_groups([p for p in model.parameters() if p.requires_grad], opt.weight_decay, muon=muon)
    if experts:  # DeepSpeed's split names its expert groups after ours
        groups = expert_optimizer_groups(
            [dict(g, name=f"group{i}") for i, g in enumerate(groups)])
    fused = all(p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() for g in groups for p in g["params"])
    kwargs = adamw_kwargs(opt, fused)
    if muon:
        return Muon(groups, momentum=opt.muon_momentum, nesterov=opt.muon_nesterov, ns_steps=opt.muon_num_ns_steps,
                    scale_mode=opt.muon_scale_mode, extra_scale=opt.muon_extra_scale_factor,
                    split_qkv=opt.muon_split_qkv, split_gate_up=opt.muon_split_gate_up, tp_mode=opt.muon_tp_mode,
                    precision=opt.muon_fp32_matmul_prec,
                    clip_grad=opt.clip_grad if clip_in_optimizer else 0.0, **kwargs)
    if clip_in_optimizer:
        return ClippedAdamW(groups, clip_grad=opt.clip_grad, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def lr_at(iteration: int, opt: OptimizerConfig) -> float:
    """Linear warmup from 0 to lr, then constant / linear / cosine decay to min_lr at lr_decay_iters."""
    warmup, decay_iters = opt.lr_warmup_iters, opt.lr_decay_iters
    if warmup > 0 and iteration < warmup:
        return opt.lr * (iteration + 1) / warmup
    if opt.lr_decay_style == "constant":
        return opt.lr
    if iteration >= decay_iters:
        return opt.min_lr
    progress = (iteration - warmup) / max(decay_iters - warmup, 1)
    if opt.lr_decay_style == "linear":
        coeff = 1.0 - progress
    else:
        coeff = 0.5 * (math.cos(math.pi * progress) + 1.0)
    return opt.min_lr + coeff * (opt.lr - opt.min_lr)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, opt: OptimizerConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: lr_at(it, opt) / opt.lr)


def continue_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, opt: OptimizerConfig) -> None:
    """After a resume: this run's schedule from the checkpoint's step on. A loaded LambdaLR keeps the step count
    and the checkpoint's base learning rates (its --lr) while its lambda is this run's lr_at / this run's --lr,
    which mixed the two; validation (validation/resume.py schedule_on_resume) has made this run's schedule the
    one to follow (its flags equal the checkpoint's, --override-opt-param-scheduler, or the checkpoint's values
    taken with --use-checkpoint-opt-param-scheduler). The groups' lr is the next step's, as the scheduler sets it."""
    if scheduler is None:
        return
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [opt.lr] * len(groups)
    for group in groups:
        group["initial_lr"] = opt.lr
        group["lr"] = lr_at(scheduler.last_epoch, opt)
    scheduler._last_lr = [group["lr"] for group in groups]
