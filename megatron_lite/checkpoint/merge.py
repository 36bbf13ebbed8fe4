"""Any TP x PP checkpoint -> one fp32 state dict of the dense `GPTModel`, with its config.

The file holds {"format", "model" (state dict), "config_json", "iteration",
"consumed_samples"} and loads with `torch.load(path, weights_only=True)`;
`load_merged` gives back (Config, state dict). With strip_vocab_padding the
padded vocabulary rows (past the tokenizer's size) are dropped and the saved
config says padded_vocab_size = vocab_size, so `GPTModel` builds at that size.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from megatron_lite.atomic import save_torch
from megatron_lite.checkpoint.format import CheckpointError, load_file
from megatron_lite.checkpoint.preflight import refuse_existing_file
from megatron_lite.checkpoint.reader import CheckpointReader
from megatron_lite.checkpoint.vocab import is_vocab_parameter, resize_rows
from megatron_lite.config import Config

FORMAT = "megatron_lite.dense_gpt.v1"


def dense_state_dict(reader: CheckpointReader, strip_vocab_padding: bool = False) -> Tuple[Config, Dict[str, torch.Tensor]]:
    """(config of the dense model, `GPTModel.state_dict()`-compatible fp32 tensors)."""
    # One process: every parallel size 1 (the layer files hold every expert, so EP 1 is their layout too).
    config = reader.config.replace(parallel__tensor_model_parallel_size=1, parallel__pipeline_model_parallel_size=1,
                                   parallel__data_parallel_size=1, parallel__context_parallel_size=1,
                                   parallel__expert_model_parallel_size=1, parallel__world_size=1)
    vocab = config.model.vocab_size
    if strip_vocab_padding and vocab is not None:
        config = config.replace(model__padded_vocab_size=vocab)
    state = {}
    for (spec, name), tensor in reader.full_weights().items():
        if is_vocab_parameter(name):
            tensor = resize_rows(tensor, config.model.padded_vocab_size)
        # GPTModel.layers holds the specs in order, the tied head (no file) reusing the embedding.
        state[f"layers.{spec}.{name}"] = tensor.contiguous()
    return config, state


def save_merged(path: str, config: Config, state: Dict[str, torch.Tensor], iteration: int,
                consumed_samples: int) -> None:
    save_torch({"format": FORMAT, "model": state, "config_json": json.dumps(dataclasses.asdict(config)),
                "iteration": iteration, "consumed_samples": consumed_samples}, path)


def load_merged(path: str, check: Optional[Callable[[Any, str], Config]] = None
                ) -> Tuple[Config, Dict[str, torch.Tensor], dict]:
    """(config, state dict, {"iteration", "consumed_samples"}) of a file written by `merge`; `check(config dict,
    path) -> Config` reads the recorded config (default: as recorded, unchecked)."""
    saved = load_file(path)
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a merged checkpoint written by tools/convert_checkpoint.py merge")
    try:
        recorded = json.loads(saved["config_json"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: its config_json is missing or not JSON; write it again with "
                              f"tools/convert_checkpoint.py merge") from None
    config = check(recorded, path) if check else Config.from_dict(recorded)
    return config, saved["model"], {"iteration": saved["iteration"], "consumed_samples": saved["consumed_samples"]}


def merge(load_dir: str, output: str, iteration: Optional[int] = None, strip_vocab_padding: bool = False,
          overwrite: bool = False) -> dict:
    """`overwrite`: replace an earlier --output (atomically: an interrupted merge leaves it as it was)."""
    refuse_existing_file(output, overwrite, load_dir)
    reader = CheckpointReader(load_dir, iteration)
    config, state = dense_state_dict(reader, strip_vocab_padding)
    save_merged(output, config, state, reader.iteration, reader.consumed_samples)
    buffers = {f"layers.{spec}.{name}" for spec, names in reader.layout.buffers.items() for name in names}
    return {"tag": reader.tag, "tp": reader.tp, "pp": reader.pp, "tensors": len(state),
            "parameters": sum(t.numel() for name, t in state.items() if name not in buffers),
            "padded_vocab_size": config.model.padded_vocab_size}
