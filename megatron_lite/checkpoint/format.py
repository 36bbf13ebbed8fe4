"""The checkpoint format's one home: file names, tags, metadata, the layout check, and safe loading.

Layout of a --save folder:

    latest                          the newest complete tag (written last, atomically)
    .megatron_lite.lock             held by the run writing here (checkpoint/lock.py)
    iter_0000200/                   one complete checkpoint
        megatron_lite.json          config, layout, fused weights' layout, iteration, consumed samples,
                                    tokenizer SHA-256 (rank 0)
        rng_rank_00003.pt           every random generator of global rank 3
        layer_XX-model_YY-model_states.pt, mp_rank_XX_model_states.pt, [bf16_]zero_pp_rank_D_mp_rank_XX_
        optim_states.pt             DeepSpeed's files (names from deepspeed_compat.checkpoint_files)
    tmp-iter_0000200-RUNID/         a save in progress, renamed to iter_0000200 when every rank is done

Every file is loaded with `torch.load(weights_only=True)`: tensors, numbers, strings and containers, plus
the few plain DeepSpeed classes its optimizers save (deepspeed_compat.checkpoint_files.checkpoint_safe_globals)
and numpy's array reconstruction (random-generator states of older checkpoints). A file that needs anything else is
refused by name: nothing in a checkpoint executes.

Imports no torch or DeepSpeed (deepspeed_compat and torch are imported where a name or a load needs them),
so a tool refuses a missing or malformed --load before paying for either.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

from megatron_lite.atomic import write_text
from megatron_lite.reading import UnreadableFile, read_json

LATEST = "latest"
METADATA = "megatron_lite.json"
TMP_PREFIX = "tmp-"
LOCK_FILE = ".megatron_lite.lock"
TAG_PREFIX = "iter_"
UNIVERSAL_FORMAT = "megatron_lite.universal.v1"


# DeepSpeed's file names, which deepspeed_compat.checkpoint_files owns; imported per call, as it imports torch
# and DeepSpeed.
def layer_file(spec: int, tp_rank: int) -> str:
    from megatron_lite.deepspeed_compat import checkpoint_files

    return checkpoint_files.layer_file_name(spec, tp_rank)


def model_states_file(stage: int, tp_rank: int, tp: int) -> str:
    from megatron_lite.deepspeed_compat import checkpoint_files

    return checkpoint_files.model_states_file_name(stage, tp_rank, tp)


def zero_optimizer_file(dp_rank: int, stage: int, tp_rank: int, tp: int, bf16: bool) -> str:
    from megatron_lite.deepspeed_compat import checkpoint_files

    return checkpoint_files.zero_optimizer_file_name(dp_rank, stage, tp_rank, tp, bf16)


def zero3_model_states_file(dp_rank: int) -> str:
    from megatron_lite.deepspeed_compat import checkpoint_files

    return checkpoint_files.zero3_model_states_file_name(dp_rank)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message names the file or flag and what to do."""


def tag_for(iteration: int) -> str:
    return f"{TAG_PREFIX}{iteration:07d}"


RNG_PREFIX = "rng_rank_"


def rng_file(global_rank: int) -> str:
    return f"{RNG_PREFIX}{global_rank:05d}.pt"


def rng_files(folder: str) -> List[str]:
    """Every rank's random-generator file in a tag folder, by name."""
    return sorted(name for name in os.listdir(folder) if name.startswith(RNG_PREFIX))


def zero_optimizer_files(folder: str, stage: int, tp_rank: int, tp: int, dp: int, bf16: bool) -> List[str]:
    """Paths of every DP rank's optimizer partition of one stage and TP rank, in DP-rank order; none for a
    plain torch optimizer (fp32, ZeRO 0). Some but not all of them is an incomplete checkpoint."""
    paths = [os.path.join(folder, zero_optimizer_file(d, stage, tp_rank, tp, bf16)) for d in range(dp)]
    present = [p for p in paths if os.path.isfile(p)]
    if present and len(present) != len(paths):
        missing = next(p for p in paths if p not in present)
        raise CheckpointError(f"{folder} is incomplete: {os.path.basename(missing)} is missing (the checkpoint "
                              f"was saved at data-parallel size {dp})")
    return present


def layout_of(tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
              data_parallel_size: Optional[int], context_parallel_size: int = 1,
              expert_model_parallel_size: int = 1) -> Dict[str, Optional[int]]:
    """The layout a checkpoint records; EP only where there is one (earlier checkpoints have none: EP 1)."""
    layout = {"tensor_model_parallel_size": tensor_model_parallel_size,
              "pipeline_model_parallel_size": pipeline_model_parallel_size,
              "data_parallel_size": data_parallel_size,
              "context_parallel_size": context_parallel_size}
    if expert_model_parallel_size > 1:
        layout["expert_model_parallel_size"] = expert_model_parallel_size
    return layout


def expert_ranks(layout: dict) -> int:
    """EP when the layout was saved: each DP x CP place d held expert block d % EP (parallel/state.py)."""
    return int(layout.get("expert_model_parallel_size") or 1)


def data_ranks(layout: dict) -> int:
    """DeepSpeed's data-parallel size when the layout was saved: DP x CP (parallel/state.py), one ZeRO
    optimizer partition file each. Checkpoints from before context parallelism have no CP: 1."""
    return int(layout.get("data_parallel_size") or 1) * int(layout.get("context_parallel_size") or 1)


def read_latest(directory: str) -> Optional[str]:
    """The tag `latest` names, or None when there is no `latest`; a tag without its folder is an error."""
    path = os.path.join(directory, LATEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            tag = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot be read ({e})") from None
    fix = f"write the name of a complete iter_XXXXXXX folder of {directory} into it"
    if not tag:
        raise CheckpointError(f"{path} is empty; {fix}")
    # A path (`../../../etc`, an absolute one) would read another folder as this checkpoint, even when it exists.
    if os.sep in tag or (os.altsep and os.altsep in tag) or tag in (os.curdir, os.pardir):
        raise CheckpointError(f"{path} names '{tag}', a path, but it holds the name of a folder inside {directory} "
                              f"(a checkpoint's files are read from its own folder only); {fix}")
    if not os.path.isdir(os.path.join(directory, tag)):
        raise CheckpointError(f"{path} names '{tag}', but {os.path.join(directory, tag)} does not exist; {fix}")
    return tag


def write_latest(directory: str, tag: str) -> None:
    write_text(os.path.join(directory, LATEST), tag)


def read_metadata(directory: str, tag: str) -> Dict[str, Any]:
    path = os.path.join(directory, tag, METADATA)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file; this folder was not written by megatron_lite's "
                              f"pretrain_gpt.py, or its save did not finish")
    try:
        metadata = read_json(path)
    except UnreadableFile as e:
        raise CheckpointError(f"{e}; not megatron_lite checkpoint metadata") from None
    if not isinstance(metadata, dict) or not all(k in metadata for k in ("iteration", "layout", "config")):
        raise CheckpointError(f"{path}: not megatron_lite checkpoint metadata (needs iteration, layout, config)")
    _check_fused_weights(path, metadata)
    return metadata


def fused_weights(model: Dict[str, Any]) -> Dict[str, Any]:
    """How the fused weights of a model (a saved config's "model" section) are laid out: the parts of their
    first dimension, in order, with their full (TP 1) row counts. Each part is cut into TP equal contiguous
    pieces and rank r's file holds piece r of every part, in this order (checkpoint/slicing.py).

    Checkpoints written before this record existed have the same layout (GPT-2's [Q; K; V] with equal parts)."""
    heads = model["num_attention_heads"]
    head_dim = model.get("kv_channels") or model["hidden_size"] // heads  # ModelConfig.head_dim
    groups = model.get("num_query_groups") or heads
    layout = {} if model.get("multi_latent_attention") else {"attention.query_key_value": {
        "parts": ["query", "key", "value"], "rows": [heads * head_dim, groups * head_dim, groups * head_dim],
        "query_heads_per_group": heads // groups}}  # MLA has no fused attention weight: whole heads per rank
    if model.get("swiglu") or model.get("quick_geglu"):
        ffn = model["ffn_hidden_size"]
        layout["mlp.dense_h_to_4h"] = {"parts": ["gate", "up"], "rows": [ffn, ffn]}
    return layout


def _check_fused_weights(path: str, metadata: Dict[str, Any]) -> None:
    recorded = metadata.get("fused_weights")
    if recorded is None:
        return
    expected = fused_weights(metadata["config"].get("model", {}))
    if recorded != expected:
        raise CheckpointError(f"{path}: its fused weights are laid out as {recorded}, but this version of "
                              f"megatron_lite reads {expected} for that model: convert the checkpoint with the "
                              f"version that wrote it")


def weights_only(metadata: Dict[str, Any], finetune: bool) -> bool:
    """Whether --load takes a checkpoint's weights alone (iteration 0, a fresh optimizer): under --finetune,
    and always for a model imported from Hugging Face (it has no training state)."""
    return finetune or bool(metadata.get("imported_from"))


def write_metadata(folder: str, metadata: Dict[str, Any]) -> None:
    write_text(os.path.join(folder, METADATA), json.dumps(metadata, indent=1))


def is_temporary(name: str) -> bool:
    """A save in progress (or left by a killed run): never a checkpoint to load."""
    return name.startswith(TMP_PREFIX)


def saved_tags(directory: str) -> List[str]:
    return sorted(d for d in os.listdir(directory)
                  if d.startswith(TAG_PREFIX) and os.path.isdir(os.path.join(directory, d)))


def resolve_tag(load_dir: str, iteration: Optional[int]) -> str:
    """The tag to read from --load (iteration N's, else the one `latest` names); CheckpointError naming
    --load, --iteration or `latest` when there is none."""
    if not os.path.isdir(load_dir):
        if os.path.exists(load_dir):
            raise CheckpointError(f"--load {load_dir} is a file, not a checkpoint folder; give the --save folder of a "
                                  f"pretrain_gpt.py run")
        raise CheckpointError(f"--load {load_dir}: no such folder; give the --save folder of a pretrain_gpt.py run")
    if iteration is not None:
        tag = tag_for(iteration)
        if not os.path.isdir(os.path.join(load_dir, tag)):
            have = saved_tags(load_dir)
            raise CheckpointError(f"--iteration {iteration}: {os.path.join(load_dir, tag)} does not exist; "
                                  f"saved iterations: {', '.join(have) or 'none'}")
        return tag
    tag = read_latest(load_dir)
    if tag is None:
        raise CheckpointError(f"{os.path.join(load_dir, LATEST)}: no such file, so there is no complete checkpoint to "
                              f"read; give --iteration N for one of the iter_XXXXXXX folders, or a folder written by "
                              f"pretrain_gpt.py --save")
    return tag


def probe_load_dir(path: str) -> Optional[str]:
    """What --load PATH holds: the tag to resume from, or None for 'nothing yet': a missing or empty folder,
    or one with only our lock, unfinished saves and other folders (a data cache or TensorBoard folder kept
    beside the checkpoints): how a Slurm job whose --load equals its --save starts the first time. Anything
    else that is not one of our checkpoints (files, or iter_* folders, without `latest`) is a CheckpointError."""
    if not os.path.exists(path):
        return None
    hint = "give the --save folder of a pretrain_gpt.py run (or a new folder to start from iteration 0)"
    if not os.path.isdir(path):
        kind = "a merged checkpoint file (tools/convert_checkpoint.py merge)" if path.endswith((".pt", ".pth")) \
            else "a file"
        raise CheckpointError(f"--load {path} is {kind}, not a checkpoint folder; {hint}")
    tag = read_latest(path)
    if tag is not None:
        read_metadata(path, tag)
        return tag
    entries = sorted(e for e in os.listdir(path) if e != LOCK_FILE and not is_temporary(e)
                     and (e.startswith(TAG_PREFIX) or not os.path.isdir(os.path.join(path, e))))
    if not entries:
        return None
    if "config.json" in entries and any(e.endswith((".safetensors", ".bin")) for e in entries):
        raise CheckpointError(f"--load {path} is a Hugging Face model folder (config.json and weights), not a "
                              f"megatron_lite checkpoint; {hint}")
    tags = [e for e in entries if e.startswith(TAG_PREFIX)]
    if tags:
        raise CheckpointError(f"--load {path} has {', '.join(tags[:3])}{' ...' if len(tags) > 3 else ''} but no "
                              f"'{LATEST}' file naming the complete one; write a tag into {os.path.join(path, LATEST)} "
                              f"(e.g. echo {tags[-1]} > {os.path.join(path, LATEST)}) or give another folder")
    shown = ", ".join(entries[:4]) + (" ..." if len(entries) > 4 else "")
    raise CheckpointError(f"--load {path} holds files ({shown}) but no '{LATEST}' file: it is not a megatron_lite "
                          f"checkpoint folder; {hint}")


def _load_error(path: str, error: Exception) -> CheckpointError:
    text = str(error)
    if "weights_only" in text or "Unsupported global" in text or "safe_globals" in text:
        name = text.split("GLOBAL ", 1)[1].split(" ", 1)[0] if "GLOBAL " in text else "an object"
        return CheckpointError(f"{path}: refused, it needs {name}, which is not a tensor or a plain value that "
                               f"a checkpoint may hold (loading it could run code)")
    reason = text.strip().splitlines()[0].split(". ")[0] if text.strip() else type(error).__name__
    return CheckpointError(f"{path}: cannot be read, the file is truncated or not a checkpoint file ({reason})")


def load_file(path: str, mmap: bool = False) -> Any:
    """torch.load without executing anything; CheckpointError naming the file when it cannot be read
    or needs a class outside the allow-list. `mmap`: tensors map the file (privately) instead of being read,
    so only the bytes used are read (checkpoint/sliced.py)."""
    import torch

    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file")
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - any failure to read means the same thing to the user
        raise _load_error(path, e) from None


def _safe_globals() -> list:
    import numpy as np

    from megatron_lite.deepspeed_compat import checkpoint_files

    # numpy's own array reconstruction (random states of checkpoints before the tensor-only format).
    arrays = [np.ndarray, np.dtype, np.dtypes.UInt32DType]
    core = getattr(np, "_core", None) or getattr(np, "core")
    arrays.append(core.multiarray._reconstruct)
    return checkpoint_files.checkpoint_safe_globals() + arrays
