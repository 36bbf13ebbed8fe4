"""Model states per rank: weights, gradients and optimizer states, by precision, ZeRO stage, optimizer and
experts, in the notation of cost/memory.py (P parameters, N = DP x CP the partitions, w weight bytes).

Model states follow the optimizer DeepSpeed 0.19 builds for our engine
(runtime/engine.py `_do_optimizer_sanity_check`, bf16_optimizer.py,
fp16/fused_optimizer.py, zero/stage_1_and_2.py, zero/stage3.py):

  precision ZeRO  path                     weights     gradients       optimizer
  fp32      0     torch AdamW              4P          4P              8P (moments)
  fp32      1,2   DeepSpeedZeroOptimizer   4P          4P/N            8P/N (1)
  bf16      0     BF16_Optimizer           2P          2P (bf16 acc.)  12P/N (master + moments over DP)
  bf16      1     BF16_Optimizer           2P          4P (fp32 acc.)  12P/N   (--accumulate-allreduce-grads-
                                                                                in-fp32, the default for bf16)
  fp16      0     FP16_Optimizer           2P          2P + 4P         12P (fp32 master + moments)
  16-bit    1,2   DeepSpeedZeroOptimizer   2P          0 (2)           12P/N   (bf16 at ZeRO 1 with --no-accumulate-...)
  any       3     DeepSpeedZeroOptimizer_  w P/N + w K   w' P/N (3)      12P/N (fp32 master + moments) (3)
                  Stage3
  + optimizer offload (ZeRO >= 1): gradients and optimizer states of the
    partition live in CPU memory (reported as cpu bytes); with ZeRO 3 and
    parameter offload the device keeps only the whole (persistent) tensors
    and, during forward and backward, the gathered working set.
  (1) measured on this engine: at the step three partition-sized fp32 tensors
      are resident besides the flat weights (4P + 12P/N); the table books them
      as gradient + two moments.
  (2) measured (benchmarks/memory_census.py): no gradients between steps; during the step the
      parameters' 16-bit gradients (ZeRO 1: all of them; ZeRO 2: the rank's partition) are booked as
      step_gradients, and the step's fp32 partitions as its transient.
  (3) measured (benchmarks/memory_census.py, P = 1,063,680, K = 801,536, the word embedding the one
      partitioned tensor): between steps 20P (fp32) and 16P (bf16) at DP 1, 20P/2 + 4K (fp32) at DP 2,
      each plus 0.12 MB the estimate does not book. K = the parameters in tensors of at most
      `stage3_param_persistence_threshold` elements (DeepSpeed's default 1e5, read from the DeepSpeed config):
      ZeRO 3 keeps them whole on every rank besides their partition, a second copy only at N > 1 (at N = 1
      DeepSpeed gathers nothing: the parameter is its partition). w' = the weights' dtype: at ZeRO 3 the
      gradient partitions are kept in it (DeepSpeed's grad_accum_dtype, which validation leaves unset there).
      fp32 too keeps an fp32 master copy: stage3.py's test for reusing the weights compares a torch.device
      with a string, which is never equal, so it copies on the CPU and on CUDA alike (20P, not 16P, at DP 1).
  ZeRO 3 during forward and backward (`zero3_gathered_bytes`): the gathered working set, w x the two
  largest modules' partitioned parameters (the one running and the one prefetched; nothing at N = 1), plus
  the largest tensor's full gradient before its reduction. Measured at fp32: the forward holds 4 x the word
  embedding more at DP 2 than at DP 1 (the gathered embedding), the backward 4 x the embedding more than
  the forward (its gradient); at bf16 the backward's peak equals the forward's (the gradient fits in what
  the head's backward freed), booked all the same.

--optimizer muon (training/muon.py; its costs: cost/muon.py): the M of the P parameters that are
the layers' weight matrices (cost/matrices.py) keep one fp32 moment (`exp_avg`, the momentum buffer),
not two, partitioned where AdamW's are: every row of the table books 4M (4M/N where it partitions) less
optimizer state (fp32 ZeRO 0: 8(P - M) + 4M; bf16 optimizer: (12(P - M) + 8M)/N). The step's temporaries
(cost/step_memory.py `muon_step_bytes`: the look-ahead, the assembled and gathered matrix, Newton-Schulz's)
come on top of the step's AdamW booking below, with DeepSpeedZeroOptimizer in the step of the group they
belong to (it steps one group at a time). ZeRO 3 and optimizer offload (which validation refuses with Muon)
get the moment saving and no temporaries.

Mixture of Experts: a rank's routed experts (E/EP per MoE layer: stages.stage_expert_parameters) are
reduced over, and ZeRO 1 / the bf16 optimizer partition their states over, the N / EP ranks that hold the
same experts (expert-DP: `expert_data_partitions`), as DeepSpeed 0.19 does for the expert parameter groups
(bf16_optimizer.py / stage_1_and_2.py `real_dp_process_group`); every row of the table is booked for the
dense part P - P_e over N plus the experts' part P_e over N / EP (MoE trains at ZeRO 0 or 1 only).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from megatron_lite.config import Config
from megatron_lite.cost.matrices import HiddenMatrix

DEFAULT_PERSISTENCE = int(1e5)  # DeepSpeed 0.19 zero/config.py stage3_param_persistence_threshold


def zero_partitions(config: Config) -> int:
    """N: the ranks gradients are reduced over and ZeRO partitions over, DP x CP (CP ranks hold the same
    weights and see different tokens of the same samples)."""
    p = config.parallel
    return p.data_parallel_size * p.context_parallel_size


def expert_data_partitions(config: Config) -> int:
    """N / EP: the ranks that hold the same experts (expert-DP), over which expert gradients are reduced
    and ZeRO partitions the experts' optimizer states."""
    return zero_partitions(config) // config.parallel.expert_model_parallel_size


def stage_model_state_bytes(config: Config, parameters: int, expert_parameters: int = 0, cpu_offload: bool = False,
                            offload_param: bool = False, persistent_parameters: int = 0,
                            muon_parameters: Tuple[int, int] = (0, 0)) -> Dict[str, int]:
    """`model_state_bytes` of a stage's `parameters` on one rank, of which `expert_parameters` are routed
    experts' (partitioned over expert-DP, `expert_data_partitions`; the rest over N); muon_parameters: the
    dense and the experts' weight matrices Muon steps (`muon_parameters`)."""
    par, precision = config.parallel, config.precision.dtype_name
    dense = model_state_bytes(parameters - expert_parameters, par.zero_stage, zero_partitions(config), precision,
                              cpu_offload, offload_param, persistent_parameters, fp32_accumulation(config),
                              muon_parameters[0])
    if not expert_parameters:
        return dense
    experts = model_state_bytes(expert_parameters, par.zero_stage, expert_data_partitions(config), precision,
                                cpu_offload, offload_param, 0, fp32_accumulation(config), muon_parameters[1])
    return {key: dense[key] + experts[key] for key in dense}


def model_state_bytes(parameters: int, zero_stage: int, partitions: int, precision: str,
                      cpu_offload: bool = False, offload_param: bool = False,
                      persistent_parameters: int = 0, fp32_accumulation: bool = True,
                      muon_parameters: int = 0) -> Dict[str, int]:
    """weights / gradients / optimizer_states on the device and cpu_bytes, per rank (see the table above);
    partitions: N = DP x CP (`zero_partitions`); fp32_accumulation: --accumulate-allreduce-grads-in-fp32
    (bf16 at ZeRO 1 then runs BF16_Optimizer, else DeepSpeedZeroOptimizer; at ZeRO 3 fp32 gradient
    partitions); persistent_parameters: K, ZeRO 3's parameters kept whole (`zero3_persistent_parameters`);
    muon_parameters: M of `parameters`, whose optimizer keeps one moment (--optimizer muon), not two."""
    p, n = parameters, partitions
    w = 4 if precision == "fp32" else 2
    shard = lambda bytes_per_param: int(bytes_per_param * p / n)  # noqa: E731
    if zero_stage == 3:
        whole = w * persistent_parameters if n > 1 else 0  # at N = 1 the whole tensor is its partition
        weights = (0 if offload_param else shard(w)) + whole
        grads, optim = shard(4 if precision == "fp32" or fp32_accumulation else 2), shard(12)
    elif zero_stage == 0 and precision == "fp32":
        weights, grads, optim = 4 * p, 0, 8 * p  # the gradients live during the step only: step_gradients
    elif zero_stage == 0 and precision == "bf16":
        weights, grads, optim = 2 * p, 2 * p, shard(12)
    elif zero_stage == 0:  # fp16
        weights, grads, optim = 2 * p, 6 * p, 12 * p
    elif bf16_optimizer_at_zero_1(zero_stage, precision, cpu_offload, fp32_accumulation):
        weights, grads, optim = 2 * p, 4 * p, shard(12)
    elif precision == "fp32":
        weights, grads, optim = 4 * p, shard(4), shard(8)
    else:  # 16-bit under DeepSpeedZeroOptimizer: its gradient partitions live during the step only (census)
        weights, grads, optim = 2 * p, 0, shard(12)
    whole_states = zero_stage == 0 and precision != "bf16"  # torch's or FP16_Optimizer's, not partitioned
    one_moment = 4 * muon_parameters if whole_states else int(4 * muon_parameters / n)  # Muon's missing exp_avg_sq
    optim -= one_moment
    # What a save writes, so what an --async-save snapshot copies: the weights (this rank's ZeRO 3 shard)
    # and the optimizer's fp32 masters and moments; gradients are not saved.
    # DeepSpeed 0.19 writes a bf16 ZeRO 0 optimizer's state twice: in the engine's model-states file and in
    # its bf16_zero_* file (measured: tests/checkpoint/test_async_save.py).
    saved = (shard(w) if zero_stage == 3 else weights) + optim * (2 if zero_stage == 0 and precision == "bf16" else 1)
    cpu = 0
    if cpu_offload and zero_stage >= 1:
        cpu = shard(4) + (shard(12) if precision != "fp32" else shard(8)) - one_moment
        if offload_param and zero_stage == 3:
            cpu += shard(w)
        grads, optim = 0, 0
    return {"weights": weights, "gradients": grads, "optimizer_states": optim, "cpu_bytes": cpu, "saved": saved}


def zero3_persistent_parameters(tensors: List[int], threshold: int = DEFAULT_PERSISTENCE) -> int:
    """K: the parameters in tensors of at most `threshold` elements (stage3_param_persistence_threshold),
    which ZeRO 3 keeps whole on every rank (DeepSpeed 0.19 parameter_offload.py mark_persistent_parameters)."""
    return sum(n for n in tensors if n <= threshold)


def zero3_gathered_bytes(module_tensors: List[List[int]], precision: str, partitions: int,
                         threshold: int = DEFAULT_PERSISTENCE) -> int:
    """ZeRO 3 during forward and backward (StageMemory.gathered): w x the two largest modules' partitioned
    parameters, gathered (the running one and the prefetched one; none at N = 1, where a parameter is its
    partition), plus the largest tensor's full gradient before its reduction. module_tensors: each module's
    tensors on this rank (a tied head is the embedding's module, listed once)."""
    w = 4 if precision == "fp32" else 2
    partitioned = sorted((sum(n for n in tensors if n > threshold) for tensors in module_tensors), reverse=True)
    gathered = sum(partitioned[:2]) if partitions > 1 else 0
    return w * (gathered + max((n for tensors in module_tensors for n in tensors), default=0))


def bf16_optimizer_at_zero_1(zero_stage: int, precision: str, cpu_offload: bool, fp32_accumulation: bool) -> bool:
    """deepspeed_config.deepspeed_optimizer's BF16_Optimizer case at ZeRO 1, from the estimate's arguments."""
    return zero_stage == 1 and precision == "bf16" and not cpu_offload and fp32_accumulation


def uses_zero_optimizer(zero_stage: int, precision: str, cpu_offload: bool, fp32_accumulation: bool = True) -> bool:
    """Whether DeepSpeedZeroOptimizer (with its gradient buckets) runs, rather than BF16/FP16_Optimizer or torch's."""
    if zero_stage in (1, 2):
        return not bf16_optimizer_at_zero_1(zero_stage, precision, cpu_offload, fp32_accumulation)
    return False


def fp32_accumulation(config: Config) -> bool:
    # None before validation resolves it: the default (on for bf16 where DeepSpeed can, which the rows test).
    return config.precision.accumulate_allreduce_grads_in_fp32 is not False


def muon_matrices(config: Config, matrices: Sequence[HiddenMatrix]) -> Sequence[HiddenMatrix]:
    """The matrices of a stage Muon steps: `matrices` under --optimizer muon, none under adam."""
    return matrices if config.optimizer.optimizer == "muon" else ()


def muon_parameters(config: Config, matrices: Sequence[HiddenMatrix]) -> Tuple[int, int]:
    """(dense, experts') parameters of a stage's `matrices` on one rank that Muon steps (none under adam)."""
    tp = config.parallel.tensor_model_parallel_size
    chosen = muon_matrices(config, matrices)
    return (sum(x.elements(tp) for x in chosen if not x.expert), sum(x.elements(tp) for x in chosen if x.expert))
