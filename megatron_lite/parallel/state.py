"""Parallel topology: DeepSpeed's PipeModelDataParallelTopology -> our TP, CP, DP and PP groups.

Rank order is (pipe, data, model) with model fastest: TP ranks are adjacent
(they talk most), PP is outermost. DeepSpeed's pipeline engine builds its own
groups from the same topology object, so both agree by construction.

Context parallelism has no axis of its own in DeepSpeed's grid: its "data" axis is
DP x CP, coordinate dp_rank * CP + cp_rank, so CP ranks come right after TP in the
rank order (Megatron-LM's tp-cp-dp-pp). DeepSpeed therefore averages gradients, and
ZeRO partitions the optimizer, over DP x CP, which is what CP needs: the CP ranks of
one sample each hold a part of its loss (data/context_parallel.py scales it so the
average is the sample's). Our own getters split that axis back into DP and CP.

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
    """Ranks with this rank's TP, CP and PP place: one per data-parallel replica (what the sampler splits)."""
    context_group: object
    """Ranks that share one sample's sequence: CP of them, adjacent after TP."""
    data_context_group: object
    """DP x CP: DeepSpeed's data-parallel group, over which gradients are averaged and ZeRO partitions."""
    pipeline_group: object
    model_group: object
    """TP x PP ranks that share one data-parallel index: one whole model replica."""
    tensor_ranks: List[int]
    data_ranks: List[int]
    context_ranks: List[int]
    data_context_ranks: List[int]
    pipeline_ranks: List[int]
    model_ranks: List[int]
    context_parallel_size: int
    expert_group: object = None
    """EP ranks: consecutive places of DP x CP (CP first) that split each MoE layer's experts."""
    expert_data_group: object = None
    """Ranks holding the same experts: DP x CP / EP of them, over which expert gradients are reduced."""
    expert_ranks: List[int] = None
    expert_data_ranks: List[int] = None
    expert_parallel_size: int = 1


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
               timeout_minutes: float = ParallelConfig.distributed_timeout_minutes,
               context_parallel_size: int = 1, expert_model_parallel_size: int = 1) -> None:
    """Build the topology and the groups, whose collectives fail after timeout_minutes (as the world's,
    --distributed-timeout-minutes). torch.distributed must already be initialised.

    Expert parallelism has no axis of its own either: EP consecutive places of the DP x CP axis (a
    sample's CP ranks first, so EP <= CP keeps the all-to-all among one sample's ranks) split the experts,
    and the places EP apart hold the same experts (expert-DP). Pipeline groups are shared by dense and
    expert layers, and each expert is split over TP like the dense MLP."""
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("parallel.state.initialize() needs torch.distributed.init_process_group() first")
    if _STATE is not None:
        raise RuntimeError("parallel state is already initialized; call parallel.state.destroy() first")
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    world, rank = dist.get_world_size(), dist.get_rank()
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not divisible by TP {tp} x CP {cp} x PP {pp}")
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (tp * pp))

    timeout = datetime.timedelta(minutes=timeout_minutes)
    tensor_group, tensor_ranks = _build_groups(topology.get_axis_comm_lists("model"), rank, timeout)
    data_context_lists = topology.get_axis_comm_lists("data")  # DP x CP, in data-coordinate order
    data_context_group, data_context_ranks = _build_groups(data_context_lists, rank, timeout)
    data_group, data_ranks = _build_groups([ranks[c::cp] for ranks in data_context_lists for c in range(cp)],
                                           rank, timeout)
    context_group, context_ranks = _build_groups(
        [ranks[d:d + cp] for ranks in data_context_lists for d in range(0, len(ranks), cp)], rank, timeout)
    pipeline_group, pipeline_ranks = _build_groups(topology.get_axis_comm_lists("pipe"), rank, timeout)
    replicas = [topology.filter_match(data=d) for d in range(topology.get_dim("data"))]
    model_group, model_ranks = _build_groups(replicas, rank, timeout)
    ep = expert_model_parallel_size
    if len(data_context_lists[0]) % ep:
        raise ValueError(f"expert-parallel size {ep} does not divide DP x CP = {len(data_context_lists[0])}")
    expert_group, expert_ranks = _build_groups(
        [ranks[e:e + ep] for ranks in data_context_lists for e in range(0, len(ranks), ep)], rank, timeout)
    expert_data_group, expert_data_ranks = _build_groups(
        [ranks[e::ep] for ranks in data_context_lists for e in range(ep)], rank, timeout)
    _STATE = _State(topology, tensor_group, data_group, context_group, data_context_group, pipeline_group,
                    model_group, tensor_ranks, data_ranks, context_ranks, data_context_ranks, pipeline_ranks,
                    model_ranks, cp, expert_group, expert_data_group, expert_ranks, expert_data_ranks, ep)


def is_initialized() -> bool:
    return _STATE is not None


def destroy() -> None:
    """Forget the groups (tests and restarts); the default process group stays."""
    global _STATE
    _STATE = None


def current() -> _State:
    """This process's groups, to hand back to `activate` later: several layouts' engines in one process
    (a benchmark comparing CP, DP and TP on the same two ranks) each run under their own groups."""
    return _state()


def activate(saved: _State) -> None:
    """Make groups from `current()` this process's groups again (built earlier by initialize on every rank)."""
    global _STATE
    _STATE = saved


def _state() -> _State:
    if _STATE is None:
        raise RuntimeError("parallel state is not initialized; call megatron_lite.parallel.state.initialize()")
    return _STATE


def get_topology():
    return _state().topology


def get_tensor_model_parallel_group():
    return _state().tensor_group


def get_data_parallel_group(with_context_parallel: bool = False):
    """The data-parallel replicas of this rank's place; with_context_parallel: DP x CP, DeepSpeed's group."""
    return _state().data_context_group if with_context_parallel else _state().data_group


def get_context_parallel_group():
    return _state().context_group


def get_pipeline_model_parallel_group():
    return _state().pipeline_group


def get_model_parallel_group():
    """All TP and PP ranks of one model replica (used for the global gradient norm)."""
    return _state().model_group


def get_tensor_model_parallel_ranks() -> List[int]:
    return list(_state().tensor_ranks)


def get_data_parallel_ranks() -> List[int]:
    return list(_state().data_ranks)


def get_context_parallel_ranks() -> List[int]:
    return list(_state().context_ranks)


def get_expert_model_parallel_group():
    return _state().expert_group


def get_expert_data_parallel_group():
    return _state().expert_data_group


def get_expert_model_parallel_ranks() -> List[int]:
    return list(_state().expert_ranks)


def get_expert_data_parallel_ranks() -> List[int]:
    return list(_state().expert_data_ranks)


def get_expert_model_parallel_world_size() -> int:
    return _state().expert_parallel_size


def get_expert_model_parallel_rank() -> int:
    return _coord("data") % _state().expert_parallel_size


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


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    size = _state().topology.get_dim("data")
    return size if with_context_parallel else size // _state().context_parallel_size


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    coord = _coord("data")
    return coord if with_context_parallel else coord // _state().context_parallel_size


def get_context_parallel_world_size() -> int:
    return _state().context_parallel_size


def get_context_parallel_rank() -> int:
    return _coord("data") % _state().context_parallel_size


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
        "cp_rank": get_context_parallel_rank(), "cp_size": get_context_parallel_world_size(),
        "dp_rank": get_data_parallel_rank(), "dp_size": get_data_parallel_world_size(),
        "ep_rank": get_expert_model_parallel_rank(), "ep_size": get_expert_model_parallel_world_size(),
    }


class ModelParallelUnit:
    """The `mpu` interface DeepSpeed's non-pipeline engine asks for (PP = 1: model parallel = TP).
    Its data-parallel group is DP x CP, as the pipeline engine's is (the module docstring says why).

    The pipeline engine does not need it: it reads the same topology from the PipelineModule.
    """

    def get_model_parallel_rank(self) -> int:
        return get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return get_tensor_model_parallel_world_size()

    def get_model_parallel_group(self):
        return get_tensor_model_parallel_group()

    def get_data_parallel_rank(self) -> int:
        return get_data_parallel_rank(with_context_parallel=True)

    def get_data_parallel_world_size(self) -> int:
        return get_data_parallel_world_size(with_context_parallel=True)

    def get_data_parallel_group(self):
        return get_data_parallel_group(with_context_parallel=True)
