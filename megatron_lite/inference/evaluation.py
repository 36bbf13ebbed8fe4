"""Loss and perplexity of a checkpoint on a dataset split, under any TP x PP layout that fits the world.

The batches are the ones training's evaluation uses (training/loop.py
`evaluate`: the first --eval-iters global batches of the split, with the
dataset sized as training sized it), so on the checkpoint's own data and
split the loss is the validation loss training logged at that iteration,
and the perplexity is exp of it. Under a layout other than the checkpoint's,
each rank takes its slice of the weights from the checkpoint's layout-free
form (training/checkpointing.load_weights); nothing is written.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch.distributed as dist

from megatron_lite.checkpoint.layout import saved_schedule
from megatron_lite.checkpoint.reader import CheckpointReader
from megatron_lite.checkpoint.reshard import target_config
from megatron_lite.config import Config, ConfigError, format_split
from megatron_lite.data.gpt_dataset import build_train_valid_test_datasets
from megatron_lite.data.tokenizer import build_tokenizer
from megatron_lite.model.attention_options import needs_document_ids
from megatron_lite.parallel import state
from megatron_lite.training.checkpointing import load_weights
from megatron_lite.training.distributed import init_distributed
from megatron_lite.training.engine import Engine
from megatron_lite.training.loop import evaluate
from megatron_lite.validation import validate

SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class EvalResult:
    loss: float
    perplexity: float
    iteration: int
    batches: int
    samples: int
    layout: tuple


def _eval_config(source: Config, world: int, tp: int, pp: int, partition_method: str, data_path, split,
                 eval_iters: Optional[int], load: str, ep: int = 1, tokenizer: Optional[dict] = None,
                 global_batch_size: Optional[int] = None, schedule: str = "1f1b") -> Config:
    """The run's config under the evaluation's layout, checked by the same validation training uses. EP is the
    evaluation's own (default 1: every expert on every rank), whatever the run's: the layer files hold every
    expert, and each rank loads its block (model/moe.py). `tokenizer`: data fields naming another tokenizer
    (checkpoint/tokenizer.py's, which checked that it fits). `schedule`: the pipeline schedule (the checkpoint's
    when evaluating at its own layout and split, else 1f1b, which any PP runs)."""
    config = source.replace(
        **{f"data__{field}": value for field, value in (tokenizer or {}).items()},
        parallel__tensor_model_parallel_size=tp, parallel__pipeline_model_parallel_size=pp,
        parallel__expert_model_parallel_size=ep,
        parallel__data_parallel_size=None, parallel__context_parallel_size=1, parallel__zero_stage=0, parallel__cpu_offload=False,
        parallel__pipeline_partition_method=partition_method, parallel__distributed_backend=None,
        parallel__pipeline_schedule=schedule,
        batch__gradient_accumulation_steps=None, batch__rampup_batch_size=None, model__padded_vocab_size=None,
        batch__global_batch_size=global_batch_size or source.batch.global_batch_size,
        data__data_path=tuple(data_path) if data_path else source.data.data_path,
        data__split=tuple(split) if split else source.data.split, data__num_workers=0,
        training__eval_iters=eval_iters if eval_iters is not None else source.training.eval_iters,
        training__load=load, training__save=None, training__save_interval=None, training__keep_last=None,
        training__exit_interval=None, logging__timing_breakdown=False,
    )
    return validate(config, world)[0]


def evaluate_checkpoint(load_dir: str, iteration: Optional[int] = None,
                        data_path: Optional[Sequence[Tuple[float, str]]] = None,
                        split: Optional[Tuple[float, float, float]] = None, split_name: str = "valid", eval_iters: Optional[int] = None,
                        tp: Optional[int] = None, pp: Optional[int] = None, backend: Optional[str] = None,
                        ep: int = 1, tokenizer: Optional[dict] = None,
                        global_batch_size: Optional[int] = None) -> EvalResult:
    """Collective: every rank of the launched job calls it; all return the same result."""
    init_distributed(backend)
    world = dist.get_world_size()
    reader = CheckpointReader(load_dir, iteration)
    source = reader.config
    tp = tp or reader.tp
    pp = pp or reader.pp
    method, schedule = source.parallel.pipeline_partition_method, "1f1b"
    if (tp, pp) != (reader.tp, reader.pp):
        # a bad layout fails on every rank, before any rank waits for another
        method = target_config(source, tp, pp, None).parallel.pipeline_partition_method
    elif reader.metadata.get("layers_per_stage"):  # a `profile` split is known only from the checkpoint
        method = ",".join(map(str, reader.metadata["layers_per_stage"]))
        schedule = saved_schedule(reader.metadata)  # its counts are 2 PP stages' under dualpipev
    try:
        config = _eval_config(source, world, tp, pp, method, data_path, split, eval_iters, load_dir, ep, tokenizer,
                              global_batch_size, schedule)
        if not config.data.data_path:  # before any group: every rank stops here alike
            raise ConfigError("--data-path is required: the prefix of a .bin/.idx pair")
        state.initialize(tp, pp, expert_model_parallel_size=ep)
        engine = Engine(config, with_scheduler=False)
        load_weights(engine, config, load_dir, reader.tag)
        dataset = _dataset(config, split_name)
        loss = evaluate(engine, dataset, config)
    finally:
        dist.barrier()
    t = config.training
    return EvalResult(loss=loss, perplexity=math.exp(loss), iteration=reader.iteration, batches=t.eval_iters,
                      samples=t.eval_iters * config.batch.global_batch_size,
                      layout=(tp, pp, config.parallel.data_parallel_size))


def _dataset(config: Config, split_name: str):
    """The split's dataset as training sized it; its first --eval-iters global batches are evaluated."""
    if not config.data.data_path:
        raise ConfigError("--data-path is required: the prefix of a .bin/.idx pair")
    d = config.data
    tokenizer = build_tokenizer(d.tokenizer_type or "NullTokenizer", d.tokenizer_model, config.model.vocab_size,
                                d.vocab_file, d.merge_file)
    gbs, t = config.batch.global_batch_size, config.training
    try:
        datasets = build_train_valid_test_datasets(
            config.data.data_path, config.data.split, config.model.seq_length,
            (t.train_iters * gbs, t.eval_iters * gbs, t.eval_iters * gbs), t.seed, config.data.data_cache_path,
            tokenizer.eod, config.data.eod_mask_loss, vocab_size=config.model.vocab_size,
            reset_position_ids=config.model.reset_position_ids, with_document_ids=needs_document_ids(config.model))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    dataset = datasets[SPLITS.index(split_name)]
    if dataset is None or t.eval_iters == 0:
        raise ConfigError(f"--split {format_split(config.data.split)} gives the {split_name} split no documents (or "
                          f"--eval-iters is 0); nothing to evaluate")
    return dataset


def evaluation_samples(load_dir: str, data_path: Sequence[Tuple[float, str]], split: Tuple[float, float, float],
                       split_name: str = "valid", eval_iters: Optional[int] = None,
                       global_batch_size: Optional[int] = None) -> list:
    """The samples `evaluate_checkpoint` averages the loss over (dicts of tokens, labels and loss mask, in
    order), read in this process without any process group: for checking its loss against another
    implementation's."""
    reader = CheckpointReader(load_dir)
    config = _eval_config(reader.config, reader.tp * reader.pp, reader.tp, reader.pp,
                          reader.config.parallel.pipeline_partition_method, data_path, split, eval_iters, load_dir,
                          global_batch_size=global_batch_size)
    dataset = _dataset(config, split_name)
    return [dataset[i] for i in range(config.training.eval_iters * config.batch.global_batch_size)]
