"""What a checkpoint command refuses before it reads a tensor: a target that exists, a source that is not there.

Torch-free, like format.py, so tools/convert_checkpoint.py makes the same calls, in the command's order,
before it imports the command: a mistyped path costs a fraction of a second, not torch's start-up. The
commands (merge, reshard, universal, export_hf, import_hf) call these themselves too, for callers that
skip the tool, so either way the message is the same.
"""
from __future__ import annotations

import os
from typing import Optional

from megatron_lite.atomic import WriteError, describe
from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.targets import target_problem


def _overlaps(a: str, b: str) -> bool:
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep)


def refuse_target(flag: str, path: str, overwrite: bool = False, source: Optional[str] = None,
                  source_flag: str = "--load", folder: bool = True, empty_folder_is_new: bool = False) -> None:
    """An output of a checkpoint command (targets.py's rule): refused when it exists unless `overwrite`, always
    when it is under a file, and, with --overwrite, when it is or holds the `source` the command reads."""
    why = target_problem(flag, path, [path], overwrite, folder=folder, empty_folder_is_new=empty_folder_is_new)
    if why:
        raise CheckpointError(why)
    if overwrite and source is not None and os.path.exists(path) and _overlaps(path, source):
        raise CheckpointError(f"{flag} {path} is where {source_flag} {source} is read from; --overwrite replaces "
                              f"an earlier output, never the source: give another {'folder' if folder else 'file'}")


def refuse_existing(save_dir: str, flag: str = "--save", overwrite: bool = False, source: Optional[str] = None,
                    source_flag: str = "--load") -> str:
    """A new checkpoint folder (reshard, universal, import-hf): refused when it exists, unless --overwrite
    (never over the source); its parent is made."""
    refuse_target(flag, save_dir, overwrite, source, source_flag)
    parent = os.path.dirname(os.path.abspath(save_dir))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise WriteError(save_dir, describe(e)) from None
    return os.path.basename(os.path.normpath(save_dir))


def refuse_existing_file(output: str, overwrite: bool = False, source: Optional[str] = None) -> None:
    """merge's --output: a new file, or an earlier one with --overwrite (never in the checkpoint read)."""
    if os.path.isdir(output):
        raise CheckpointError(f"--output {output} is a folder; give a file name such as model.pt")
    refuse_target("--output", output, overwrite, source, folder=False)


def refuse_filled_folder(output: str, overwrite: bool = False, source: Optional[str] = None) -> None:
    """export-hf's --output: a new or empty folder, or an earlier export with --overwrite."""
    refuse_target("--output", output, overwrite, source, empty_folder_is_new=True)


def hf_config_path(folder: str) -> str:
    """import-hf's --input: a folder with a config.json; the path of that file."""
    path = os.path.join(folder, "config.json")
    give = "give a Hugging Face model folder (config.json and model.safetensors, as save_pretrained writes)"
    if not os.path.isdir(folder):
        if os.path.exists(folder):
            raise CheckpointError(f"--input {folder} is a file, not a folder; {give}")
        raise CheckpointError(f"--input {folder}: no such folder; {give}")
    if os.path.isdir(path):
        raise CheckpointError(f"--input {folder}: its config.json is a folder, not the model's JSON file; {give}")
    if not os.path.isfile(path):
        raise CheckpointError(f"--input {folder} has no config.json: it is not a Hugging Face model folder")
    return path


def refuse_target_sizes(num_attention_heads: int, num_layers: int, tp: int, pp: int) -> None:
    """reshard's target sizes out of range, named with the model's heads and layers (whether a TP size fits
    the heads and query groups is checkpoint/reshard.py's target_config's to say)."""
    if tp < 1:
        raise CheckpointError(f"--target-tensor-model-parallel-size {tp} must be at least 1 and divide the model's "
                              f"{num_attention_heads} attention heads")
    if pp < 1 or pp > num_layers:
        raise CheckpointError(f"--target-pipeline-model-parallel-size {pp} must be between 1 and the model's "
                              f"{num_layers} transformer layers")

