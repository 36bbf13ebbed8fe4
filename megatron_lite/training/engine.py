"""Model, optimizer and DeepSpeed engine for a validated config, behind one train/eval API.

ZeRO 0/1 (any PP) runs the GPT as a PipelineModule under DeepSpeed's pipeline
engine. ZeRO 2/3 needs PP = 1 (validated in arguments.py) and runs the same
layers as one module under DeepSpeed's ordinary engine, which pulls the
micro-batches itself here.
"""
from __future__ import annotations

from typing import Iterator

import deepspeed
import torch
import torch.distributed as dist

from megatron_lite.config import Config
from megatron_lite.model.gpt import GPTModel, build
from megatron_lite.parallel import state
from megatron_lite.parallel.random import model_parallel_seed
from megatron_lite.training.deepspeed_config import deepspeed_config
from megatron_lite.training.optimizer import build_lr_scheduler, build_optimizer, clips_in_optimizer


class Engine:
    """`train_batch(it)` runs one optimizer step over gas micro-batches; `eval_batch(it)` one batch."""

    def __init__(self, config: Config, with_scheduler: bool = True):
        self.config = config
        # DeepSpeed's communication layer wraps the torch.distributed world we already have.
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
        self.pipelined = config.parallel.zero_stage < 2
        if self.pipelined:
            self.module = build(config, state.get_topology())
            mpu = None  # the pipeline engine reads the topology from the module
        else:
            self.module = GPTModel(config)
            mpu = state.ModelParallelUnit()
        # Initialisation used private seeds; training randomness (dropout) starts from the run seed.
        model_parallel_seed(config.training.seed, config.model.num_layers)
        optimizer = build_optimizer(self.module, config.optimizer, clip_in_optimizer=clips_in_optimizer(config))
        scheduler = build_lr_scheduler(optimizer, config.optimizer) if with_scheduler else None
        self.engine, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
            model=self.module, optimizer=optimizer, lr_scheduler=scheduler, mpu=mpu,
            config=deepspeed_config(config),
        )

    def train_batch(self, data_iter: Iterator) -> float:
        """Loss averaged over micro-batches and DP ranks, on every rank (the pipeline
        engine broadcasts it from the last stage)."""
        if self.pipelined:
            return self.engine.train_batch(data_iter=data_iter).item()
        total = torch.zeros((), device=self.engine.device)
        for _ in range(self.engine.gradient_accumulation_steps()):
            loss = self.engine(*self._next_on_device(data_iter))
            self.engine.backward(loss)
            self.engine.step()
            total += loss.detach().float()
        return self._dp_mean(total / self.engine.gradient_accumulation_steps())

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator) -> float:
        if self.pipelined:
            return self.engine.eval_batch(data_iter=data_iter).item()
        self.engine.eval()
        total = torch.zeros((), device=self.engine.device)
        for _ in range(self.engine.gradient_accumulation_steps()):
            total += self.engine(*self._next_on_device(data_iter)).float()
        self.engine.train()
        return self._dp_mean(total / self.engine.gradient_accumulation_steps())

    def _next_on_device(self, data_iter: Iterator):
        """(tokens, position_ids, labels, loss_mask) of the next micro-batch, where the model is.
        (The pipeline engine moves its micro-batches itself.)"""
        (tokens, position_ids), (labels, loss_mask) = next(data_iter)
        return [t.to(self.engine.device) for t in (tokens, position_ids, labels, loss_mask)]

    def grad_norm(self):
        """Global gradient norm of the last step, where known."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        if getattr(inner, "last_grad_norm", None) is not None:
            return inner.last_grad_norm
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return None
        return float(norm.item() if torch.is_tensor(norm) else norm)

    def _dp_mean(self, loss: torch.Tensor) -> float:
        group = state.get_data_parallel_group()
        loss = loss.to(self.engine.device)
        dist.all_reduce(loss, group=group)
        return loss.item() / dist.get_world_size(group=group)
