"""The config a checkpoint records, checked as pretrain_gpt.py checks its flags, by every reader of a checkpoint.

A reader (generate, evaluate, export-hf, merge, reshard, universal, and a resume) builds the model that the
checkpoint's metadata describes. Before this, they trusted the file: with `moe_router_topk` edited to 9 of 4 experts,
export-hf wrote a config its own import-hf refused and generate.py ended in "selected index k out of range"; a
`window_size` of "abc" was a TypeError in both. Now the model's sections of validate() run on it first (the same
rules, validation/sections.py MODEL_SECTIONS), and a refusal names the file.
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, Tuple

from megatron_lite.checkpoint.format import METADATA, CheckpointError, read_metadata
from megatron_lite.config import Config, ConfigError
from megatron_lite.validation.sections import MODEL_SECTIONS, run_sections


def saved_config(data: Any, where: str) -> Config:
    """The Config recorded at `where` (a checkpoint's metadata, or a merged file), checked by the model rules
    pretrain_gpt.py runs; CheckpointError naming `where` and the field otherwise. The config is returned as
    recorded: a reader builds exactly the model that was saved."""
    edited = "it was edited, or written by a version of megatron_lite that this one cannot read"
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise CheckpointError(f"{where}: its config is not a mapping of sections to fields; {edited}")
    try:
        config = Config.from_dict(data)
        run_sections(config, MODEL_SECTIONS, _world(config))
    except ConfigError as e:
        problem = str(e).replace("\n", " ")
        raise CheckpointError(f"{where} records a model that pretrain_gpt.py refuses ({edited}): {problem} [each "
                              f"--flag here is the field of that name in the file's config]") from None
    except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong kind that no rule above reached
        raise CheckpointError(f"{where}: its config cannot be read ({e}); {edited}") from None
    return config


def _world(config: Config) -> int:
    """A world size the recorded layout runs on: an import or a reshard records its TP x PP (x EP) but no world of
    its own, so the one recorded may not fit it; EP takes its ranks out of DP x CP."""
    p = config.parallel
    numbers = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
               p.data_parallel_size or 1, p.expert_model_parallel_size)
    if not all(isinstance(n, int) and n >= 1 for n in numbers):
        return p.world_size  # validation names the bad one
    tp, pp, cp, dp, ep = numbers
    return tp * pp * math.lcm(dp * cp, ep)


def checkpoint_config(load_dir: str, tag: str) -> Tuple[Dict[str, Any], Config]:
    """(metadata, checked Config) of `load_dir/tag`; CheckpointError for a missing or unreadable metadata file or
    a config no run would accept."""
    metadata = read_metadata(load_dir, tag)
    return metadata, saved_config(metadata["config"], os.path.join(load_dir, tag, METADATA))
