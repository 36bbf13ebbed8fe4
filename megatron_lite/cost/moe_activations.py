"""Bytes an MoE layer keeps for backward for one micro-batch, in the notation of cost/activations.py.

An MoE layer (model/moe.py; `moe_mlp_bytes`) keeps, instead of the MLP's terms, with T = bs the tokens it
dispatches (under sequence parallelism every TP rank gathers the whole s), T/r those it routes, E experts,
K = --moe-router-topk, F the expert width, F_s the shared expert's, and N the routed copies this rank's
experts receive (`routed_copies`: T K under balanced routing, each expert T K / E; fewer with a capacity):
  router   (fp32 whatever the model's dtype) 16-bit: the input and the weight cast to fp32, 4 T h / r + 4 E h
           scores: softmax (top-k of the logits, then softmax over k): the logits, which the top-k's gather
             keeps, and the k weights, 4 (E + K) T / r; pre-softmax: the softmax, 4 E T / r; sigmoid: the
             sigmoid, 4 E T / r, and for K > 1 the chosen scores and their sums, 4 (K + 1) T / r
           the chosen experts (int64, kept by the gather)                   8 K T / r
           the weights the combination multiplies by (the input's dtype, all T) e K T, unless they are the
             softmax's own output (fp32, no scaling factor, no sequence parallelism)
           aux loss: its softmax (sigmoid: sigmoid and sums) 4 E T / r (+ 4 T / r) and the token counts
             4 E (seq_aux_loss: per sample, 4 b E); z-loss: the logits (unless kept above) and their
             log-sum-exp, 4 (E + 1) T / r
  dispatch the copies' order (int64; kept by the combination)        8 K T, and each sent copy's token 8 N
           expert parallelism: the received rows' order and its inverse       16 N
  experts  their input rows                                           e N h
           inner activations, `mlp_inner_copies` of e N F / t: GeLU 2, SwiGLU 4, other gated 3
  combine  the experts' outputs (EP > 1: as they come back)           e N h
           the [T, K, h] outputs in token order, kept by their weighting      e K T h
  shared   the MLP at width F_s                                       2 e T F_s / t (gated: 4 or 3, as above)
           --moe-shared-expert-gate: the sigmoid and the shared output (e T + e T h) / r
The input (the norm's output) is the norm's term, except at 16 bits without a shared expert: then only
its fp32 copy is kept (- e T h / r). The gathered tokens are not kept (the dispatch keeps indices only).
Measured: tests/cost/test_memory_moe.py, on CPU with the per-expert loop (the grouped GEMM on CUDA keeps
its own, not measured here); unbalanced routing: `routed_copies`.
"""
from __future__ import annotations

from typing import Optional, Tuple

from megatron_lite.config import Config
from megatron_lite.cost.activation_dims import dims


def mlp_inner_copies(m) -> int:
    """Tensors of the MLP's inner width (f, or F per routed copy) kept per token (cost/activations.py): GeLU its
    input and output (2); SwiGLU [gate; up], silu(gate) and the product (4); any other gated unit [gate; up] and
    the product (3: model/activation.py's Function recomputes the rest)."""
    if not m.gated_linear_unit:
        return 2
    plain_swiglu = m.swiglu and m.activation_func_clamp_value is None and m.glu_linear_offset == 0.0
    return 4 if plain_swiglu else 3


def routed_copies(config: Config, worst_case: bool = False) -> Tuple[int, int]:
    """(sent, received): the routed copies of one micro-batch's tokens that a rank dispatches (within the
    capacity) and those its experts receive, under balanced routing (each expert T K / E copies from every
    rank; the census routes so). T = b s (the whole sequence under sequence parallelism, which gathers it).

    The worst case (`worst_case`), unbalanced routing: dropless at EP 1, every copy on one expert still
    totals T K rows on the rank, so the balanced count is the bound (capacity only lowers it: at most C =
    ceil(T K / E x factor) per expert). Under EP a rank receives at most what every EP rank sends to its
    E/EP experts: T K x EP dropless, EP x min(T K, E/EP x C) with a capacity. The estimate books the
    balanced count; every term that scales with N (rows, expert inner activations, their orders) grows
    with it."""
    from megatron_lite.model.router import capacity

    m, d = config.model, dims(config, "cuda")
    experts, k, ep = m.num_experts, m.moe_router_topk, config.parallel.expert_model_parallel_size
    copies = d.bs * k
    limit = None if m.moe_expert_capacity_factor is None else capacity(d.bs, k, experts, m.moe_expert_capacity_factor)
    sent = copies if limit is None else min(copies, experts * limit)
    if not worst_case:
        return sent, sent
    per_source = copies if limit is None else min(copies, experts // ep * limit)
    return sent, ep * per_source


def moe_mlp_bytes(config: Config, device: str = "cuda", received: Optional[int] = None) -> int:
    """What an MoE layer keeps instead of the MLP's terms (module docstring), with `received` routed copies
    on this rank's experts (`routed_copies`: balanced routing unless given)."""
    m, d, p = config.model, dims(config, device), config.parallel
    e, h, T, Tr = d.e, d.h, d.bs, d.bs // d.r
    E, K, ep = m.num_experts, m.moe_router_topk, p.expert_model_parallel_size
    sent, balanced = routed_copies(config)
    N = balanced if received is None else received
    total = 4 * Tr * h + 4 * E * h if e < 4 else 0  # the router's fp32 input and weight
    if e < 4 and m.moe_shared_expert_intermediate_size is None:
        total -= e * Tr * h  # nothing keeps the norm's 16-bit output (norm_bytes books it) but the fp32 copy
    default_softmax = m.moe_router_score_function == "softmax" and not m.moe_router_pre_softmax
    if m.moe_router_score_function == "sigmoid":
        total += 4 * Tr * E + (4 * Tr * (K + 1) if K > 1 else 0)
    else:
        total += 4 * Tr * E + (4 * Tr * K if default_softmax else 0)
    total += 8 * Tr * K
    if not (default_softmax and e == 4 and m.moe_router_topk_scaling_factor is None and d.r == 1):
        total += e * T * K
    if m.moe_router_load_balancing_type != "none" and m.moe_aux_loss_coeff > 0:
        total += 4 * Tr * E + (4 * Tr if m.moe_router_score_function == "sigmoid" else 0)
        total += 4 * E * (d.b if m.moe_router_load_balancing_type == "seq_aux_loss" else 1)
    if m.moe_z_loss_coeff:
        total += (0 if default_softmax else 4 * Tr * E) + 4 * Tr
    total += 8 * T * K + 8 * sent + (16 * N if ep > 1 else 0)
    from megatron_lite.model.moe_options import expert_ffn_hidden_size

    total += e * N * h + mlp_inner_copies(m) * e * N * expert_ffn_hidden_size(m) // d.t
    total += e * (sent if ep > 1 else N) * h + e * T * K * h
    if m.moe_shared_expert_intermediate_size is not None:
        total += mlp_inner_copies(m) * e * T * m.moe_shared_expert_intermediate_size // d.t
        if m.moe_shared_expert_gate:
            total += (e * T + e * T * h) // d.r
    return total
