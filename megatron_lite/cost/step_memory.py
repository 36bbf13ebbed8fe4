"""The optimizer step's temporaries on one rank (cost/memory.py books them as the step phase, beyond the step's
gradients), from the config alone, in the notation of cost/memory.py (P this rank's parameters on the stage,
N = DP x CP the ranks ZeRO partitions over).

Optimizer step (torch's fused AdamW): on the CPU no temporaries of its own (measured with
benchmarks/memory_census.py); the fp32 cast of BF16_Optimizer's bf16 gradient partition at ZeRO 0 and
one fp32 partition-sized tensor of DeepSpeedZeroOptimizer at ZeRO 1 (4P/N); at ZeRO 3 the flattened
gradient partition cast to fp32 (stage3.py `_prepare_fp32_grad_for_sub_group`: 4P/N at fp32, 2P/N + 4P/N
in 16-bit; measured at DP 1: +4.23 MB at fp32, +6.34 MB at bf16, P = 1,063,680). On CUDA, not yet
measured: one fp32 temporary of everything it steps is booked. --optimizer muon's temporaries (cost/muon.py)
come on top, in the step of the group they belong to.
"""
from __future__ import annotations

from typing import Sequence, Tuple

from megatron_lite.config import Config
from megatron_lite.cost import muon as muon_cost
from megatron_lite.cost.matrices import HiddenMatrix
from megatron_lite.cost.model_state import (
    expert_data_partitions,
    fp32_accumulation,
    muon_matrices,
    muon_parameters,
    uses_zero_optimizer,
    zero_partitions,
)


def muon_step_bytes(config: Config, matrices: Sequence[HiddenMatrix]) -> Tuple[int, int]:
    """(dense group, experts' group): the peak temporaries of Muon's step of each (cost/muon.py)."""
    chosen = muon_matrices(config, matrices)
    return (muon_cost.group_step_bytes(config, [x for x in chosen if not x.expert], zero_partitions(config)),
            muon_cost.group_step_bytes(config, [x for x in chosen if x.expert], expert_data_partitions(config)))


def step_transient_bytes(config: Config, parameters: int, device: str, expert_parameters: int = 0,
                         matrices: Sequence[HiddenMatrix] = ()) -> int:
    """The optimizer step's temporaries (see above), beyond step_gradients; expert_parameters: the part of
    `parameters` partitioned over expert-DP; matrices: the stage's weight matrices (stages.stage_matrices),
    whose Muon step's temporaries come on top under --optimizer muon."""
    p, precision = config.parallel, config.precision.dtype_name
    if p.cpu_offload:
        return 0  # the step runs on the CPU copy
    muon = muon_step_bytes(config, matrices)
    if device == "cpu" and uses_zero_optimizer(p.zero_stage, precision, False, fp32_accumulation(config)):
        return _zero_optimizer_step_bytes(config, parameters, expert_parameters, matrices, muon)
    return _adamw_step_bytes(config, parameters, device, expert_parameters) + max(muon)


def _zero_optimizer_step_bytes(config: Config, parameters: int, expert_parameters: int,
                               matrices: Sequence[HiddenMatrix], muon: Tuple[int, int]) -> int:
    """DeepSpeedZeroOptimizer's step on the CPU (measured with benchmarks/memory_census.py): one fp32
    partition-sized tensor per value of the partition at ZeRO 1 (its fp32 gradients), two at ZeRO 2. It steps
    one parameter group at a time (stage_1_and_2.py step), freeing each group's before the next (measured with
    experts: the dense groups', then the experts'): the largest of the groups' partitions, each Muon group's
    with its temporaries (the AdamW groups booked together)."""
    per_value = 4 if config.parallel.zero_stage == 1 else 8
    dense_muon, expert_muon = muon_parameters(config, matrices)
    n, n_experts = zero_partitions(config), expert_data_partitions(config)
    groups = ((parameters - expert_parameters - dense_muon, n, 0), (dense_muon, n, muon[0]),
              (expert_parameters - expert_muon, n_experts, 0), (expert_muon, n_experts, muon[1]))
    return max(per_value * values // ranks + temporaries for values, ranks, temporaries in groups)


def _adamw_step_bytes(config: Config, parameters: int, device: str, expert_parameters: int = 0) -> int:
    """The AdamW step's temporaries (see above), but DeepSpeedZeroOptimizer's on the CPU."""
    p, precision = config.parallel, config.precision.dtype_name

    def partition(bytes_per_param: int) -> int:  # one rank's partitions: the dense part over N, the experts' over N/EP
        return (bytes_per_param * (parameters - expert_parameters) // zero_partitions(config)
                + bytes_per_param * expert_parameters // expert_data_partitions(config))

    if device == "cpu":
        # Measured (benchmarks/memory_census.py): torch's fused AdamW (training/optimizer.py) makes no
        # temporaries; BF16_Optimizer with bf16 accumulators casts its gradient partition to fp32 for the
        # step (4P/N); DeepSpeedZeroOptimizer: `_zero_optimizer_step_bytes`.
        # At ZeRO 3 the flattened gradient partition, cast to fp32 (16-bit: the flat copy and its cast).
        bf16_accumulators = precision == "bf16" and p.zero_stage == 0
        zero_3 = 4 if precision == "fp32" or fp32_accumulation(config) else 6
        return partition(4 if bf16_accumulators else zero_3 if p.zero_stage == 3 else 0)
    # DeepSpeed's optimizers (ZeRO, bf16) hand torch one flat fp32 partition per parameter group.
    flat = (uses_zero_optimizer(p.zero_stage, precision, p.cpu_offload, fp32_accumulation(config))
            or p.zero_stage >= 2 or precision == "bf16")
    # On CUDA (not yet measured there): one fp32 temporary of everything it steps.
    if not flat:
        return 4 * parameters
    return 4 * ((parameters - expert_parameters) // zero_partitions(config)
                + expert_parameters // expert_data_partitions(config))
