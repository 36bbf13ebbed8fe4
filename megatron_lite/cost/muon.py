"""What --optimizer muon's step costs one rank, from the config alone: the temporaries it makes (cost/memory.py
books them) and its Newton-Schulz work and communication (tuning/throughput.py prices them).

training/muon.py steps each Muon group (the dense matrices; an MoE model's experts are a group of their own)
tensor by tensor: a parameter at fp32 ZeRO 0, one flat fp32 partition under ZeRO 1/2 or DeepSpeed's bf16
optimizer (`flat_partitions`). For the matrix W of S values on this TP rank (D = t S dense at
--muon-tp-mode duplicated and TP t > 1, else D = S; D = S too for a matrix whole on every TP rank, MLA's down
projections and Multi-Token Prediction's eh_proj, which nothing gathers), the fp32 tensors alive at once, in values:

  U        the look-ahead (Nesterov: a new tensor) of what the optimizer holds: S, or the partition F
  batch    partitions only: the assembly buffer of the consecutive parameters W belongs to (at most
           ASSEMBLY_ELEMENTS, a larger one alone), all-reduced over the partition's ranks
  orth     gathered (t > 1): the TP shards, their sections and the dense tensor (3D); then the dense
           tensor, the output `out` (2D) and either Newton-Schulz on one part or the TP shard of out (S)
           not gathered: `out` (D) and Newton-Schulz on one part
  NS       one part m x n (m <= n; Q, K, V, gate and up are parts when split, an expert's matrix is one):
           x, its Gram m x m, the polynomial m x m and the next x: 2 m n + 2 m^2 values of 4 bytes
           (2 at --muon-fp32-matmul-prec medium, which runs it in bf16)

The group's peak is U + the largest (batch + orth) over its matrices: matrices are stepped one at a time.
Under ZeRO 1/2 / the bf16 optimizer a rank orthogonalises only the matrices with a fragment in its partition:
the estimate books the largest all the same (some rank holds a piece of it).

Work: Newton-Schulz on a part m x n runs k = --muon-num-ns-steps iterations of 4 m^2 n + 2 m^3 FLOPs (the Gram
matrix, the polynomial, the update of x). Every TP rank computes the dense matrices (duplicated); under
partitions the stage's matrices are shared by the partition's N ranks (1/N each), whole at fp32 ZeRO 0.
Communication: under partitions the all-reduce of the assembled U (4 bytes per value on this TP rank, over N),
and at duplicated TP > 1 one all-gather over TP of each orthogonalised matrix's fp32 shard.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from megatron_lite.config import Config
from megatron_lite.cost.matrices import HiddenMatrix

ASSEMBLY_ELEMENTS = 1 << 24
"""Values training/muon.py assembles over the partition's ranks per all-reduce (64 MiB of fp32): consecutive
parameters are batched up to this; a larger one goes alone."""


def flat_partitions(config: Config) -> bool:
    """Whether DeepSpeed hands our optimizer flat fp32 partitions (ZeRO 1/2, the bf16 optimizer) rather than the
    parameters themselves (fp32 ZeRO 0)."""
    return config.parallel.zero_stage >= 1 or config.precision.dtype_name == "bf16"


def _gathered(config: Config, matrix: Optional[HiddenMatrix] = None) -> bool:
    """Whether the duplicated mode gathers the TP shards (of `matrix`: not of one whole on every rank, which
    training/muon.py orthogonalises as it is)."""
    replicated = matrix is not None and matrix.replicated
    return (config.optimizer.muon_tp_mode == "duplicated" and config.parallel.tensor_model_parallel_size > 1
            and not replicated)


def matrix_parts(config: Config, matrix: HiddenMatrix) -> List[Tuple[int, int]]:
    """The [rows, cols] matrices Newton-Schulz runs on for one of `matrix`'s copies on one TP rank: the fused
    parts when split (--muon-no-split-qkv / --muon-no-split-gate-up keep them whole), else the whole; at
    --muon-tp-mode blockwise and TP > 1 the shard's own."""
    opt, tp = config.optimizer, config.parallel.tensor_model_parallel_size
    split = {"qkv": opt.muon_split_qkv, "gate_up": opt.muon_split_gate_up}.get(matrix.fused, False)
    if matrix.replicated:
        return [(matrix.rows, matrix.cols)]
    cut = 1 if _gathered(config) else tp  # blockwise: each rank's shard
    lengths = [n // cut for n in matrix.sections] if split else [sum(matrix.sections) // cut]
    return [(n, matrix.cols) if matrix.partition_dim == 0 else (matrix.rows, n) for n in lengths]


def newton_schulz_flops(config: Config, matrix: HiddenMatrix) -> float:
    """FLOPs of orthogonalising every copy of `matrix` on one TP rank."""
    k = config.optimizer.muon_num_ns_steps
    return matrix.copies * sum(k * (4.0 * min(r, c) ** 2 * max(r, c) + 2.0 * min(r, c) ** 3)
                               for r, c in matrix_parts(config, matrix))


def _orthogonalise_bytes(config: Config, matrix: HiddenMatrix) -> int:
    """training/muon.py `_orthogonalised`'s temporaries for `matrix` (fp32 unless said), beyond its input."""
    tp = config.parallel.tensor_model_parallel_size
    shard = matrix.elements(tp)
    ns = 2 if config.optimizer.muon_fp32_matmul_prec == "medium" else 4
    newton_schulz = max(ns * (2 * min(r, c) * max(r, c) + 2 * min(r, c) ** 2) for r, c in matrix_parts(config, matrix))
    if not _gathered(config, matrix):
        return 4 * shard + newton_schulz
    dense = 4 * shard * tp
    return max(3 * dense, 2 * dense + newton_schulz, 2 * dense + 4 * shard)


def assembly_batches(sizes: Sequence[int]) -> List[List[int]]:
    """The indices of the consecutive parameters (of these sizes) assembled by one all-reduce: at most
    ASSEMBLY_ELEMENTS values in all, a larger parameter alone (training/muon.py batches by it)."""
    batches, current, total = [], [], 0
    for i, n in enumerate(sizes):
        if current and total + n > ASSEMBLY_ELEMENTS:
            batches.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    return batches + ([current] if current else [])


def group_step_bytes(config: Config, matrices: Sequence[HiddenMatrix], partitions: int) -> int:
    """The peak of one Muon group's step (module docstring): `matrices` in the group's order on one TP rank,
    `partitions` the ranks its flat partition is cut over (ignored at fp32 ZeRO 0)."""
    if not matrices:
        return 0
    tp = config.parallel.tensor_model_parallel_size
    sizes = [x.elements(tp) for x in matrices]
    look_ahead = 4 if config.optimizer.muon_nesterov else 0
    if not flat_partitions(config):
        return max(look_ahead * n + _orthogonalise_bytes(config, x) for n, x in zip(sizes, matrices))
    batch_peak = max(4 * sum(sizes[i] for i in batch) + max(_orthogonalise_bytes(config, matrices[i]) for i in batch)
                     for batch in assembly_batches(sizes))
    return look_ahead * (sum(sizes) // partitions) + batch_peak


@dataclass(frozen=True)
class MuonWork:
    """One rank's Muon step on one stage, for tuning/throughput.py."""
    flops: float
    """Newton-Schulz FLOPs this rank computes."""
    rows: int
    """The smallest side of the largest part: the GEMMs' size, for their efficiency."""
    all_reduces: Tuple[Tuple[int, int], ...] = ()
    """(bytes, ranks) of each group's assembly all-reduce: the dense matrices' over N, the experts' over N / EP."""
    all_gather_bytes: int = 0
    """The fp32 dense matrices gathered over TP (each all-gather's output, summed)."""
    all_gathers: int = 0
    """How many matrices are gathered over TP."""

    def messages(self, nbytes: int) -> int:
        """All-reduces of `nbytes` assembled: one per batch of at most ASSEMBLY_ELEMENTS fp32 values."""
        return max(1, math.ceil(nbytes / (4 * ASSEMBLY_ELEMENTS)))


def stage_work(config: Config, matrices: Sequence[HiddenMatrix], partitions: int, expert_partitions: int) -> MuonWork:
    """MuonWork of a stage's `matrices` (stages.stage_matrices); partitions: N = DP x CP, expert_partitions:
    N / EP (module docstring: the share each rank orthogonalises)."""
    tp, flat = config.parallel.tensor_model_parallel_size, flat_partitions(config)
    share = lambda x: 1.0 / (expert_partitions if x.expert else partitions) if flat else 1.0  # noqa: E731
    flops = sum(share(x) * newton_schulz_flops(config, x) for x in matrices)
    rows = max((min(r, c) for x in matrices for r, c in matrix_parts(config, x)), default=0)
    reduces = []
    for expert, ranks in ((False, partitions), (True, expert_partitions)):
        values = sum(x.elements(tp) for x in matrices if x.expert == expert)
        if flat and values and ranks > 1:
            reduces.append((4 * values, ranks))
    gathered = sum(share(x) * 4 * x.elements(tp) * tp for x in matrices if _gathered(config, x))
    count = sum(share(x) for x in matrices if _gathered(config, x))
    return MuonWork(flops, rows, tuple(reduces), int(gathered), math.ceil(count))
