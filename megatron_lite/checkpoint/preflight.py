"""What a checkpoint command refuses before it reads a tensor: a target that exists, a source that is not there.

Torch-free, like format.py, so tools/convert_checkpoint.py makes the same calls, in the command's order,
before it imports the command: a mistyped path costs a fraction of a second, not torch's start-up. The
commands (merge, reshard, universal, export_hf, import_hf) call these themselves too, for callers that
skip the tool, so either way the message is the same.
"""
from __future__ import annotations

import os

from megatron_lite.atomic import WriteError, describe
from megatron_lite.checkpoint.format import CheckpointError


def refuse_existing(save_dir: str) -> str:
    """A new checkpoint folder (reshard, universal, import-hf): refused when it exists; its parent is made."""
    if os.path.exists(save_dir):
        raise CheckpointError(f"--save {save_dir} already exists; give a new folder (the source and any existing "
                              f"checkpoint are never written over)")
    parent = os.path.dirname(os.path.abspath(save_dir))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise WriteError(save_dir, describe(e)) from None
    return os.path.basename(os.path.normpath(save_dir))


def refuse_existing_file(output: str) -> None:
    """merge's --output: a new file."""
    if os.path.isdir(output):
        raise CheckpointError(f"--output {output} is a folder; give a file name such as model.pt")
    if os.path.exists(output):
        raise CheckpointError(f"--output {output} already exists; give a new file name (an existing file is never "
                              f"written over)")


def refuse_filled_folder(output: str) -> None:
    """export-hf's --output: a new or empty folder."""
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise CheckpointError(f"--output {output} already exists and is not an empty folder; give a new folder")


def hf_config_path(folder: str) -> str:
    """import-hf's --input: a folder with a config.json; the path of that file."""
    path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise CheckpointError(f"--input {folder}: no such folder; give a Hugging Face model folder (config.json "
                              f"and model.safetensors, as save_pretrained writes)")
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

