"""The dense single-process `GPTModel` from a sharded checkpoint folder or a merged file."""
from __future__ import annotations

import os
from typing import Any, Callable, Optional, Tuple

from megatron_lite.checkpoint.merge import dense_state_dict, load_merged
from megatron_lite.checkpoint.reader import CheckpointReader
from megatron_lite.config import Config
from megatron_lite.model.gpt import GPTModel
from megatron_lite.parallel.random import model_parallel_seed


def load_dense_model(path: str, iteration: Optional[int] = None,
                     check_merged: Optional[Callable[[Any, str], Config]] = None) -> Tuple[Config, GPTModel]:
    """(config, GPTModel in eval mode, fp32); `path` is a --save folder (any TP x PP) or a merged .pt file.
    `check_merged(config dict, path) -> Config`: how a merged file's recorded config is read (a tool passes
    validation's saved_config, a layer above this one; a folder's is checked by the tool before it calls this)."""
    if os.path.isfile(path):
        config, state, _ = load_merged(path, check_merged)
    else:
        config, state = dense_state_dict(CheckpointReader(path, iteration))
    model = GPTModel(config)
    model.load_state_dict(state, strict=True)
    # Dropout runs inside the layers' tracked streams even in eval mode (where it draws nothing).
    model_parallel_seed(config.training.seed, config.model.numbered_layers)
    return config, model.eval()
