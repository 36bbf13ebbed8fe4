"""pretrain(): distributed init, model and engine, data, the step loop, evaluation, checkpoints.

Every rank runs the same loop; decisions that must agree (stop on a signal,
stop on a non-finite loss) are all-reduced once per step so no rank leaves a
collective behind.
"""
from __future__ import annotations

import math
import signal
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_lite.arguments import is_rank_zero_from_environment
from megatron_lite.batching import global_batch_size_at
from megatron_lite.config import Config, ConfigError, pad_vocab_size, vocab_padding_note
from megatron_lite.data.gpt_dataset import build_train_valid_test_datasets
from megatron_lite.data.sampler import build_data_iterator
from megatron_lite.data.tokenizer import build_tokenizer
from megatron_lite.parallel import state
from megatron_lite.training import checkpointing
from megatron_lite.training.distributed import init_distributed
from megatron_lite.training.engine import Engine
from megatron_lite.training.metrics import IntervalStats, TensorBoardWriter, format_line, interval_scalars


def print_rank0(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


class ExitSignal:
    """SIGTERM / SIGUSR1 (what Slurm sends before a time limit) -> save at the next step boundary."""

    def __init__(self, enabled: bool):
        self.received = False
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.received = True


def with_vocabulary(config: Config, tokenizer) -> Config:
    """Fill the vocabulary size from the tokenizer and pad it for TP (logged on rank 0).
    With --vocab-size, arguments.py has already done both."""
    if config.model.padded_vocab_size is not None:
        return config
    model, tp = config.model, config.parallel.tensor_model_parallel_size
    vocab = tokenizer.vocab_size
    note = vocab_padding_note(vocab, model.make_vocab_size_divisible_by, tp)
    if note:
        print_rank0(note)
    return config.replace(model__vocab_size=vocab,
                          model__padded_vocab_size=pad_vocab_size(vocab, model.make_vocab_size_divisible_by, tp))


def _agree(flags, device) -> list:
    """Element-wise max over all ranks of a few booleans."""
    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def evaluate(engine: Engine, dataset, config: Config) -> Optional[float]:
    """Mean validation loss over --eval-iters batches, always the same first batches of the split,
    so evaluations at different iterations (and after a resume) are comparable."""
    if dataset is None or config.training.eval_iters == 0:
        return None
    it = build_data_iterator(dataset, 0, config.batch.micro_batch_size, state.get_data_parallel_rank(),
                             config.parallel.data_parallel_size, num_workers=0)
    losses = [engine.eval_batch(it) for _ in range(config.training.eval_iters)]
    return sum(losses) / len(losses)


def pretrain(config: Config) -> int:
    """Train as the config says; returns the process exit code."""
    init_distributed(config.parallel.distributed_backend)
    state.initialize(config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size)
    tokenizer = build_tokenizer(config.data.tokenizer_type, config.data.tokenizer_model, config.model.vocab_size)
    config = with_vocabulary(config, tokenizer)

    engine = Engine(config)
    iteration, consumed = 0, 0
    if config.training.load:
        iteration, consumed = checkpointing.load(engine.engine, config)
        if iteration:
            print_rank0(f"resumed from {config.training.load} at iteration {iteration}, {consumed} consumed samples")

    gbs = config.batch.global_batch_size
    try:
        train_ds, valid_ds, _ = build_train_valid_test_datasets(
            config.data.data_path, config.data.split, config.model.seq_length,
            (config.training.train_iters * gbs, config.training.eval_iters * gbs, config.training.eval_iters * gbs),
            config.training.seed, config.data.data_cache_path, tokenizer.eod, config.data.eod_mask_loss,
        )
    except ValueError as e:  # the data modules name the flag or file and the fix
        raise ConfigError(str(e)) from None
    if train_ds is None:
        raise ConfigError(f"--split {config.data.split} leaves no training documents; give the first weight a "
                          f"positive share, e.g. --split 969,30,1")
    train_iter = build_data_iterator(train_ds, consumed, config.batch.micro_batch_size,
                                     state.get_data_parallel_rank(), config.parallel.data_parallel_size,
                                     num_workers=config.data.num_workers)
    tb = TensorBoardWriter(config.logging.tensorboard_dir if dist.get_rank() == 0 else None)
    exit_signal = ExitSignal(config.training.exit_signal_handler)
    device = engine.engine.device
    log_interval, train_iters = config.logging.log_interval, config.training.train_iters

    interval_start, interval_iters, interval_samples, interval_loss = time.time(), 0, 0, 0.0
    last_saved = iteration if config.training.load else None
    exit_code = 0
    while iteration < train_iters:
        step_batch = global_batch_size_at(config.batch, consumed)
        if step_batch != engine.engine.train_batch_size():
            engine.engine.set_train_batch_size(step_batch)
        loss = engine.train_batch(train_iter)
        iteration += 1
        consumed += step_batch
        interval_iters += 1
        interval_samples += step_batch
        interval_loss += loss

        stop_signal, nonfinite = _agree([exit_signal.received, not math.isfinite(loss)], device)
        if nonfinite and not config.precision.fp16:
            print_rank0(f"error: loss is {loss} at iteration {iteration}; stopping. The last good checkpoint "
                        f"({checkpointing.latest_tag(config.training.save) if config.training.save else 'none'}) "
                        f"is kept; lower --lr or raise --lr-warmup-iters, or check the data.")
            exit_code = 1
            break

        if iteration % log_interval == 0 or iteration == train_iters:
            seconds = time.time() - interval_start
            ds = engine.engine
            stats = IntervalStats(
                iteration=iteration, consumed_samples=consumed, loss=interval_loss / interval_iters,
                lr=ds.optimizer.param_groups[0]["lr"], grad_norm=engine.grad_norm(),
                loss_scale=getattr(ds.optimizer, "cur_scale", None) if config.precision.fp16 else None,
                skipped_steps=int(getattr(ds, "skipped_steps", 0)), seconds=seconds,
                iterations=interval_iters, samples=interval_samples,
            )
            scalars = interval_scalars(stats, config.model, config.parallel.world_size)
            print_rank0(format_line(iteration, train_iters, scalars))
            tb.write("train", scalars, iteration)
            interval_start, interval_iters, interval_samples, interval_loss = time.time(), 0, 0, 0.0

        if config.training.eval_interval and iteration % config.training.eval_interval == 0:
            _log_eval(engine, valid_ds, config, iteration, tb)

        exit_now = bool(config.training.exit_interval) and iteration % config.training.exit_interval == 0
        interval_save = bool(config.training.save_interval) and iteration % config.training.save_interval == 0
        if config.training.save and (interval_save or stop_signal or exit_now):
            _save(engine, config, iteration, consumed)
            last_saved = iteration
        if stop_signal:
            print_rank0(f"exit signal received: stopped after iteration {iteration}")
            break
        if exit_now:
            print_rank0(f"--exit-interval {config.training.exit_interval}: stopping at iteration {iteration}")
            break

    if exit_code == 0 and iteration == train_iters:
        if config.training.eval_interval and iteration % config.training.eval_interval:
            _log_eval(engine, valid_ds, config, iteration, tb)
        if config.training.save and last_saved != iteration:
            _save(engine, config, iteration, consumed)
    tb.close()
    dist.barrier()
    return exit_code


def _save(engine: Engine, config: Config, iteration: int, consumed: int) -> None:
    checkpointing.save(engine.engine, config, iteration, consumed)
    print_rank0(f"saved checkpoint {checkpointing.tag_for(iteration)} in {config.training.save}")


def _log_eval(engine: Engine, valid_ds, config: Config, iteration: int, tb: TensorBoardWriter) -> None:
    loss = evaluate(engine, valid_ds, config)
    if loss is None:
        return
    ppl = math.exp(min(loss, 20.0))
    print_rank0(f"validation at iteration {iteration} | loss {loss:.4f} | perplexity {ppl:.2f}")
    tb.write("valid", {"loss": loss, "perplexity": ppl}, iteration)


def check_training_inputs(config: Config) -> None:
    """What training needs beyond a consistent config (the flags parse without data, for tools)."""
    if not config.data.data_path:
        raise ConfigError(
            "--data-path is required to train: the prefix of a .bin/.idx pair written by "
            "tools/preprocess_data.py, e.g. --data-path data/corpus_text_document (see scripts/quickstart.sh)"
        )


def main(config: Config) -> None:
    """Entry point: missing inputs or a checkpoint that cannot be resumed are a clear error (exit 2)."""
    try:
        check_training_inputs(config)
        code = pretrain(config)
    except (ConfigError, checkpointing.CheckpointError) as e:
        if is_rank_zero_from_environment():
            print(f"pretrain_gpt.py: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.exit(code)
