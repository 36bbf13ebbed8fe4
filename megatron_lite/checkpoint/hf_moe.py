"""Mixture-of-Experts layers of our GPT <-> Hugging Face's MoE causal LMs: what checkpoint/hf_mixtral.py,
hf_qwen2_moe.py and hf_qwen3_moe.py share (the attention, norms and embeddings are the Llama or Qwen3 tables).

An MoE layer's MLP (model/moe.py; layer i is our module 1+i, theirs model.layers.i):

    mlp.router.weight                  [E, h]      -> {block}.gate.weight
    mlp.experts.weight1                [E, 2F, h]  -> {block}.experts.e.{gate}.weight, .{up}.weight [F, h] per expert
    mlp.experts.weight2                [E, h, F]   -> {block}.experts.e.{down}.weight [h, F] per expert
    mlp.shared_expert.dense_h_to_4h    [2Fs, h]    -> mlp.shared_expert.gate_proj.weight, up_proj.weight [Fs, h]
    mlp.shared_expert.dense_4h_to_h    [h, Fs]     -> mlp.shared_expert.down_proj.weight
    mlp.shared_expert_gate             [1, h]      -> mlp.shared_expert_gate.weight
    mlp.router.expert_bias (a buffer)  [E]         -> {block}.gate.e_score_correction_bias (DeepSeek-V3's)

(DeepSeek-V3 names its shared expert mlp.shared_experts: `ExpertNames.shared`.)

Two spellings of the experts exist. save_pretrained writes one tensor per expert and projection (Mixtral's
{block} is block_sparse_moe with w1 = gate, w3 = up, w2 = down; the Qwen family's is mlp with
gate_proj/up_proj/down_proj); transformers 5 holds them fused in memory (state_dict()):
mlp.experts.gate_up_proj [E, 2F, h], gate rows first, and mlp.experts.down_proj [E, h, F], which are our
two stacks as they are, and the router as mlp.gate.weight. The importer reads either (`fused_names` tells
which a folder holds); the exporter writes save_pretrained's, which from_pretrained loads.

The routers: Mixtral takes the softmax over all experts, its top k, and divides them by their sum, which is
our default (the softmax over the top-k logits); the Qwen family divides only with norm_topk_prob, and without
it is our --moe-router-pre-softmax. None has an expert bias, group-limited routing or a scaling factor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional

from megatron_lite.checkpoint import hf_llama, hf_mapping
from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_fields import real, refusal, whole
from megatron_lite.checkpoint.hf_mapping import Mapped, StateDict
from megatron_lite.config import ModelConfig
from megatron_lite.model.moe_options import expert_ffn_hidden_size, is_moe_layer, moe_layer_pattern

FUSED_SUFFIX = ".experts.gate_up_proj"
DENSE_MLP = ("mlp.dense_h_to_4h.weight", "mlp.dense_4h_to_h.weight")


@dataclass(frozen=True)
class ExpertNames:
    """How an architecture's files name an MoE layer's tensors (save_pretrained's spelling)."""

    block: str
    """The MoE block's name in a layer: block_sparse_moe (Mixtral) or mlp (Qwen)."""
    gate: str
    up: str
    down: str
    shared: str = "shared_expert"
    """The shared expert's module in the layer's mlp (DeepSeek-V3: shared_experts)."""


def fused_names(names: Iterable[str]) -> bool:
    """Whether a folder's tensors spell the experts fused (transformers 5's state_dict()), not per expert."""
    return any(name.endswith(FUSED_SUFFIX) for name in names)


def layer_entries(m: ModelConfig, i: int, names: ExpertNames, fused: bool) -> List[Mapped]:
    """The MoE MLP's entries of layer i (0-based; our module 1+i)."""
    ours, layer = f"layers.{i + 1}.mlp.", f"model.layers.{i}."
    block = layer + ("mlp." if fused else names.block + ".")
    experts, ffn, h = m.num_experts, expert_ffn_hidden_size(m), m.hidden_size
    out = [Mapped(ours + "router.weight", (experts, h), (block + "gate.weight",), (experts,))]
    if m.moe_router_enable_expert_bias:  # saved with the layer (model/router.py), as transformers saves its buffer
        out.append(Mapped(ours + "router.expert_bias", (experts,), (block + "gate.e_score_correction_bias",),
                          (experts,)))
    if fused:
        out += [Mapped(ours + "experts.weight1", (experts, 2 * ffn, h), (block + "experts.gate_up_proj",), (experts,)),
                Mapped(ours + "experts.weight2", (experts, h, ffn), (block + "experts.down_proj",), (experts,))]
    else:
        per = f"{block}experts."
        out += [Mapped(ours + "experts.weight1", (experts, 2 * ffn, h),
                       tuple(f"{per}{e}.{p}.weight" for e in range(experts) for p in (names.gate, names.up)),
                       (ffn,) * (2 * experts), experts=experts),
                Mapped(ours + "experts.weight2", (experts, h, ffn),
                       tuple(f"{per}{e}.{names.down}.weight" for e in range(experts)), (h,) * experts, experts=experts)]
    shared = m.moe_shared_expert_intermediate_size
    if shared:
        theirs = f"{layer}mlp.{names.shared}."
        out += [Mapped(ours + "shared_expert.dense_h_to_4h.weight", (2 * shared, h),
                       (theirs + "gate_proj.weight", theirs + "up_proj.weight"), (shared, shared)),
                Mapped(ours + "shared_expert.dense_4h_to_h.weight", (h, shared), (theirs + "down_proj.weight",), (h,))]
        if m.moe_shared_expert_gate:
            out.append(Mapped(ours + "shared_expert_gate", (1, h), (layer + "mlp.shared_expert_gate.weight",), (1,)))
    return out


def to_hf(dense: StateDict, m: ModelConfig, mapping: Callable, flags: str) -> StateDict:
    """Our dense (TP = PP = 1) state dict -> the architecture's (`mapping(m)`), as save_pretrained writes it."""
    return hf_mapping.to_hf(dense, mapping(m), flags)


def from_hf(hf: StateDict, m: ModelConfig, mapping: Callable, flags: str) -> StateDict:
    """The architecture's state dict, in either spelling of the experts -> our dense one (a tied head as
    hf_llama.weights_of takes it)."""
    hf = hf_llama.weights_of(hf, m)
    return hf_mapping.from_hf(hf, mapping(m, fused_names(hf)), flags)


def with_experts(table: List[Mapped], m: ModelConfig, names: ExpertNames, fused: bool) -> List[Mapped]:
    """A dense table (Llama's, Qwen3's) with each MoE layer's dense MLP entries replaced by its experts'."""
    out = []
    for entry in table:
        parts = entry.ours.split(".", 2)
        if parts[0] == "layers" and parts[2] in DENSE_MLP and 1 <= int(parts[1]) <= m.num_layers \
                and is_moe_layer(m, int(parts[1])):
            if parts[2] == DENSE_MLP[0]:
                out += layer_entries(m, int(parts[1]) - 1, names, fused)
            continue
        out.append(entry)
    return out


def check_router(m: ModelConfig, architecture: str, renormalised: Optional[bool] = None) -> None:
    """The router and experts `architecture` has; refused naming our flag when the model's differ.
    `renormalised`: the architecture always divides the top-k weights by their sum (Mixtral), or never
    decides it here (None: the Qwen family's norm_topk_prob follows --moe-router-pre-softmax)."""
    refusals = [(m.moe_router_score_function != "softmax",
                 f"--moe-router-score-function {m.moe_router_score_function}", "scores experts by softmax"),
                (m.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias", "has no expert bias"),
                (m.moe_router_num_groups is not None, f"--moe-router-num-groups {m.moe_router_num_groups}",
                 "routes without expert groups"),
                (m.moe_router_topk_scaling_factor not in (None, 1.0),
                 f"--moe-router-topk-scaling-factor {m.moe_router_topk_scaling_factor}", "scales no routing weight"),
                (renormalised is True and m.moe_router_pre_softmax, "--moe-router-pre-softmax",
                 "divides the top-k weights by their sum (our default, without --moe-router-pre-softmax)")]
    for refused, flag, what in refusals:
        if refused:
            raise CheckpointError(f"{architecture} {what}; this model was built with {flag}, which it cannot hold")


def mlp_only_layers(m: ModelConfig) -> List[int]:
    """The Qwen family's mlp_only_layers (0-based) of our --moe-layer-freq: the layers without experts."""
    return [i for i, moe in enumerate(moe_layer_pattern(m)) if not moe]


def layer_freq(moe: List[bool]) -> str:
    """--moe-layer-freq for a per-layer pattern: 1 when every layer has experts, else the list."""
    return "1" if all(moe) else "[" + ",".join(str(int(x)) for x in moe) + "]"


def qwen_pattern(c: dict, where: str, layers: int) -> List[bool]:
    """Which layers (0-based) transformers' Qwen MoE models give experts: those not in mlp_only_layers whose
    number (1-based) decoder_sparse_step divides."""
    step = whole(c, "decoder_sparse_step", where, 1)
    dense = c.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(not isinstance(i, int) or not 0 <= i < layers for i in dense):
        raise refusal(where, "mlp_only_layers", dense, f"must list layer numbers from 0 to {layers - 1}")
    pattern = [i not in dense and (i + 1) % step == 0 for i in range(layers)]
    if not any(pattern):
        raise CheckpointError(f"{where}: decoder_sparse_step {step} and mlp_only_layers {dense} leave no layer with "
                              f"experts; import it as the dense model it is")
    return pattern


def router_fields(c: dict, where: str, experts: int) -> dict:
    """Our router fields shared by the three: experts, top-k, the aux-loss coefficient (router_aux_loss_coef:
    what the model was trained with, our --moe-aux-loss-coeff)."""
    topk = whole(c, "num_experts_per_tok", where)
    if topk > experts:
        raise CheckpointError(f"{where}: num_experts_per_tok = {topk} is more than the {experts} experts")
    return dict(num_experts=experts, moe_router_topk=topk,
                moe_aux_loss_coeff=real(c, "router_aux_loss_coef", where, 0.0, minimum=0, maximum=1e6))


def expert_count(c: dict, where: str, keys: tuple) -> int:
    """The expert count under whichever of `keys` config.json uses (Qwen3-MoE's config writes num_local_experts
    for its num_experts)."""
    for key in keys:
        if c.get(key) is not None:
            return whole(c, key, where)
    raise CheckpointError(f"{where}: lacks {keys[0]}, which the model's shape needs")
