"""Model, optimizer and DeepSpeed engine for a validated config, behind one small protocol.

    train_step(data_iter) -> StepStats     one optimizer step over gas micro-batches
    eval_step(data_iter) -> float          mean loss of one global batch, no update
    set_global_batch_size(n)               batch ramp-up
    save(directory, tag) / load(directory, tag) / load_weights(directory, tag)
    device

ZeRO 0/1 (any PP) runs the GPT as a PipelineModule under DeepSpeed's pipeline
engine. ZeRO 2/3 needs PP = 1 (validation refuses the rest) and runs the same
layers as one module under DeepSpeed's ordinary engine, which pulls the
micro-batches itself here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional

import deepspeed
import torch
import torch.distributed as dist

from megatron_lite.checkpoint.engine_io import EngineIO
from megatron_lite.config import Config
from megatron_lite.deepspeed_compat import optimizer_state, pipeline, step_guard
from megatron_lite.deepspeed_compat.experts import (engine_finds_experts, expert_norm_groups_on_every_stage,
                                                    experts_only_in_gradient_reduction, mark_expert_parameters,
                                                    register_expert_groups)
from megatron_lite.deepspeed_config import clips_in_optimizer, deepspeed_config
from megatron_lite.model import aux_loss, mtp
from megatron_lite.model.compile import CompileCounter, compile_layers
from megatron_lite.model.gpt import GPTModel
from megatron_lite.model.moe import GroupedExperts, MoELayer
from megatron_lite.parallel import state
from megatron_lite.parallel.experts import ep_world_size, gather_experts
from megatron_lite.parallel.random import model_parallel_seed
from megatron_lite.parallel.sequence_parallel import all_reduce_gradients_over_tp, partial_gradient_parameters
from megatron_lite.training.expert_balance import update_expert_biases
from megatron_lite.training.model_setup import build_pipeline
from megatron_lite.training.muon import Muon
from megatron_lite.training.numerical_guard import NumericalGuard, coordinates
from megatron_lite.training.rerun import RerunStateMachine
from megatron_lite.training import progress
from megatron_lite.training.optimizer import build_lr_scheduler, build_optimizer


@dataclass(frozen=True)
class StepStats:
    loss: float
    """Mean loss over the step's micro-batches and DP ranks (the same on every rank)."""
    lr: float
    """Learning rate the step used."""
    grad_norm: Optional[float]
    """Global gradient norm before clipping, where known."""
    loss_scale: Optional[float]
    """fp16 loss scale after the step; None without loss scaling."""
    skipped: bool
    """The optimizer skipped this step (fp16 overflow)."""
    mtp_losses: Optional[List[float]] = None
    """With --mtp-num-layers: each depth's loss, averaged as the loss is (the same on every rank)."""


class Engine:
    def __init__(self, config: Config, with_scheduler: bool = True):
        self.config = config
        # DeepSpeed's communication layer wraps the torch.distributed world we already have.
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
        self.pipelined = config.parallel.zero_stage < 2
        if self.pipelined:
            self.module = build_pipeline(config)
            mpu = None  # the pipeline engine reads the topology from the module
        else:
            self.module = GPTModel(config)
            mpu = state.ModelParallelUnit()
        self.compile_counter = None
        if config.model.compile:  # each transformer layer on its own; counted from here (model/compile.py)
            self.compile_counter = CompileCounter()
            compile_layers(self.module, config.model.compile_backend)
        # Initialisation used private seeds; training randomness (dropout) starts from the run seed.
        model_parallel_seed(config.training.seed, config.model.numbered_layers)
        self.experts = config.model.num_experts is not None
        if self.experts:  # expert parameters are reduced over expert-DP (deepspeed_compat.experts says how)
            register_expert_groups(
                state.get_expert_model_parallel_group(), state.get_expert_model_parallel_ranks(),
                state.get_expert_data_parallel_group(), state.get_expert_data_parallel_ranks())
            mark_expert_parameters(self.module.parameters())
        optimizer = build_optimizer(self.module, config.optimizer, clip_in_optimizer=clips_in_optimizer(config),
                                    experts=self.experts)
        progress.mark_optimizer_steps(optimizer)
        scheduler = build_lr_scheduler(optimizer, config.optimizer) if with_scheduler else None
        with engine_finds_experts(MoELayer):
            self.engine, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
                model=self.module, optimizer=optimizer, lr_scheduler=scheduler, mpu=mpu,
                config=deepspeed_config(config),
            )
        inner = optimizer_state.inner_optimizer(self.optimizer)
        if isinstance(inner, Muon):  # whole matrices out of DeepSpeed's flat partitions (training/muon.py)
            inner.use_partitions(optimizer_state.optimizer_partitions(self.optimizer))
        if self.experts:
            experts_only_in_gradient_reduction(self.engine)
            # A stage without MoE layers has fewer optimizer groups (deepspeed_compat.experts says why).
            if self.pipelined:
                expert_norm_groups_on_every_stage(self.engine)
        # Checkpoint files are read without executing code and written without tearing a save (engine_io.py).
        self.io = EngineIO()
        self.io.install(self.engine)
        if (self.pipelined and config.parallel.zero_stage == 0
                and config.parallel.data_parallel_size * config.parallel.context_parallel_size == 1):
            pipeline.skip_gradient_all_reduce(self.engine)
        if self.pipelined:
            # The last stage's logits are not needed once their backward ran (deepspeed_compat.pipeline says why).
            pipeline.free_last_stage_outputs_after_backward(self.engine)
            if config.parallel.tensor_model_parallel_size > 1 and partial_gradient_parameters(self.module):
                self._sum_partial_gradients_before_reduction()
            if self.experts:
                # Once per global batch, from its token counts: the expert bias (training/expert_balance.py).
                pipeline.before_gradient_reduction(
                    self.engine, lambda: update_expert_biases(self.module, config.parallel.sequence_parallel))
        self.install_guard()

    def install_guard(self, config: Optional[Config] = None) -> None:
        """The numerical guard (training/numerical_guard.py), as config (default: the engine's) says; __init__
        installs it, and benchmarks/bench_straggler_overhead.py again on an engine built with it off, so that
        one engine runs with and without it. Under the pipeline engine it checks before any
        reduction, this hook registered last so that it runs first; at ZeRO 2/3 _train_batch calls it before
        the last micro-batch's step, on the loss only (validation/numerical_guard.py says why). Gradients are
        not checked under --fp16, whose loss scaler skips overflowing steps itself. --rerun-mode replays a step
        under the pipeline engine only (training/rerun.py); report_stats needs the hooks with no check on."""
        if config is not None:
            self.config = config
        config, engine = self.config, self.engine
        self.guard = guard = NumericalGuard(config.numerical_guard, self.pipelined and not config.precision.fp16,
                                            coordinates(), self.device)
        mode = config.numerical_guard.rerun_mode
        self.rerun = None
        if not (self.pipelined and (guard.active or mode == "report_stats")):
            return
        if mode != "disabled":
            self.rerun = RerunStateMachine(config.numerical_guard, guard, engine, config.logging.log_interval,
                                           config.training.train_iters)
        local_gradients = step_guard.LocalGradients(engine)
        # guard.measure and guard.decide looked up at each call: the overhead benchmark times them in place.
        step_guard.check_before_gradient_reduction(engine, lambda: guard.measure(
            step_guard.local_loss_sum(engine), engine.gradient_accumulation_steps(), local_gradients()))
        step_guard.skip_optimizer_step_when(engine, lambda: guard.decide())
        if guard.injector.corrupts_loss:
            step_guard.wrap_loss_function(
                engine, lambda loss: guard.injector.loss(loss, guard.iteration) if self.module.training else loss)

    def _sum_partial_gradients_before_reduction(self) -> None:
        """Once per step, before DeepSpeed reduces gradients: the LayerNorm and row-parallel bias gradients,
        each rank's over its own sequence shard, and the QK-norm gradients, each rank's over its own heads,
        summed over TP (parallel/sequence_parallel.py)."""
        params = partial_gradient_parameters(self.module)
        engine = self.engine

        def reduce():
            all_reduce_gradients_over_tp([pipeline.accumulated_gradient(engine, p) for p in params])

        pipeline.before_gradient_reduction(engine, reduce)

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def train_step(self, data_iter: Iterator, iteration: Optional[int] = None) -> StepStats:
        """iteration: the step's number from 1 (the loop's, resumes included); by default the previous + 1."""
        self.guard.iteration = self.guard.iteration + 1 if iteration is None else iteration
        lr = self.optimizer.param_groups[0]["lr"]
        if self.experts:  # the router losses' gradients go through what the loss's gradient goes through
            aux_loss.set_scale((optimizer_state.loss_scale(self.optimizer) or 1.0)
                               * self.config.parallel.context_parallel_size
                               / self.engine.gradient_accumulation_steps())
        skipped_before = optimizer_state.skipped_steps(self.engine)
        mtp.take_losses()  # what evaluation recorded
        def train_batch(data):
            return self._train_batch(progress.data_phases(data))  # the watchdog sees data waits as such

        loss = self.rerun.train_step(data_iter, train_batch) if self.rerun else train_batch(data_iter)
        return StepStats(
            loss=loss, lr=lr, grad_norm=self._grad_norm(),
            loss_scale=optimizer_state.loss_scale(self.optimizer) if self.config.precision.fp16 else None,
            skipped=optimizer_state.skipped_steps(self.engine) > skipped_before,
            mtp_losses=self._mtp_losses() if self.config.model.mtp_num_layers else None,
        )

    def _mtp_losses(self) -> List[float]:
        """The depths' losses of this step, averaged over micro-batches and the last stage's ranks, as DeepSpeed
        averages the loss (a CP rank records its share, C x its part of the mean: data/context_parallel.py; TP ranks
        record the same). A collective of D + 1 numbers over every rank: the other stages add zeros and no count."""
        recorded = mtp.take_losses()
        depths = self.config.model.mtp_num_layers
        mine = torch.zeros(depths + 1, dtype=torch.float64, device=self.device)
        if recorded:
            mine[:depths] = torch.tensor(recorded, dtype=torch.float64).mean(dim=0).to(self.device)
            mine[depths] = 1.0
        dist.all_reduce(mine)
        return (mine[:depths] / mine[depths]).tolist()

    def _train_batch(self, data_iter: Iterator) -> float:
        """Loss averaged over micro-batches and DP ranks, on every rank (the pipeline
        engine broadcasts it from the last stage)."""
        if self.pipelined:
            return self.engine.train_batch(data_iter=data_iter).item()
        total = torch.zeros((), device=self.device)
        micro_batches = self.engine.gradient_accumulation_steps()
        for micro_batch in range(micro_batches):
            loss = self.guard.injector.loss(self.engine(*self._next_on_device(data_iter)), self.guard.iteration)
            self.engine.backward(loss)
            total += loss.detach().float()
            if micro_batch == micro_batches - 1 and self.guard.active:  # before the step: raises, or lets it be
                self.guard.check(total, micro_batches, [])
            self.engine.step()
        return self._dp_mean(total / self.engine.gradient_accumulation_steps())

    @torch.no_grad()
    def eval_step(self, data_iter: Iterator) -> float:
        if self.pipelined:
            return self.engine.eval_batch(data_iter=data_iter).item()
        self.engine.eval()
        total = torch.zeros((), device=self.device)
        for _ in range(self.engine.gradient_accumulation_steps()):
            total += self.engine(*self._next_on_device(data_iter)).float()
        self.engine.train()
        return self._dp_mean(total / self.engine.gradient_accumulation_steps())

    def set_global_batch_size(self, global_batch_size: int) -> None:
        """Batch ramp-up: DeepSpeed derives the new gas from it (micro batch and DP stay). DeepSpeed counts
        a sample once per CP rank (deepspeed_config.py)."""
        deepspeed_batch = global_batch_size * self.config.parallel.context_parallel_size
        if deepspeed_batch != self.engine.train_batch_size():
            self.engine.set_train_batch_size(deepspeed_batch)

    def save(self, directory: str, tag: str) -> None:
        experts = [m for m in self.module.modules() if isinstance(m, GroupedExperts)] if ep_world_size() > 1 else []
        # Layer files hold every expert (DeepSpeed writes them from DP rank 0 only, which holds 1/EP of them).
        for module in experts:
            module.whole = {name: gather_experts(p.detach()) for name, p in module.named_parameters(recurse=False)}
        try:
            self.engine.save_checkpoint(directory, tag=tag, save_latest=False)
        finally:
            for module in experts:
                module.whole = None

    def load(self, directory: str, tag: str, load_optimizer_states: bool = True) -> Optional[str]:
        """Model, optimizer and LR-scheduler states; the path loaded, or None when DeepSpeed found nothing."""
        path, _ = self.engine.load_checkpoint(directory, tag=tag, load_optimizer_states=load_optimizer_states,
                                              load_lr_scheduler_states=True)
        return path

    def load_weights(self, directory: str, tag: str) -> Optional[str]:
        """The model's weights only (evaluation, generation); None when DeepSpeed found nothing."""
        path, _ = self.engine.load_checkpoint(directory, tag=tag, load_module_only=True, load_optimizer_states=False,
                                              load_lr_scheduler_states=False)
        return path

    def _next_on_device(self, data_iter: Iterator):
        """(tokens, position_ids, labels, loss_mask[, document_ids][, Multi-Token Prediction's arrays]) of the
        next micro-batch, where the model is: GPTModel.forward's arguments. (The pipeline engine moves its
        micro-batches itself.)"""
        (tokens, position_ids, *rest), (labels, loss_mask, *mtp_targets) = next(data_iter)
        documents = rest[:len(rest) - bool(mtp_targets)]
        args = [t.to(self.device) for t in (tokens, position_ids, labels, loss_mask, *documents)]
        if mtp_targets:
            args += [None] * (5 - len(args)) + [tuple(t.to(self.device) for t in (rest[-1], *mtp_targets))]
        return args

    def _grad_norm(self) -> Optional[float]:
        inner = optimizer_state.inner_optimizer(self.optimizer)
        if getattr(inner, "last_grad_norm", None) is not None:
            return inner.last_grad_norm
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return None
        return float(norm.item() if torch.is_tensor(norm) else norm)

    def _dp_mean(self, loss: torch.Tensor) -> float:
        # Over DP x CP, as the pipeline engine does: a CP rank's loss is C x its share (data/context_parallel.py).
        group = state.get_data_parallel_group(with_context_parallel=True)
        loss = loss.to(self.device)
        dist.all_reduce(loss, group=group)
        return loss.item() / dist.get_world_size(group=group)
