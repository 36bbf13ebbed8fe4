"""The optimizer's parameter groups and the AdamW settings each carries: what a run's optimizer is built with
(training/optimizer.py) and so what its checkpoints hold, which checkpoint/layout.py orders and
checkpoint/reshard.py writes for another layout. They must agree: torch's `load_state_dict` matches groups
by position and replaces the optimizer's group settings (`fused` included) with the loaded ones, so a
resharded checkpoint would otherwise switch a run's kernel or move a parameter into another group."""
from __future__ import annotations

from typing import Iterable, List

import torch

from megatron_lite.config import OptimizerConfig

GROUPS = ("muon", "decay", "no_decay")
"""The groups in optimizer order (an MoE model's expert parameters repeat them after the others)."""


def group_of(dims: int, hidden_matrix: bool, muon: bool) -> str:
    """muon: under --optimizer muon, the transformer layers' weight matrices (parallel/layers.py tags them);
    decay: every other tensor of more than one dimension (AdamW with weight decay); no_decay: biases and norm
    gains, as in Megatron-LM. An MoE layer's stacked expert biases [E, n] are 2-D and decay (Megatron-LM's
    per-expert biases do not: a known difference, docs/model.md)."""
    if muon and hidden_matrix:
        return "muon"
    return "decay" if dims > 1 else "no_decay"


def parameter_groups(params: Iterable[torch.Tensor], weight_decay: float, muon: bool = False) -> List[dict]:
    """The non-empty groups of `params` (parameters, or meta tensors carrying their attributes), in GROUPS
    order; the Muon group is marked 'muon': True (training/muon.py steps it)."""
    members = {name: [] for name in GROUPS}
    for p in params:
        members[group_of(p.dim(), getattr(p, "hidden_matrix", False), muon)].append(p)
    groups = [{"params": members["muon"], "weight_decay": weight_decay, "muon": True},
              {"params": members["decay"], "weight_decay": weight_decay},
              {"params": members["no_decay"], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def adamw_kwargs(opt: OptimizerConfig, fused: bool) -> dict:
    return dict(lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps, fused=fused or None)


def saved_group_settings(opt: OptimizerConfig) -> dict:
    """Every group setting but params, lr and weight_decay, as AdamW has them for CPU or CUDA
    parameters (torch's fused kernel, which training uses on both)."""
    probe = torch.optim.AdamW([torch.zeros(1)], **adamw_kwargs(opt, fused=True))
    return {k: v for k, v in probe.param_groups[0].items() if k not in ("params", "lr", "weight_decay")}
