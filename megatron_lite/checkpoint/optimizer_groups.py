"""The AdamW settings a run's optimizer is built with, and so the ones each of its groups carries in a
checkpoint. training/optimizer.py builds AdamW from them; reshard writes the groups a run would have
saved. They must agree: torch's `load_state_dict` replaces the optimizer's group settings (`fused`
included) with the loaded ones, so a resharded checkpoint would otherwise switch a run's kernel."""
from __future__ import annotations

import torch

from megatron_lite.config import OptimizerConfig


def adamw_kwargs(opt: OptimizerConfig, fused: bool) -> dict:
    return dict(lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps, fused=fused or None)


def saved_group_settings(opt: OptimizerConfig) -> dict:
    """Every group setting but params, lr and weight_decay, as AdamW has them for CPU or CUDA
    parameters (torch's fused kernel, which training uses on both)."""
    probe = torch.optim.AdamW([torch.zeros(1)], **adamw_kwargs(opt, fused=True))
    return {k: v for k, v in probe.param_groups[0].items() if k not in ("params", "lr", "weight_decay")}
