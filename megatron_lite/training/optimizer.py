"""AdamW with Megatron's parameter groups, and the learning-rate schedule.

Both are plain torch objects handed to `deepspeed.initialize`, so DeepSpeed
steps and checkpoints them (the schedule is a LambdaLR: its state is the step
count, so a resumed run continues on the same curve).
"""
from __future__ import annotations

import math
from typing import Iterable, List

import torch

from megatron_lite.config import OptimizerConfig


def parameter_groups(named_parameters: Iterable, weight_decay: float) -> List[dict]:
    """Biases and norm gains (every 1-D parameter) get no weight decay, as in Megatron-LM."""
    decay, no_decay = [], []
    for _, p in named_parameters:
        if not p.requires_grad:
            continue
        (no_decay if p.dim() == 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, opt: OptimizerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameter_groups(model.named_parameters(), opt.weight_decay), lr=opt.lr,
                             betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps)


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
