"""The pipeline module a run trains, with `--pipeline-partition-method profile`'s timings agreed on.

`profile` times one forward + backward of each kind of layer on this rank's device
(cost/spec_profile.py); every rank must cut the pipeline at the same places, so all
of them take rank 0's numbers. That broadcast is a collective, which is why it lives
here and not in model/.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from megatron_lite.config import Config
from megatron_lite.cost.spec_profile import measure_spec_seconds
from megatron_lite.cost.stages import pipeline_split, spec_costs
from megatron_lite.model.gpt import GPTPipe, build, layer_specs, model_loss_fn
from megatron_lite.model.partition import SpecCost
from megatron_lite.parallel import state


def _this_rank_device() -> torch.device:
    """Where the engine will put this rank's stage (init_distributed chose the CUDA device)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def agreed_spec_seconds(config: Config) -> List[float]:
    """Each spec's measured forward + backward seconds, rank 0's on every rank. Collective: every
    rank of the job calls it (TP layers run their collectives inside the measurement)."""
    m = config.model
    seconds = measure_spec_seconds(
        layer_specs(config), model_loss_fn(config), config.batch.micro_batch_size, m.seq_length, m.hidden_size,
        m.vocab_size, config.training.seed, m.num_layers, device=_this_rank_device(),
        sequence_shards=((config.parallel.tensor_model_parallel_size if config.parallel.sequence_parallel else 1)
                         * config.parallel.context_parallel_size))
    return state.agree_with_rank0(seconds)


def profiled_spec_costs(config: Config) -> List[SpecCost]:
    """spec_costs with the agreed measured seconds (see agreed_spec_seconds)."""
    return spec_costs(config, agreed_spec_seconds(config))


def build_pipeline(config: Config) -> GPTPipe:
    """The GPT's pipeline module on this rank's stage; with `profile`, measured first."""
    seconds: Optional[List[float]] = None
    if config.parallel.pipeline_partition_method == "profile":
        seconds = agreed_spec_seconds(config)
    return build(config, state.get_topology(), pipeline_split(config, seconds))
