"""Atomic checkpoints: DeepSpeed's engine state plus ours, so `--load` continues exactly.

Layout under --save:

    latest                      the newest complete tag (written last, atomically)
    iter_0000200/               DeepSpeed's files (layer_XX-model_YY-model_states.pt, optimizer shards)
        megatron_lite.json      config, layout, iteration, consumed samples (rank 0)
        rng_rank_00003.pt       every random generator of rank 3 (each rank its own)

A save writes into `tmp-iter_0000200/`; only after every rank has finished
does rank 0 rename it and then replace `latest`. A process killed in between
leaves the previous checkpoint and `latest` untouched.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from typing import Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_lite.config import Config
from megatron_lite.parallel.random import get_rng_tracker

LATEST = "latest"
METADATA = "megatron_lite.json"
TMP_PREFIX = "tmp-"


class CheckpointError(RuntimeError):
    pass


def tag_for(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest_tag(directory: str) -> Optional[str]:
    path = os.path.join(directory, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    if not os.path.isdir(os.path.join(directory, tag)):
        raise CheckpointError(f"{path} names '{tag}', but {os.path.join(directory, tag)} does not exist")
    return tag


def _rng_state() -> dict:
    return {
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": get_rng_tracker().get_states(),
    }


def _set_rng_state(saved: dict) -> None:
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
    get_rng_tracker().set_states(saved["tracker"])


def _layout(config: Config) -> dict:
    p = config.parallel
    return {"tensor_model_parallel_size": p.tensor_model_parallel_size,
            "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
            "data_parallel_size": p.data_parallel_size}


def save(engine, config: Config, iteration: int, consumed_samples: int) -> str:
    """Save on every rank (collective); `engine` is a training.engine.Engine. Returns the tag."""
    directory = config.training.save
    tag = tag_for(iteration)
    tmp_tag = TMP_PREFIX + tag
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        # left over from a run killed while saving
        shutil.rmtree(os.path.join(directory, tmp_tag), ignore_errors=True)
    dist.barrier()
    engine.save(directory, tmp_tag)
    tmp_dir = os.path.join(directory, tmp_tag)
    os.makedirs(tmp_dir, exist_ok=True)
    torch.save(_rng_state(), os.path.join(tmp_dir, f"rng_rank_{rank:05d}.pt"))
    if rank == 0:
        metadata = {"iteration": iteration, "consumed_samples": consumed_samples, "layout": _layout(config),
                    "layers_per_stage": getattr(engine.module, "layers_per_stage", None), "config": config.to_dict()}
        _write_atomically(os.path.join(tmp_dir, METADATA), json.dumps(metadata, indent=1))
    dist.barrier()
    if rank == 0:
        final = os.path.join(directory, tag)
        if os.path.exists(final):  # saving the same iteration again (e.g. right after a resume)
            shutil.rmtree(final)
        os.rename(tmp_dir, final)
        _write_atomically(os.path.join(directory, LATEST), tag)
        if config.training.keep_last:
            _prune(directory, config.training.keep_last)
    dist.barrier()
    return tag


def _prune(directory: str, keep_last: int) -> None:
    tags = sorted(d for d in os.listdir(directory) if d.startswith("iter_") and os.path.isdir(os.path.join(directory, d)))
    for old in tags[:-keep_last]:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)


def read_metadata(directory: str, tag: str) -> dict:
    path = os.path.join(directory, tag, METADATA)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read checkpoint metadata ({e})") from None


def check_layout(config: Config, metadata: dict, where: str) -> None:
    saved = metadata["layout"]
    ours = _layout(config)
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
    if any(saved[k] != ours[k] for k in keys):
        raise CheckpointError(
            f"--load {where} was saved with TP={saved['tensor_model_parallel_size']}, "
            f"PP={saved['pipeline_model_parallel_size']}, but this run uses TP={ours['tensor_model_parallel_size']}, "
            f"PP={ours['pipeline_model_parallel_size']}; resume with --tensor-model-parallel-size "
            f"{saved['tensor_model_parallel_size']} --pipeline-model-parallel-size "
            f"{saved['pipeline_model_parallel_size']} (or reshard the checkpoint first)"
        )


def with_saved_stages(config: Config) -> Config:
    """A resumed `profile`-partitioned run cuts its stages where the checkpoint's run did: timings
    differ from run to run, and each stage's optimizer state belongs to the layers it held."""
    directory = config.training.load
    if config.parallel.pipeline_partition_method != "profile" or not directory or not os.path.isdir(directory):
        return config
    tag = latest_tag(directory)
    counts = read_metadata(directory, tag).get("layers_per_stage") if tag else None
    if not counts or len(counts) != config.parallel.pipeline_model_parallel_size:
        return config
    return config.replace(parallel__pipeline_partition_method=",".join(map(str, counts)))


def load(engine, config: Config) -> Tuple[int, int]:
    """Resume from --load's latest tag. Returns (iteration, consumed samples); (0, 0) when there is none."""
    directory = config.training.load
    tag = latest_tag(directory) if directory and os.path.isdir(directory) else None
    if tag is None:
        return 0, 0
    metadata = read_metadata(directory, tag)
    check_layout(config, metadata, os.path.join(directory, tag))
    # A checkpoint resharded with --no-optimizer has no optimizer state to load: the run starts fresh moments.
    path = engine.load(directory, tag, load_optimizer_states=metadata.get("optimizer_states", True))
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load {os.path.join(directory, tag)}")
    rng_path = os.path.join(directory, tag, f"rng_rank_{dist.get_rank():05d}.pt")
    if os.path.isfile(rng_path):
        _set_rng_state(torch.load(rng_path, weights_only=False))
    return metadata["iteration"], metadata["consumed_samples"]
