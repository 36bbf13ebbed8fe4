"""Parallel topology: DeepSpeed's PipeModelDataParallelTopology -> our TP, DP and PP groups.

Rank order is (pipe, data, model) with model fastest: TP ranks are adjacent
(they talk most), PP is outermost. DeepSpeed's pipeline engine builds its own
groups from the same topology object, so both agree by construction.

Call `initialize()` once after torch.distributed is initialised; model code
never calls process-group functions itself but goes through the getters here.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch.distributed as dist

from megatron_lite.config import ParallelConfig


@dataclass
class _State:
    topology: object
    tensor_group: object
    data_group: object
    pipeline_group: object
    model_group: object
    """TP x PP ranks that share one data-parallel index: one whole model replica."""
    tensor_ranks: List[int]
    data_ranks: List[int]
    pipeline_ranks: List[int]
    model_ranks: List[int]


_STATE: Optional[_State] = None


def _build_groups(comm_lists: List[List[int]], rank: int, timeout: datetime.timedelta):
    """new_group is collective over the world: every rank creates every group, keeps its own. A group made
    without a timeout gets torch's default (30 minutes for gloo), not the world group's."""
    mine, ranks = None, None
    for members in comm_lists:
        group = dist.new_group(ranks=members, timeout=timeout)
        if rank in members:
            mine, ranks = group, list(members)
    return mine, ranks


def initialize(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
               timeout_minutes: float = ParallelConfig.distributed_timeout_minutes) -> None:
    """Build the topology and the groups, whose collectives fail after timeout_minutes (as the world's,
    --distributed-timeout-minutes). torch.distributed must already be initialised."""
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("parallel.state.initialize() needs torch.distributed.init_process_group() first")
    if _STATE is not None:
        raise RuntimeError("parallel state is already initialized; call parallel.state.destroy() first")
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    world, rank = dist.get_world_size(), dist.get_rank()
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by TP {tp} x PP {pp}")
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (tp * pp))

    timeout = datetime.timedelta(minutes=timeout_minutes)
    tensor_group, tensor_ranks = _build_groups(topology.get_axis_comm_lists("model"), rank, timeout)
    data_group, data_ranks = _build_groups(topology.get_axis_comm_lists("data"), rank, timeout)
    pipeline_group, pipeline_ranks = _build_groups(topology.get_axis_comm_lists("pipe"), rank, timeout)
    replicas = [topology.filter_match(data=d) for d in range(topology.get_dim("data"))]
    model_group, model_ranks = _build_groups(replicas, rank, timeout)
    _STATE = _State(topology, tensor_group, data_group, pipeline_group, model_group,
                    tensor_ranks, data_ranks, pipeline_ranks, model_ranks)


def is_initialized() -> bool:
    return _STATE is not None


def destroy() -> None:
    """Forget the groups (tests and restarts); the default process group stays."""
    global _STATE
    _STATE = None


def _state() -> _State:
    if _STATE is None:
        raise RuntimeError("parallel state is not initialized; call megatron_lite.parallel.state.initialize()")
    return _STATE


def get_topology():
    return _state().topology


def get_tensor_model_parallel_group():
    return _state().tensor_group


def get_data_parallel_group():
    return _state().data_group


def get_pipeline_model_parallel_group():
    return _state().pipeline_group


def get_model_parallel_group():
    """All TP and PP ranks of one model replica (used for the global gradient norm)."""
    return _state().model_group


def get_tensor_model_parallel_ranks() -> List[int]:
    return list(_state().tensor_ranks)


def get_data_parallel_ranks() -> List[int]:
    return list(_state().data_ranks)


def get_pipeline_model_parallel_ranks() -> List[int]:
    return list(_state().pipeline_ranks)


def get_model_parallel_ranks() -> List[int]:
    return list(_state().model_ranks)


def _coord(axis: str) -> int:
    topo = _state().topology
    return getattr(topo.get_coord(dist.get_rank()), axis)


def get_tensor_model_parallel_world_size() -> int:
    return _state().topology.get_dim("model")


def get_tensor_model_parallel_rank() -> int:
    return _coord("model")


def get_data_parallel_world_size() -> int:
    return _state().topology.get_dim("data")


def get_data_parallel_rank() -> int:
    return _coord("data")


def get_pipeline_model_parallel_world_size() -> int:
    return _state().topology.get_dim("pipe")


def get_pipeline_model_parallel_rank() -> int:
    return _coord("pipe")


def is_pipeline_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def agree_with_rank0(value):
    """Global rank 0's `value` on every rank (any picklable object), so that decisions made from
    local measurements (stage boundaries from timings) come out the same everywhere."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def describe() -> Dict[str, int]:
    """This rank's coordinates and sizes, for logs."""
    return {
        "rank": dist.get_rank(),
        "tp_rank": get_tensor_model_parallel_rank(), "tp_size": get_tensor_model_parallel_world_size(),
        "pp_rank": get_pipeline_model_parallel_rank(), "pp_size": get_pipeline_model_parallel_world_size(),
        "dp_rank": get_data_parallel_rank(), "dp_size": get_data_parallel_world_size(),
    }


class ModelParallelUnit:
    """The `mpu` interface DeepSpeed's non-pipeline engine asks for (PP = 1: model parallel = TP).

    The pipeline engine does not need it: it reads the same topology from the PipelineModule.
    """

    def get_model_parallel_rank(self) -> int:
        return get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return get_tensor_model_parallel_world_size()

    def get_model_parallel_group(self):
        return get_tensor_model_parallel_group()

    def get_data_parallel_rank(self) -> int:
        return get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return get_data_parallel_world_size()

    def get_data_parallel_group(self):
        return get_data_parallel_group()
