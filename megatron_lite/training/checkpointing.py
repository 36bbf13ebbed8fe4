"""Save and resume (--save / --load) on top of checkpoint/format.py.

A save writes DeepSpeed's files and ours (metadata, every rank's random generators) into
`tmp-iter_XXXXXXX-RUNID/`, a name no other run uses. Once every rank has written without error, rank 0
renames it to `iter_XXXXXXX` and then replaces `latest`; a process killed in between leaves the previous
checkpoint and `latest` untouched. A write that fails on any rank (a full disk) removes the temporary
folder and stops the run with one line naming the file and the reason.

A resume validates before it loads: every rank reads the files it needs through the checkpoint reader
(weights_only, the expected tensors and shapes), the ranks agree that all of them are good, and only then
does DeepSpeed load them, from memory. A bad file is one line naming it, on every rank, with no hang.
The saved config has already been compared with this run's (validation/resume.py). A checkpoint saved
under another layout, ZeRO stage or precision goes through its layout-free form (layout_free_resume.py).
"""
from __future__ import annotations

import glob
import os
import secrets
import shutil
import time
import dataclasses
import datetime
import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch.distributed as dist

from megatron_lite.atomic import WriteError, describe, fsync_folder, torch_save
from megatron_lite.checkpoint.format import (
    fused_weights,
    LATEST,
    TMP_PREFIX,
    UNIVERSAL_FORMAT,
    CheckpointError,
    layer_file,
    expert_ranks,
    layout_of,
    load_file,
    model_states_file,
    probe_load_dir,
    read_latest,
    read_metadata,
    rng_file,
    saved_tags,
    tag_for,
    weights_only,
    write_latest,
    write_metadata,
    zero3_model_states_file,
    zero_optimizer_file,
)
from megatron_lite.checkpoint.layout import saved_schedule
from megatron_lite.checkpoint.layout_free import storage_of
from megatron_lite.checkpoint.lock import SaveFolderLock
from megatron_lite.checkpoint.reader import check_layer_state, check_model_states, check_zero_state
from megatron_lite.checkpoint.snapshot import snapshot
from megatron_lite.config import Config
from megatron_lite.data.sidecar import tokenizer_sha256
from megatron_lite.deepspeed_compat import optimizer_state, pipeline
from megatron_lite.deepspeed_config import deepspeed_optimizer
from megatron_lite.model.virtual_stages import stage_count
from megatron_lite.parallel import state
from megatron_lite.parallel.experts import is_expert_parameter
from megatron_lite.training.async_save import AsyncWriter, write_in_turn
from megatron_lite.training.distributed import gather_problems, is_rank_zero_from_environment
from megatron_lite.training.layout_free_resume import (
    Resumed,
    agree,
    load_layout_free,
    load_weights_fresh_optimizer,
    load_weights_layout_free,
)
from megatron_lite.training.rng_state import read_rng_state, rng_state, set_rng_state

__all__ = ["CheckpointError", "WriteError", "SaveFolder", "Resumed", "open_save_folder", "save", "load", "latest_tag",
           "with_saved_stages", "tag_for", "load_weights"]

latest_tag = read_latest


@dataclass
class SaveFolder:
    """What one run holds on its --save folder: the lock (rank 0), the run id that names its temporary
    folders, and with --async-save the background writer."""
    lock: Optional[SaveFolderLock]
    run_id: str
    writer: Optional[AsyncWriter] = None
    waited: Optional[float] = None
    """Seconds the last save waited for the one before it to be written (--async-save); None: none was."""

    def wait(self) -> Optional[float]:
        """The save in flight, committed (its failure raised): seconds waited, None when none was in flight."""
        return self.writer.wait() if self.writer is not None else None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def lock_before_init(config: Config) -> Tuple[Optional[SaveFolderLock], Optional[str], Optional[str]]:
    """Rank 0 takes the --save folder's lock before any process group exists: (lock, problem, note)."""
    if not config.training.save or not is_rank_zero_from_environment():
        return None, None, None
    lock = SaveFolderLock(config.training.save)
    try:
        return lock, None, lock.acquire().note
    except CheckpointError as e:
        return None, str(e), None


def open_save_folder(config: Config, lock: Optional[SaveFolderLock], problem: Optional[str]) -> SaveFolder:
    """Collective, right after the process group exists: every rank learns whether rank 0 got the lock
    (and stops with its message if not), and the run's id. Rank 0 then removes unfinished saves that
    earlier runs left behind: with the lock held, no other run is writing here."""
    problems = gather_problems(problem)
    if problems:
        raise CheckpointError(problems[0])
    run_id = [f"{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"]
    dist.broadcast_object_list(run_id, src=0)
    if lock is not None:
        for stale in glob.glob(os.path.join(config.training.save, TMP_PREFIX + "*")):
            shutil.rmtree(stale, ignore_errors=True)
    writer = None
    if config.training.async_save:  # its agreement times out like every other collective
        writer = AsyncWriter(datetime.timedelta(minutes=config.parallel.distributed_timeout_minutes))
    return SaveFolder(lock=lock, run_id=run_id[0], writer=writer)


def _tokenizer_sha256(config: Config) -> Optional[str]:
    """The identity of the tokenizer's files, which a resume compares; None when they are gone since start-up."""
    d = config.data
    try:
        return tokenizer_sha256(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file)
    except (OSError, ValueError):
        return None


def _metadata(engine, config: Config, iteration: int, consumed_samples: int) -> dict:
    p = config.parallel
    return {"iteration": iteration, "consumed_samples": consumed_samples,
            "layout": layout_of(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size,
                                p.context_parallel_size, p.expert_model_parallel_size),
            "layers_per_stage": getattr(engine.module, "layers_per_stage", None),
            # Which stages each pipeline rank's files hold (checkpoint/layout.py saved_schedule).
            "pipeline_schedule": p.pipeline_schedule,
            "fused_weights": fused_weights(dataclasses.asdict(config.model)),
            "tokenizer_sha256": _tokenizer_sha256(config),
            "storage": {"zero_stage": p.zero_stage, "precision": config.precision.dtype_name,
                        "optimizer": deepspeed_optimizer(config)},
            "config": config.to_dict(),
            "numerical_guard": engine.guard.state_dict() if hasattr(engine, "guard") else None}


def save(engine, config: Config, iteration: int, consumed_samples: int, folder: SaveFolder) -> str:
    """Save on every rank (collective); `engine` is a training.engine.Engine. Returns the tag.
    Raises WriteError on every rank when any rank could not write, leaving no temporary folder. With
    --async-save (`folder.writer`) the files are snapshotted here and written in the background; the save
    before it is waited for first, and its failure, if any, is raised here."""
    directory = config.training.save
    tag = tag_for(iteration)
    tmp_dir = os.path.join(directory, f"{TMP_PREFIX}{tag}-{folder.run_id}")
    rank = dist.get_rank()
    writer = folder.writer
    if writer is not None:
        folder.waited = writer.wait()
    start = time.perf_counter()
    io = engine.io
    io.start_save(deferred=writer is not None)
    engine.save(directory, os.path.basename(tmp_dir))  # every rank returns from it, even after a failed write
    writes = [functools.partial(torch_save, obj, path) for obj, path in io.deferred or ()]
    io.deferred = None
    writes.append(functools.partial(torch_save, snapshot(rng_state()), os.path.join(tmp_dir, rng_file(rank))))
    if rank == 0:
        writes.append(functools.partial(write_metadata, tmp_dir, _metadata(engine, config, iteration,
                                                                            consumed_samples)))

    def commit(failure, group=None):
        _commit(directory, tmp_dir, tag, config.training.keep_last, failure, group)
        if writer is not None and rank == 0:
            print(f"saved checkpoint {tag} in {directory} (written in the background in "
                  f"{time.perf_counter() - start:.1f}s)", flush=True)
    if writer is not None:
        writer.submit(tag, writes, commit, io.failure)
        return tag
    commit(write_in_turn(writes, io.failure))
    return tag


def _commit(directory: str, tmp_dir: str, tag: str, keep_last: Optional[int], failure: Optional[WriteError],
            group=None) -> None:
    """Collective over `group`: when every rank wrote its files, rank 0 publishes the save; else the
    temporary folder goes and every rank raises the first rank's WriteError."""
    failures = gather_problems((failure.path, failure.reason) if failure else None, group)
    if failures:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise WriteError(*failures[0])
    problem = _publish(directory, tmp_dir, tag) if dist.get_rank() == 0 else None
    if problem is None and dist.get_rank() == 0 and keep_last:
        _prune(directory, keep_last)
    failures = gather_problems(problem, group)
    if failures:
        raise WriteError(*failures[0])


def _publish(directory: str, tmp_dir: str, tag: str) -> Optional[Tuple[str, str]]:
    """Rename the finished save into place, then point `latest` at it. On failure nothing new stays in
    place: (path, reason)."""
    final = os.path.join(directory, tag)
    try:
        fsync_folder(tmp_dir)  # the files' names are durable before the folder is published
        if os.path.exists(final):  # saving the same iteration again (e.g. right after a resume)
            shutil.rmtree(final)
        os.rename(tmp_dir, final)
    except OSError as e:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        return final, describe(e)
    try:
        write_latest(directory, tag)
    except WriteError as e:
        shutil.rmtree(final, ignore_errors=True)
        return os.path.join(directory, LATEST), e.reason
    return None


def _prune(directory: str, keep_last: int) -> None:
    for old in saved_tags(directory)[:-keep_last]:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)


def with_saved_stages(config: Config) -> Config:
    """A resumed `profile`-partitioned run cuts its stages where the checkpoint's run did: timings
    differ from run to run, and each stage's optimizer state belongs to the layers it held."""
    directory = config.training.load
    if config.parallel.pipeline_partition_method != "profile" or not directory:
        return config
    tag = probe_load_dir(directory)
    metadata, p = (read_metadata(directory, tag) if tag else {}), config.parallel
    counts = metadata.get("layers_per_stage")  # 2 PP stages' under dualpipev
    if (not counts or saved_schedule(metadata) != p.pipeline_schedule
            or len(counts) != stage_count(p.pipeline_model_parallel_size, p.pipeline_schedule)):
        return config
    return config.replace(parallel__pipeline_partition_method=",".join(map(str, counts)))


def _files_of_this_rank(folder: str, config: Config, engine, load_optimizer: bool):
    """(path, check) for every file DeepSpeed reads on this rank when resuming at the same layout."""
    p = config.parallel
    dp_rank, bf16 = state.get_data_parallel_rank(with_context_parallel=True), config.precision.bf16
    # DeepSpeed's own loader reads this DP (x CP) rank's optimizer partition only (the layout is the saved one).
    partition = load_optimizer and (p.zero_stage >= 1 or bf16)
    if not engine.pipelined:  # ZeRO 2/3 at PP = 1: one model-states file (one per DP rank at ZeRO 3), partitions
        name = model_states_file(0, 0, 1)
        if p.zero_stage == 3:
            name = zero3_model_states_file(dp_rank)
        files = [(os.path.join(folder, name), check_model_states)]
        if partition:
            files.append((os.path.join(folder, zero_optimizer_file(dp_rank, 0, 0, 1, bf16)), check_zero_state))
        return files
    tp, stage, tp_rank = p.tensor_model_parallel_size, state.get_pipeline_model_parallel_rank(), \
        state.get_tensor_model_parallel_rank()
    files = []
    for spec, module in sorted(pipeline.layer_file_modules(engine.module).items()):
        # the file must fit the module it loads into: names and this rank's shapes
        expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
        # an MoE layer's file holds every expert (training/engine.py Engine.save), this rank its EP block
        expected.update({name: (p.num_experts,) + tuple(p.shape[1:]) for name, p in module.named_parameters()
                         if is_expert_parameter(p)})
        files.append((os.path.join(folder, layer_file(spec, tp_rank)),
                      lambda path, value, expected=expected: check_layer_state(path, value, expected, tp)))
    files.append((os.path.join(folder, model_states_file(stage, tp_rank, tp)), check_model_states))
    if partition:
        files.append((os.path.join(folder, zero_optimizer_file(dp_rank, stage, tp_rank, tp, bf16)), check_zero_state))
    return files


def _preload(engine, folder: str, config: Config, load_optimizer: bool) -> Optional[dict]:
    """Read and check this rank's files into the engine's IO, then agree with every rank; the random
    generators' state is returned. Raises the first problem any rank found, on every rank."""
    def read():
        for path, check in _files_of_this_rank(folder, config, engine, load_optimizer):
            value = load_file(path)
            check(path, value)
            engine.io.preload(path, value)
        return read_rng_state(folder, dist.get_rank())
    try:
        return agree(read)
    except CheckpointError:
        engine.io.clear()
        raise


def _same_places(engine, config: Config, metadata: dict) -> bool:
    """Whether every rank finds its layers' files where it would have saved them: the same TP, PP, pipeline
    schedule (which stages a rank holds) and stage split (a layout-free folder has no such files), and its random
    streams: the same CP."""
    p, saved = config.parallel, metadata["layout"]
    split = getattr(engine.module, "layers_per_stage", None)
    return (metadata.get("format") != UNIVERSAL_FORMAT
            and saved["tensor_model_parallel_size"] == p.tensor_model_parallel_size
            and saved["pipeline_model_parallel_size"] == p.pipeline_model_parallel_size
            and saved_schedule(metadata) == p.pipeline_schedule
            and (saved.get("context_parallel_size") or 1) == p.context_parallel_size
            and (split is None or metadata.get("layers_per_stage") in (None, split)))


def _same_layout(engine, config: Config, metadata: dict) -> bool:
    """Whether DeepSpeed's own loader can read the optimizer state too: also the same DP size, ZeRO stage
    and precision, and an optimizer DeepSpeed's loader reads back
    (deepspeed_compat.optimizer_state.own_loader_reads)."""
    p = config.parallel
    return (optimizer_state.own_loader_reads(deepspeed_optimizer(config), p.zero_stage)
            and _same_places(engine, config, metadata)
            and metadata["layout"].get("data_parallel_size") == p.data_parallel_size
            and expert_ranks(metadata["layout"]) == p.expert_model_parallel_size
            and storage_of(metadata) == (p.zero_stage, config.precision.dtype_name)
            and _saved_optimizer(metadata) in (None, deepspeed_optimizer(config)))


def _saved_optimizer(metadata: dict) -> Optional[str]:
    """The DeepSpeed optimizer whose files a saved checkpoint holds (bf16 at ZeRO 1: BF16_Optimizer or, with
    --no-accumulate-allreduce-grads-in-fp32 and in checkpoints from before that flag, DeepSpeedZeroOptimizer;
    their partition files differ). Saves record it; for a save from before they did, it follows from the saved
    config (which then ran DeepSpeedZeroOptimizer at bf16 ZeRO 1); None for a resharded or imported folder,
    whose `storage` (ZeRO stage, precision) differs from its source's config and says it all."""
    storage, saved = metadata.get("storage") or {}, Config.from_dict(metadata["config"])
    if storage.get("optimizer"):
        return storage["optimizer"]
    if storage and (storage["zero_stage"], storage["precision"]) != (saved.parallel.zero_stage,
                                                                     saved.precision.dtype_name):
        return None
    return deepspeed_optimizer(saved)


def load(engine, config: Config) -> Resumed:
    """Resume from --load's latest tag; iteration 0 when --load holds no checkpoint yet (validation has said
    so). A checkpoint saved under another layout, ZeRO stage or precision goes through its layout-free form."""
    directory = config.training.load
    tag = probe_load_dir(directory)
    if tag is None:
        return Resumed(0, 0)
    metadata = read_metadata(directory, tag)
    folder = os.path.join(directory, tag)
    if weights_only(metadata, config.training.finetune):
        load_weights_fresh_optimizer(engine, config, folder, metadata)
        source = metadata.get("imported_from")
        what = f"the {source['architecture']} imported from {source['path']}" if source else f"{folder} (--finetune)"
        return Resumed(0, 0, f"loaded the weights of {what}: iteration 0, a fresh optimizer and learning-rate "
                             f"schedule, the data from its start")
    if hasattr(engine, "guard"):  # the skip rules' windows, the same on every rank (training/numerical_guard.py)
        engine.guard.load_state_dict(metadata.get("numerical_guard"))
    if not _same_layout(engine, config, metadata):
        return load_layout_free(engine, config, folder, metadata, _same_places(engine, config, metadata))
    # A checkpoint resharded with --no-optimizer has no optimizer state to load: the run starts fresh moments.
    load_optimizer = metadata.get("optimizer_states", True)
    rng = _preload(engine, folder, config, load_optimizer)
    path = engine.load(directory, tag, load_optimizer_states=load_optimizer)
    engine.io.clear()
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load {folder}")
    if rng is not None:
        set_rng_state(rng)
    return Resumed(metadata["iteration"], metadata["consumed_samples"])


def load_weights(engine, config: Config, directory: str, tag: str) -> None:
    """The model's weights only (evaluation), validated first like a resume; from any layout."""
    folder = os.path.join(directory, tag)
    metadata = read_metadata(directory, tag)
    if not _same_places(engine, config, metadata):
        load_weights_layout_free(engine, config, folder, metadata)
        return
    _preload(engine, folder, config, load_optimizer=False)
    path = engine.load_weights(directory, tag)
    engine.io.clear()
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load {os.path.join(directory, tag)}")
