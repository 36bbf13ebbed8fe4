#!/usr/bin/env python3
"""Loss and perplexity of a checkpoint on a dataset split; launch like training (torchrun, srun, or plain python).

    torchrun --nproc_per_node 2 tools/evaluate.py --load ckpt --data-path data/corpus_text_document --split 969,30,1

Uses the batches training's evaluation uses (the first --eval-iters global
batches of the split), so on the run's own data and split the result is the
validation loss it logged for that checkpoint. Any TP x PP that fits the
world size works (default: the checkpoint's); another layout is resharded
(weights only) into a temporary folder first.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Torch-free imports only up here: --help, a bad flag and a missing --load are refused before torch starts.
from megatron_lite.checkpoint.format import CheckpointError, resolve_tag  # noqa: E402
from megatron_lite.checkpoint.tokenizer import (  # noqa: E402
    add_tokenizer_flags, check_tokenizer_flags, checkpoint_tokenizer, given_tokenizer, recorded_tokenizer,
)
from megatron_lite.config import ConfigError, parse_data_path, parse_split  # noqa: E402
from megatron_lite.flag_numbers import add_number  # noqa: E402
from megatron_lite.refusal import say_once  # noqa: E402
from megatron_lite.training.distributed import is_rank_zero_from_environment  # noqa: E402
from megatron_lite.validation.probes import data_path_weight_rules  # noqa: E402
from megatron_lite.validation.rules import split_rules  # noqa: E402
from megatron_lite.validation.saved_config import checkpoint_config  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="evaluate.py", description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="the --save folder of a pretrain_gpt.py run")
    add_number(p, "--iteration", minimum=0, default=None, example=1000, help="which iter_XXXXXXX (default: latest)")
    p.add_argument("--data-path", nargs="+", default=None, help="dataset prefix(es) (default: the run's)")
    p.add_argument("--split", default=None, help="train,valid,test weights (default: the run's)")
    p.add_argument("--split-name", choices=("train", "valid", "test"), default="valid", help="which split to use")
    add_number(p, "--eval-iters", minimum=1, default=None, example=10,
               help="global batches to average (default: the run's)")
    add_number(p, "--global-batch-size", minimum=1, default=None, example=8,
               help="samples per evaluated batch (default: the run's; an imported checkpoint's is 1, which more "
                    "than one data-parallel rank cannot split)")
    add_number(p, "--tensor-model-parallel-size", minimum=1, default=None, help="default: the checkpoint's")
    add_number(p, "--pipeline-model-parallel-size", minimum=1, default=None, help="default: the checkpoint's")
    add_number(p, "--expert-model-parallel-size", minimum=1, default=1,
               help="Mixture-of-Experts models: split the experts over this many of the data-parallel ranks "
                    "(default: 1, every rank holds every expert), whatever EP the run trained with")
    p.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None)
    add_tokenizer_flags(p, "the one the checkpoint records; it gives the end-of-document id and is checked "
                           "against the data's")
    return p


def refuse_eval_iters_beyond_the_split(args, saved, data_path, split) -> None:
    """ConfigError when --eval-iters global batches hold more samples than one pass over the split gives (the
    dataset would repeat its samples to fill them). The run's own --eval-iters, the default, is taken as it
    evaluated during training."""
    from megatron_lite.config import format_split
    from megatron_lite.data.gpt_dataset import one_epoch_samples

    data_path = data_path or saved.data.data_path
    split = split or saved.data.split
    if not data_path:
        return  # evaluate_checkpoint names --data-path
    gbs = args.global_batch_size or saved.batch.global_batch_size
    try:
        holds = one_epoch_samples(data_path, split, saved.model.seq_length, args.split_name)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e)) from None
    if args.eval_iters * gbs > holds:
        fix = (f"use --eval-iters {holds // gbs} or less" if holds >= gbs else
               f"use --global-batch-size {holds} or less (a multiple of the data-parallel size)")
        raise ConfigError(f"--eval-iters {args.eval_iters} x --global-batch-size {gbs} = {args.eval_iters * gbs:,} "
                          f"samples, but the {args.split_name} split of --data-path "
                          f"{' '.join(p for _, p in data_path)} (--split {format_split(split)}) holds {holds:,} "
                          f"samples of {saved.model.seq_length} tokens: it would be read "
                          f"{-(-args.eval_iters * gbs // max(holds, 1)):,} times over; {fix}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        data_path = parse_data_path(args.data_path)
        data_path_weight_rules(data_path)
        split = parse_split(args.split) if args.split else None
        if split:
            split_rules(split)
        check_tokenizer_flags(given_tokenizer(args))
        # The reader's own first checks (its tag, the model it records, as pretrain_gpt.py checks its flags), made
        # before torch is imported.
        _, saved = checkpoint_config(args.load, resolve_tag(args.load, args.iteration))
        # A given tokenizer checked against the model's vocabulary here, before torch too (it replaces the recorded
        # one in the run's config); the recorded one's files still there.
        model, given, tokenizer = f"the model in {args.load}", given_tokenizer(args), None
        if given:
            tokenizer, _ = checkpoint_tokenizer(saved, given, model)
        else:
            recorded_tokenizer(saved, model)
        from megatron_lite.training.console import select_accelerator

        select_accelerator()  # before DeepSpeed's first import: it would warn that it found no GPU
        if args.eval_iters is not None:  # asked for: more than the split holds would repeat it, silently, for minutes
            refuse_eval_iters_beyond_the_split(args, saved, data_path, split)
        from megatron_lite.inference.evaluation import evaluate_checkpoint

        start = time.time()
        r = evaluate_checkpoint(args.load, args.iteration, data_path, split, args.split_name, args.eval_iters,
                                args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                args.distributed_backend, args.expert_model_parallel_size, tokenizer,
                                args.global_batch_size)
    except (ConfigError, CheckpointError) as e:
        say_once(f"evaluate.py: error: {e}")  # rank 0's line, which no other rank's exit can cut off (refusal.py)
        return 2
    if is_rank_zero_from_environment():
        print(f"evaluated {args.load} at iteration {r.iteration} on the {args.split_name} split: loss {r.loss:.6f} | "
              f"perplexity {r.perplexity:.4f} | {r.batches} batches, {r.samples} samples | TP={r.layout[0]}, "
              f"PP={r.layout[1]}, DP={r.layout[2]} | {time.time() - start:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    from megatron_lite.process_end import run_then_end

    run_then_end(main, sys.argv[1:])  # not the interpreter's exit: its finalization can abort gloo's threads
