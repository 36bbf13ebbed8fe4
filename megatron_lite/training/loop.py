"""pretrain(): set up, then a short loop of named steps: train, log, evaluate, save or exit.

Every rank runs the same loop; decisions that must agree (stop on a signal,
stop on a non-finite loss) are all-reduced once per step so no rank leaves a
collective behind.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron_lite.batching import global_batch_size_at
from megatron_lite.config import Config, ConfigError
from megatron_lite.cost.memory import estimate_peak_bytes
from megatron_lite.data import workers
from megatron_lite.data.gpt_dataset import TokenOutOfVocabularyError, build_train_valid_test_datasets
from megatron_lite.data.sampler import build_data_iterator
from megatron_lite.data.tokenizer import build_tokenizer
from megatron_lite.deepspeed_config import deepspeed_config
from megatron_lite.exit_codes import EXIT_NUMERICAL_FAULT
from megatron_lite.model.attention_mask import ATTENTION_WORK
from megatron_lite.model.attention_options import needs_document_ids
from megatron_lite.parallel import state
from megatron_lite.refusal import say_once
from megatron_lite.training import checkpointing, data_skip, progress, stage_timing, stragglers
from megatron_lite.training.console import configure_logging, layout_summary
from megatron_lite.training.distributed import agree_over_ranks, collective_timeout, init_distributed
from megatron_lite.training.distributed import is_rank_zero_from_environment
from megatron_lite.training.engine import Engine, StepStats
from megatron_lite.training.exit_signal import ExitSignal
from megatron_lite.training.expert_balance import moe_scalars
from megatron_lite.training.interval import Interval
from megatron_lite.training.numerical_guard import NumericalFault
from megatron_lite.training.rerun import RerunStop, stop_run
from megatron_lite.training.metrics import (
    IntervalStats,
    TensorBoardWriter,
    format_line,
    format_moe_line,
    format_mtp_line,
    interval_scalars,
    peak_memory_bytes,
)
from megatron_lite.training.records import RecordWriter, records_directory
from megatron_lite.training.stage_timing import StageTimer
from megatron_lite.training.optimizer import continue_schedule
from megatron_lite.validation.training_inputs import check_training_inputs


def print_rank0(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


@dataclass
class Run:
    """Everything the loop's steps share."""
    config: Config
    engine: Engine
    train_iter: object
    valid_dataset: object
    tb: TensorBoardWriter
    exit_signal: ExitSignal
    records: RecordWriter
    save_folder: Optional[checkpointing.SaveFolder] = None
    stage_timer: Optional[StageTimer] = None
    straggler_report: Optional[stragglers.StragglerReport] = None
    memory_reported: bool = False
    compile_reported: bool = False
    iteration: int = 0
    consumed_samples: int = 0
    last_saved: Optional[int] = None
    interval: Interval = field(default_factory=Interval)
    totals: Interval = field(default_factory=Interval)
    """The whole run's training steps (for the summary)."""
    first_loss: Optional[float] = None
    last_loss: Optional[float] = None
    validation_loss: Optional[float] = None


def pretrain(config: Config) -> int:
    """Train as the config says; returns the process exit code."""
    start = time.time()
    run = setup(config)
    try:
        exit_code = train(run, start)
        dist.barrier()  # every rank is done with --save before rank 0 lets another run take it
        return exit_code
    finally:
        close(run)


def train(run: Run, start: float) -> int:
    """The loop, the final evaluation and save, the summary: the exit code."""
    config, t = run.config, run.config.training
    exit_code, status = 0, "stopped"
    while run.iteration < t.train_iters:
        if run.iteration + 1 in t.iterations_to_skip:
            skip_iteration(run)
            continue
        stats = train_step(run)
        if run.straggler_report is not None:  # the last log line's, waited for behind this step
            run.straggler_report.finish(run.tb, run.records)
        stop_signal, nonfinite = agree_after_step(run.engine, run.exit_signal.received, stats.loss)
        if nonfinite and not config.precision.fp16:
            print_rank0(f"error: loss is {stats.loss} at iteration {run.iteration}; stopping. The last good checkpoint "
                        f"({checkpointing.latest_tag(t.save) if t.save else 'none'}) is kept; lower --lr or raise "
                        f"--lr-warmup-iters, or check the data.")
            exit_code, status = 1, "nonfinite_loss"
            break
        maybe_log(run, stats)
        maybe_evaluate(run)
        if maybe_save_or_exit(run, stop_signal):
            break
    run.exit_signal.release()
    if run.straggler_report is not None:  # the last log line's, if no step followed it
        run.straggler_report.finish(run.tb, run.records)
    if exit_code == 0 and run.iteration == t.train_iters:
        finish(run)
        status = "completed"
    wait_for_saves(run)
    summarize(run, status, time.time() - start)
    run.tb.close()
    run.records.close()
    return exit_code


def close(run: Run) -> None:
    """The data workers, TensorBoard, the metrics records and the --save lock, closed on every way out of the
    run (a full disk, a bad checkpoint): not left to the process's exit, so that pretrain() called from Python
    leaves nothing running or open behind it. Each close is idempotent."""
    workers.stop_workers(run.train_iter)
    run.tb.close()
    run.records.close()
    if run.save_folder is not None:
        run.save_folder.release()


def setup(config: Config) -> Run:
    """Process groups, engine (resumed from --load), data iterators, TensorBoard and metrics records,
    signal handler."""
    configure_logging(config.logging.log_level)
    # Rank 0 locks --save before any process group exists; the others learn the outcome right after.
    lock, lock_problem, lock_note = checkpointing.lock_before_init(config)
    try:
        return _set_up(config, lock, lock_problem, lock_note)
    except BaseException:
        if lock is not None:  # a bad checkpoint, a vocabulary that does not fit: the lock goes with the run
            lock.release()
        raise


def _set_up(config: Config, lock, lock_problem: Optional[str], lock_note: Optional[str]) -> Run:
    init_distributed(config.parallel.distributed_backend, config.logging.log_level,
                     config.parallel.distributed_timeout_minutes)
    save_folder = checkpointing.open_save_folder(config, lock, lock_problem) if config.training.save else None
    if lock_note:
        print_rank0(lock_note)
    state.initialize(config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size,
                     config.parallel.distributed_timeout_minutes, config.parallel.context_parallel_size,
                     config.parallel.expert_model_parallel_size)
    summary = layout_summary(config, dist.get_backend(), "cuda" if torch.cuda.is_available() else "cpu")
    print_rank0(summary)
    d = config.data
    tokenizer = build_tokenizer(d.tokenizer_type, d.tokenizer_model, config.model.vocab_size, d.vocab_file,
                                d.merge_file)
    config = checkpointing.with_saved_stages(config)
    engine = Engine(config)
    iteration, consumed = 0, 0
    if config.training.load:
        resumed = checkpointing.load(engine, config)
        iteration, consumed = resumed.iteration, resumed.consumed_samples
        if iteration:
            continue_schedule(engine.lr_scheduler, config.optimizer)  # validation chose whose schedule (resume.py)
            print_rank0(f"resumed from {config.training.load} at iteration {iteration}, {consumed} consumed samples"
                        + (f"; {resumed.note}" if resumed.note else ""))
        elif resumed.note:
            print_rank0(resumed.note)
        else:
            print_rank0(f"--load {config.training.load} holds no checkpoint yet: starting from iteration 0")
    gbs, t = config.batch.global_batch_size, config.training
    train_ds, valid_ds, _ = build_train_valid_test_datasets(
        config.data.data_path, config.data.split, config.model.seq_length,
        (t.train_iters * gbs, t.eval_iters * gbs, t.eval_iters * gbs), t.seed, config.data.data_cache_path,
        tokenizer.eod, config.data.eod_mask_loss, vocab_size=config.model.vocab_size,
        reset_position_ids=config.model.reset_position_ids, with_document_ids=needs_document_ids(config.model),
    )
    train_iter = build_data_iterator(train_ds, consumed, config.batch.micro_batch_size,
                                     state.get_data_parallel_rank(), config.parallel.data_parallel_size,
                                     num_workers=config.data.num_workers, context_parallel=_context_parallel_place(),
                                     mtp_depths=config.model.mtp_num_layers or 0)
    rank0 = dist.get_rank() == 0
    records = RecordWriter(records_directory(config.logging.tensorboard_dir, t.save) if rank0 else None)
    records.write("start", iteration=iteration, train_iters=t.train_iters, layout=summary, config=config.to_dict())
    straggler_report = stragglers.start(config, engine)  # before the stage timer, whose clocks count its drill
    exit_signal = ExitSignal(t.exit_signal_handler)
    engine.guard.exit_requested = lambda: exit_signal.received  # agreed in the guard's all-reduce (train())
    return Run(config=config, engine=engine, train_iter=train_iter, valid_dataset=valid_ds, save_folder=save_folder,
               straggler_report=straggler_report,
               tb=TensorBoardWriter(config.logging.tensorboard_dir if rank0 else None),
               exit_signal=exit_signal, records=records,
               stage_timer=StageTimer(engine.engine) if config.logging.timing_breakdown else None,
               iteration=iteration, consumed_samples=consumed, last_saved=iteration if t.load else None)


def _context_parallel_place():
    """(CP rank, CP size): which part of each sample's sequence this rank keeps."""
    return state.get_context_parallel_rank(), state.get_context_parallel_world_size()


def agree_after_step(engine: Engine, exit_received: bool, loss: float) -> Tuple[bool, bool]:
    """Every rank's agreement after a step: (an exit signal on some rank, the loss not finite on some rank), read
    from the guard's all-reduce where the guard ran this step (NumericalGuard.take_agreed), else all-reduced here."""
    agreed = engine.guard.take_agreed()
    if agreed is not None:
        return agreed
    stop, nonfinite = agree_over_ranks([exit_received, not math.isfinite(loss)], engine.device)
    return stop, nonfinite


def train_step(run: Run) -> StepStats:
    """One optimizer step at the global batch size in force (ramp-up) for the samples consumed so far."""
    step_batch = global_batch_size_at(run.config.batch, run.consumed_samples)
    run.engine.set_global_batch_size(step_batch)
    start = time.perf_counter()
    progress.phase("forward_backward", run.iteration + 1)  # the watchdog's iteration
    try:
        stats = run.engine.train_step(run.train_iter, run.iteration + 1)
    except RerunStop as stop:  # a fatal fault the replay judged: exit 16 saves the step's start first
        stop_run(run, stop)
        raise
    run.iteration += 1
    run.consumed_samples += step_batch
    seconds = time.perf_counter() - start
    run.interval.add(stats, step_batch, seconds)
    run.totals.add(stats, step_batch, seconds)
    run.first_loss = stats.loss if run.first_loss is None else run.first_loss
    run.last_loss = stats.loss
    return stats


def skip_iteration(run: Run) -> None:
    """--iterations-to-skip: this iteration's global batch is read and dropped (training/data_skip.py)."""
    config = run.config
    step_batch = global_batch_size_at(config.batch, run.consumed_samples)
    data_skip.skip_step(run.train_iter, data_skip.micro_batches_per_step(
        step_batch, config.batch.micro_batch_size, config.parallel.data_parallel_size))
    run.iteration += 1
    run.consumed_samples += step_batch
    print_rank0(f"iteration {run.iteration}: skipped (--iterations-to-skip): its {step_batch} samples read, "
                f"not trained on")
    run.records.write("skipped_iteration", iteration=run.iteration, samples=step_batch,
                      consumed_samples=run.consumed_samples)


def maybe_log(run: Run, stats: StepStats) -> None:
    config, interval = run.config, run.interval
    if run.iteration % config.logging.log_interval and run.iteration != config.training.train_iters:
        return
    summary = IntervalStats(
        iteration=run.iteration, consumed_samples=run.consumed_samples, loss=interval.loss_sum / interval.iterations,
        lr=stats.lr, grad_norm=stats.grad_norm, loss_scale=stats.loss_scale, skipped_steps=interval.skipped,
        seconds=interval.seconds, iterations=interval.iterations, samples=interval.samples,
        global_batch_size=interval.global_batch_size,
    )
    scalars = interval_scalars(summary, config.model, config.parallel.world_size,
                               getattr(run.engine.module, "layers_per_stage", None), ATTENTION_WORK.take())
    if config.model.num_experts is not None:  # every stage's MoE layers, on rank 0 (a collective)
        for _, layers in stage_timing.gather_stages(moe_scalars(run.engine.module)):
            scalars.update(layers)
    scalars.update(interval.mtp_scalars())
    print_rank0(format_line(run.iteration, config.training.train_iters, scalars))
    if config.model.num_experts is not None:
        print_rank0(format_moe_line(scalars))
    if interval.mtp_sums is not None:
        print_rank0(format_mtp_line(scalars))
    run.tb.write("train", scalars, run.iteration)
    run.records.write("interval", iteration=run.iteration, iterations=interval.iterations, seconds=interval.seconds,
                      **scalars)
    if not run.memory_reported:
        report_memory_estimate(run)
    if run.engine.compile_counter is not None and not run.compile_reported:
        report_compile(run)
    if run.stage_timer is not None:
        stages = stage_timing.gather_stages(run.stage_timer.take(interval.seconds))
        if stages:
            print_rank0("time per stage:\n" + stage_timing.format_table(stages, interval.iterations))
            timing = stage_timing.scalars(stages, interval.iterations)
            run.tb.write("timing", timing, run.iteration)
            run.records.write("stage_timing", iteration=run.iteration, ms_per_iteration=timing)
    if run.straggler_report is not None:  # a collective: every rank logs at the same iterations; printed later
        run.straggler_report.report(run.iteration, interval.iterations, interval.seconds, run.tb, run.records)
    run.interval = Interval()


def report_memory_estimate(run: Run) -> None:
    """Once, at the first log line: each stage's estimated peak next to the measured one (as
    Megatron-LM does), so every run checks the estimator (cost/memory.py)."""
    config, stage = run.config, state.get_pipeline_model_parallel_rank()
    estimated = estimate_peak_bytes(config, stage, deepspeed_config(config))
    measured, what = peak_memory_bytes()
    gib = 1024 ** 3
    stages = stage_timing.gather_stages((estimated, measured))
    for stage, (estimate, peak) in stages:
        print_rank0(f"memory stage {stage}: estimated {estimate / gib:.4f} GiB, measured peak {peak / gib:.4f} GiB "
                    f"({what})")
    run.records.write("stage_memory", measured=what, stages=[
        {"stage": stage, "estimated_bytes": estimate, "measured_peak_bytes": peak}
        for stage, (estimate, peak) in stages])
    run.memory_reported = True


def report_compile(run: Run) -> None:
    """Once, at the first log line (the layers compile in the first step): each stage's compiled graphs, graph
    breaks and compile seconds (model/compile.py), a line per stage and a `compile` record."""
    counts = run.engine.compile_counter.counts()
    stages = stage_timing.gather_stages(counts)
    for stage, c in stages:
        print_rank0(f"{c.line(run.config.model.compile_backend)} (stage {stage})")
    run.records.write("compile", backend=run.config.model.compile_backend, stages=[
        {"stage": stage, "graphs": c.graphs, "graph_breaks": c.graph_breaks, "compile_seconds": c.seconds,
         "break_reasons": c.break_reasons} for stage, c in stages])
    run.compile_reported = True


def maybe_evaluate(run: Run) -> None:
    interval = run.config.training.eval_interval
    if interval and run.iteration % interval == 0:
        log_evaluation(run)


def maybe_save_or_exit(run: Run, stop_signal: bool) -> bool:
    """Save at --save-interval, on a signal, or at --exit-interval; True when the loop must stop."""
    t = run.config.training
    exit_now = bool(t.exit_interval) and run.iteration % t.exit_interval == 0
    interval_save = bool(t.save_interval) and run.iteration % t.save_interval == 0
    if t.save and (interval_save or stop_signal or exit_now):
        save(run)
    if stop_signal:
        print_rank0(f"exit signal received: stopped after iteration {run.iteration}")
    elif exit_now:
        print_rank0(f"--exit-interval {t.exit_interval}: stopping at iteration {run.iteration}")
    return stop_signal or exit_now


def finish(run: Run) -> None:
    """After the last iteration: a final evaluation and checkpoint unless the interval just did them."""
    t = run.config.training
    if t.eval_interval and run.iteration % t.eval_interval:
        log_evaluation(run)
    if t.save and run.last_saved != run.iteration:
        save(run)


@progress.in_phase("checkpoint")
def save(run: Run) -> None:
    start = time.perf_counter()
    folder = run.save_folder
    tag = checkpointing.save(run.engine, run.config, run.iteration, run.consumed_samples, folder)
    run.last_saved = run.iteration
    if folder.writer is None:
        print_rank0(f"saved checkpoint {tag} in {run.config.training.save}")
        return
    waited = "" if folder.waited is None else f" after waiting {folder.waited:.1f}s for the save before it"
    print_rank0(f"checkpoint {tag}: snapshot taken in {time.perf_counter() - start:.1f}s{waited}; training goes on "
                f"while it is written")


@progress.in_phase("checkpoint")
def wait_for_saves(run: Run) -> None:
    """Before the run ends (its last iteration, --exit-interval, a signal): the save in flight is committed."""
    if run.save_folder is None:
        return
    waited = run.save_folder.wait()
    if waited is not None:
        print_rank0(f"waited {waited:.1f}s at the end of the run for the last checkpoint to be written")


def evaluate(engine: Engine, dataset, config: Config) -> Optional[float]:
    """Mean validation loss over --eval-iters batches, always the same first batches of the split,
    so evaluations at different iterations (and after a resume) are comparable."""
    if dataset is None or config.training.eval_iters == 0:
        return None
    it = build_data_iterator(dataset, 0, config.batch.micro_batch_size, state.get_data_parallel_rank(),
                             config.parallel.data_parallel_size, num_workers=0,
                             context_parallel=_context_parallel_place(), mtp_depths=config.model.mtp_num_layers or 0)
    losses = [engine.eval_step(it) for _ in range(config.training.eval_iters)]
    return sum(losses) / len(losses)


@progress.in_phase("evaluation")
def log_evaluation(run: Run) -> None:
    with run.stage_timer.paused() if run.stage_timer is not None else contextlib.nullcontext():
        loss = evaluate(run.engine, run.valid_dataset, run.config)
    if loss is None:
        return
    ppl = math.exp(min(loss, 20.0))
    print_rank0(f"validation at iteration {run.iteration} | loss {loss:.4f} | perplexity {ppl:.2f}")
    run.tb.write("valid", {"loss": loss, "perplexity": ppl}, run.iteration)
    run.records.write("validation", iteration=run.iteration, loss=loss, perplexity=ppl)
    run.validation_loss = loss


def summarize(run: Run, status: str, seconds: float) -> None:
    """The run's last console line and its summary record."""
    totals, seq = run.totals, run.config.model.seq_length
    tokens_per_s = totals.samples * seq / totals.seconds if totals.seconds else None
    run.records.write("summary", status=status, iteration=run.iteration, consumed_samples=run.consumed_samples,
                      seconds=seconds, first_loss=run.first_loss, last_loss=run.last_loss,
                      validation_loss=run.validation_loss, tokens_per_s=tokens_per_s)
    # Worded unlike a log line ("iteration N/M | loss ..."), which scripts grep for.
    parts = [f"run {status}: {run.iteration} of {run.config.training.train_iters} iterations in {seconds:.1f}s"]
    if run.first_loss is not None:
        parts.append(f"training loss {run.first_loss:.4f} -> {run.last_loss:.4f}")
    if run.validation_loss is not None:
        parts.append(f"last validation loss {run.validation_loss:.4f}")
    if tokens_per_s:
        parts.append(f"{tokens_per_s:.0f} tokens/s")
    if run.records.path:
        parts.append(f"metrics in {run.records.path}")
    print_rank0(", ".join(parts))


def main(config: Config) -> None:
    """Entry point: missing inputs, a checkpoint that cannot be resumed, or data that does not fit the
    vocabulary are a clear error (exit 2); a save that could not be written (a full disk) exits 1. The
    ranks raise these together, so rank 0 speaks for all. A collective that timed out (another rank stuck
    or dead) exits 1 with a line from each rank that waited."""
    try:
        check_training_inputs(config)
        code = pretrain(config)
    except (ConfigError, checkpointing.CheckpointError, TokenOutOfVocabularyError) as e:
        if isinstance(e, TokenOutOfVocabularyError):  # each rank's own data
            print(f"pretrain_gpt.py: error: {e}", file=sys.stderr, flush=True)
        else:  # every rank's: seen once under any launcher (refusal.py)
            say_once(f"pretrain_gpt.py: error: {e}")
        _release_process_groups()
        sys.exit(2)
    except NumericalFault as e:  # raised on every rank at once, before any update (training/numerical_guard.py)
        say_once(f"pretrain_gpt.py: error: {e}; the last checkpoint is kept")
        _release_process_groups()
        sys.exit(EXIT_NUMERICAL_FAULT)
    except RerunStop as e:  # raised on every rank at once, after the replay (training/rerun.py)
        say_once(f"pretrain_gpt.py: error: {e}")
        _release_process_groups()
        sys.exit(e.exit_code)
    except checkpointing.WriteError as e:
        if is_rank_zero_from_environment():
            print(f"pretrain_gpt.py: error: {e}; the last complete checkpoint is kept", file=sys.stderr, flush=True)
        _release_process_groups()
        sys.exit(1)
    except RuntimeError as e:
        message = collective_timeout(e, config.parallel.distributed_timeout_minutes)
        if message is None:
            raise
        print(f"pretrain_gpt.py: error: {message}", file=sys.stderr, flush=True)  # each rank that waited says so
        sys.exit(1)
    _release_process_groups()
    sys.exit(code)


def _release_process_groups() -> None:
    """Destroy the process groups before the interpreter's teardown: left to it, gloo's objects were
    destroyed with a thread still attached now and then ("terminate called without an active exception",
    exit -6, in 2 runs of one full test suite). Local for gloo; skipped after a timed-out collective, whose
    peer may never answer."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
