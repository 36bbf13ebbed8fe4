"""Model arithmetic from the config alone: parameter counts and FLOPs.

The one place these numbers are computed; cost/stages.py (the pipeline split and what each stage
holds), cost/memory.py (the estimate), training/metrics.py (TFLOP/s, MFU) and tuning/ (the planner)
all ask here, and tests/cost/test_arithmetic.py checks them against built models at several TP x PP
layouts. No torch: the planner prices hundreds of layouts without building a layer.

The GPT is a list of specs (model/gpt.py `layer_specs`):
    0            embedding: word [V, h] (split over TP) + learned positions [P, h] (whole)
    1 .. L       transformer layers
    L + 1        final norm (LayerNorm: weight and bias, 2h; RMSNorm: weight, h)
    L + 2        head: the embedding again (tied; a full copy of the embedding module on a
                 later stage) or its own [V, h] weight (untied)
with V the padded vocabulary, h hidden, f FFN width, P max positions, t TP, a heads,
g key/value groups (a without grouped-query attention), d the head width (--kv-channels, h / a when
not given).

One transformer layer (model/transformer.py), each weight [out, in]:
    QKV          [(a + 2g) d, h]   split over TP by Q, K and V rows (parallel/qkv.py)
    projection   [h, a d]          split over TP by columns
    MLP in       [f, h]            GeLU; SwiGLU: [2f, h] (gate and up), split over TP by rows
    MLP out      [h, f]            split over TP by columns
    biases       (a + 2g) d and f (2f SwiGLU) split, h and h whole; none with --disable-bias-linear,
                 but for the QKV's (a + 2g) d with --add-qkv-bias
    two norms    2h each (LayerNorm) or h each (RMSNorm), whole on every rank
    QK-norm      --qk-layernorm: two norms of d (q and k; LayerNorm 2d each), whole on every rank

An MoE layer (model/moe.py; which layers: model/moe_options.py) has the same attention and norms, and
instead of the MLP, with E experts, k = --moe-router-topk, F the expert width, F_s the shared expert's,
EP the expert-parallel degree:
    router       [E, h]                     whole on every rank
    experts      [E/EP, F, h] ([E/EP, 2F, h] SwiGLU) and [E/EP, h, F], split over TP as the MLP (F/t);
                 biases [E/EP, F] (2F) split and [E/EP, h] whole; a rank holds E/EP of the E experts
    shared       the MLP above at width F_s (--moe-shared-expert-intermediate-size), if any
    gate         [1, h] whole (--moe-shared-expert-gate)
A token passes through the router, k experts and the shared expert: `active_parameters` counts those,
and the FLOPs (behind TFLOP/s and MFU) count k experts per token, never E.

--optimizer muon steps the layers' weight matrices (`layer_matrices`: QKV, projection, the MLPs' two, every
routed expert's two); the router, the gate, norms, biases, embeddings and the head stay AdamW.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from megatron_lite.config import Config, ModelConfig, require_vocab
from megatron_lite.model.moe_options import expert_ffn_hidden_size, is_moe_layer, moe_layer_pattern
from megatron_lite.model.recompute_options import recompute_chunks


def mlp_in_width(model: ModelConfig) -> int:
    """Rows of the MLP's first weight: f, or 2f under SwiGLU (gate and up)."""
    return 2 * model.ffn_hidden_size if model.swiglu else model.ffn_hidden_size


def qkv_width(model: ModelConfig) -> int:
    """Rows of the fused QKV weight: (a + 2g) d, i.e. 3h without grouped-query attention and --kv-channels."""
    a = model.num_attention_heads
    return (a + 2 * (model.num_query_groups or a)) * model.head_dim


def attention_width(model: ModelConfig) -> int:
    """a d: the attention's inner width, the projection's input (h unless --kv-channels says otherwise)."""
    return model.num_attention_heads * model.head_dim


def norm_tensors(model: ModelConfig, size: Optional[int] = None) -> List[int]:
    """One norm's tensors: LayerNorm's weight and bias (h each, or `size`) or RMSNorm's weight (h)."""
    return [size or model.hidden_size] * (1 if model.normalization == "RMSNorm" else 2)


def qk_norm_tensors(model: ModelConfig) -> List[int]:
    """--qk-layernorm's two norms over one head's width d (query and key); none without it."""
    return norm_tensors(model, model.head_dim) * 2 if model.qk_layernorm else []


def norm_parameters(model: ModelConfig) -> int:
    """One norm: LayerNorm's weight and bias (2h) or RMSNorm's weight (h)."""
    return sum(norm_tensors(model))


def mlp_tensors(model: ModelConfig, tp: int = 1, ffn: Optional[int] = None) -> List[int]:
    """The dense MLP (ParallelMLP) of width `ffn` (--ffn-hidden-size unless given) on one TP rank: [f, h]
    (SwiGLU [2f, h]) and [h, f] split, biases f (2f) split and h whole (added after the reduction)."""
    h, f = model.hidden_size, ffn or model.ffn_hidden_size
    inner = 2 * f if model.swiglu else f
    split = [inner * h, h * f] + ([inner] if model.add_bias_linear else [])
    return [n // tp for n in split] + ([h] if model.add_bias_linear else [])


def expert_tensors(model: ModelConfig, tp: int = 1, ep: int = 1) -> List[int]:
    """One MoE layer's routed experts on one rank: E/EP of them stacked (model/moe.py GroupedExperts),
    weight1 [E/EP, F/t, h] ([E/EP, 2F/t, h] SwiGLU), weight2 [E/EP, h, F/t], biases [E/EP, F/t] (2F/t) and
    [E/EP, h]. At ep = E: one expert."""
    h, f, local = model.hidden_size, expert_ffn_hidden_size(model), model.num_experts // ep
    inner = 2 * f if model.swiglu else f
    tensors = [local * inner * h // tp, local * h * f // tp]
    return tensors + ([local * inner // tp, local * h] if model.add_bias_linear else [])


def moe_mlp_tensors(model: ModelConfig, tp: int = 1, ep: int = 1) -> List[int]:
    """What an MoE layer has instead of the MLP, on one rank: router [E, h], this rank's experts
    (`expert_tensors`), the shared expert (an MLP of --moe-shared-expert-intermediate-size) and its gate [1, h]."""
    tensors = [model.num_experts * model.hidden_size] + expert_tensors(model, tp, ep)
    if model.moe_shared_expert_intermediate_size is not None:
        tensors += mlp_tensors(model, tp, model.moe_shared_expert_intermediate_size)
        tensors += [model.hidden_size] if model.moe_shared_expert_gate else []
    return tensors


def layer_tensors(model: ModelConfig, tp: int = 1, layer_number: Optional[int] = None, ep: int = 1) -> List[int]:
    """Elements of each parameter tensor of one transformer layer on one TP rank (the layout in the
    module docstring): what DeepSpeed's ZeRO 3 partitions or keeps whole tensor by tensor. Validation
    makes every split part (a d, g d, f) divisible by TP; a rank sharing a key/value group with others
    (g < TP) holds a 1/TP piece of the K and V rows all the same (parallel/qkv.py). layer_number (from 1):
    an MoE layer (model/moe_options.py) has `moe_mlp_tensors`, E/EP experts at `ep`; None: a dense layer."""
    h, qkv = model.hidden_size, qkv_width(model)
    split = [qkv * h, h * attention_width(model)] + ([qkv] if model.qkv_bias else [])
    whole = norm_tensors(model) * 2 + qk_norm_tensors(model) + ([h] if model.add_bias_linear else [])
    moe = layer_number is not None and is_moe_layer(model, layer_number)
    mlp = moe_mlp_tensors(model, tp, ep) if moe else mlp_tensors(model, tp)
    return [n // tp for n in split] + whole + mlp


@dataclass(frozen=True)
class HiddenMatrix:
    """A weight Muon steps (parallel/layers.py tags it `hidden_matrix`): `copies` stacked [rows, cols] matrices
    (a rank's E/EP experts, else 1), each whole over TP, which splits `partition_dim` (0: the rows of a
    column-parallel weight, 1: the columns of a row-parallel one) section by section; `sections`: the lengths
    along it of its fused parts (`fused` 'qkv': Q, K, V; 'gate_up': SwiGLU's halves), else the whole."""
    rows: int
    cols: int
    partition_dim: int
    sections: Tuple[int, ...]
    copies: int = 1
    fused: Optional[str] = None
    expert: bool = False

    def elements(self, tp: int = 1) -> int:
        """Values one TP rank holds."""
        return self.copies * self.rows * self.cols // tp


def mlp_matrices(model: ModelConfig, ffn: Optional[int] = None, copies: int = 1, expert: bool = False
                 ) -> List[HiddenMatrix]:
    """The MLP's [f, h] ([2f, h] SwiGLU: gate and up) and [h, f] weights (`copies` stacked for experts)."""
    h, f = model.hidden_size, ffn or model.ffn_hidden_size
    first = (HiddenMatrix(2 * f, h, 0, (f, f), copies, "gate_up", expert) if model.swiglu
             else HiddenMatrix(f, h, 0, (f,), copies, None, expert))
    return [first, HiddenMatrix(h, f, 1, (f,), copies, None, expert)]


def layer_matrices(model: ModelConfig, layer_number: Optional[int] = None, ep: int = 1) -> List[HiddenMatrix]:
    """One transformer layer's weights that --optimizer muon steps, in the layer's parameter order: QKV
    ((a + 2g) d x h, sections Q, K, V), the projection (h x a d), then the dense MLP's two, or an MoE layer's
    E/EP experts' two (stacked) and the shared expert's two (`layer_tensors` holds them all)."""
    h, q, kv = model.hidden_size, attention_width(model), (model.num_query_groups or model.num_attention_heads)
    kv *= model.head_dim
    attention = [HiddenMatrix(q + 2 * kv, h, 0, (q, kv, kv), fused="qkv"), HiddenMatrix(h, q, 1, (q,))]
    if layer_number is None or not is_moe_layer(model, layer_number):
        return attention + mlp_matrices(model)
    shared = model.moe_shared_expert_intermediate_size
    return (attention + mlp_matrices(model, expert_ffn_hidden_size(model), model.num_experts // ep, expert=True)
            + (mlp_matrices(model, shared) if shared is not None else []))


def layer_parameters(model: ModelConfig, tp: int = 1, layer_number: Optional[int] = None, ep: int = 1) -> int:
    """One transformer layer on one TP rank (`layer_tensors`)."""
    return sum(layer_tensors(model, tp, layer_number, ep))


def embedding_tensors(model: ModelConfig, tp: int = 1) -> List[int]:
    """Word embedding [V/t, h] plus the learned position table [P, h] (rotary has none)."""
    learned = model.position_embedding_type == "learned_absolute"
    positions = [model.max_position_embeddings * model.hidden_size] if learned else []
    return [model.padded_vocab_size * model.hidden_size // tp] + positions


def embedding_parameters(model: ModelConfig, tp: int = 1) -> int:
    """Word embedding and learned positions on one TP rank (`embedding_tensors`)."""
    return sum(embedding_tensors(model, tp))


def spec_tensors(config: Config, tp: Optional[int] = None, ep: Optional[int] = None) -> List[List[int]]:
    """Elements of each parameter tensor each spec holds on one rank (TP and EP of the config unless `tp`,
    `ep`), in spec order. The tied head reports the embedding module it uses: a full copy when on another stage."""
    m = require_vocab(config)
    t = config.parallel.tensor_model_parallel_size if tp is None else tp
    e = config.parallel.expert_model_parallel_size if ep is None else ep
    embedding = embedding_tensors(m, t)
    head = [m.padded_vocab_size * m.hidden_size // t] if m.untie_embeddings_and_output_weights else embedding
    # A layer's tensors depend only on whether it is MoE: made once per kind (a 104-layer model's plan
    # asked for every layer's thousands of times), a copy per layer.
    kinds = [is_moe_layer(m, i) for i in range(1, m.num_layers + 1)]
    per_kind = {moe: layer_tensors(m, t, kinds.index(moe) + 1, e) for moe in set(kinds)}
    layers = [list(per_kind[moe]) for moe in kinds]
    return [embedding] + layers + [norm_tensors(m), head]


def spec_parameters(config: Config, tp: Optional[int] = None, ep: Optional[int] = None) -> List[int]:
    """Parameters each spec holds on one rank (`spec_tensors`, summed)."""
    return [sum(tensors) for tensors in spec_tensors(config, tp, ep)]


def total_parameters(config: Config) -> int:
    """Parameters of the whole model (TP = EP = 1: every expert once), the tied embedding counted once."""
    per_spec = spec_parameters(config, tp=1, ep=1)
    return sum(per_spec) - (0 if config.model.untie_embeddings_and_output_weights else per_spec[-1])


def moe_layers(model: ModelConfig) -> int:
    """How many layers are MoE (none without --num-experts)."""
    return sum(moe_layer_pattern(model))


def active_parameters(config: Config) -> int:
    """Parameters a token passes through: `total_parameters` less, in every MoE layer, the E - k routed
    experts it is not sent to (the router, the shared expert and everything dense count whole). What
    MoE papers quote as "active" and what the FLOPs per token follow; the dense model's total without
    --num-experts."""
    m = config.model
    if m.num_experts is None:
        return total_parameters(config)
    one_expert = sum(expert_tensors(m, tp=1, ep=m.num_experts))
    return total_parameters(config) - moe_layers(m) * (m.num_experts - m.moe_router_topk) * one_expert


def mlp_forward_flops(model: ModelConfig, ffn: Optional[int] = None) -> float:
    """Forward FLOPs per token of the dense MLP of width `ffn` (--ffn-hidden-size unless given): two
    matmuls of h x f, three under SwiGLU, 2 FLOPs per multiply-add."""
    return 2.0 * (3 if model.swiglu else 2) * model.hidden_size * (ffn or model.ffn_hidden_size)


def moe_forward_flops(model: ModelConfig) -> float:
    """Forward FLOPs per token of an MoE layer's MLP, active experts only: the router's logits (2 h E), k
    experts' MLPs of width F, the shared expert and its gate (2 h); the weighted sum of the k outputs is
    elementwise (model/moe.py), not a matmul, so neither this count nor torch's FLOP counter has it. Dropless routing sends every token to k experts whatever the balance;
    with a capacity the dropped copies are not computed, counted all the same (as Megatron-LM counts)."""
    h, k = model.hidden_size, model.moe_router_topk
    flops = 2.0 * h * model.num_experts + k * mlp_forward_flops(model, expert_ffn_hidden_size(model))
    if model.moe_shared_expert_intermediate_size is not None:
        flops += mlp_forward_flops(model, model.moe_shared_expert_intermediate_size)
        flops += 2.0 * h if model.moe_shared_expert_gate else 0.0
    return flops


def _last_matmul_flops(model: ModelConfig, layer_number: Optional[int]) -> float:
    """The MLP's last matmul, whose output nothing keeps (full recompute does not run it again, see
    recompute_forward_flops_per_token): the dense MLP's output projection (2 h f); in an MoE layer the
    shared expert's output projection; none without a shared expert (the layer ends with the elementwise
    weighted sum) or with its gate (whose product keeps the shared expert's output)."""
    if layer_number is None or not is_moe_layer(model, layer_number):
        return 2.0 * model.hidden_size * model.ffn_hidden_size
    shared = model.moe_shared_expert_intermediate_size
    if shared is None or model.moe_shared_expert_gate:
        return 0.0
    return 2.0 * model.hidden_size * shared


def layer_forward_flops(model: ModelConfig, causal: bool, attention_share: float = 1.0,
                        layer_number: Optional[int] = None) -> float:
    """Forward FLOPs per token of one transformer layer: the QKV ((a + 2g) d outputs: grouped keys and
    values cost 2 g d h each, not 2h^2), projection (a d -> h) and MLP matmuls (two of h x f, three under
    SwiGLU; 2 FLOPs per multiply-add; an MoE layer's: `moe_forward_flops`) plus the two attention matmuls
    over s keys (every query head, so 2 s a d each whatever g); `causal` counts the s/2 keys a token
    attends to on average, otherwise all s (Megatron-LM's accounting). Norms are not matmuls and not
    counted (QK-norm neither). attention_share: the part of those attention matmuls computed (documents
    attended one by one skip the blocks between them: model/attention_mask.py). layer_number (from 1)
    says whether the layer is MoE; None: a dense layer."""
    h, s = model.hidden_size, model.seq_length
    inner = attention_width(model)
    moe = layer_number is not None and is_moe_layer(model, layer_number)
    mlp = moe_forward_flops(model) if moe else mlp_forward_flops(model)
    return (2 * (qkv_width(model) * h + inner * h) + mlp
            + (2 if causal else 4) * s * inner * attention_share)


def head_forward_flops(model: ModelConfig) -> float:
    """The head matmul (2 h V per token)."""
    return 2.0 * model.hidden_size * model.padded_vocab_size


def attention_core_forward_flops(model: ModelConfig) -> float:
    """Forward FLOPs per token of the attention core (scores and x V over all s keys of a heads of d)."""
    return 4.0 * model.seq_length * attention_width(model)


def recompute_forward_flops_per_token(model: ModelConfig, layers_per_stage: Optional[Sequence[int]] = None,
                                      attention_share: float = 1.0, first_layer: int = 1) -> float:
    """Forward FLOPs per token that recompute runs again over the whole model. torch's checkpoint stops
    recomputing once it has rebuilt every tensor backward needs (set_checkpoint_early_stop, on by
    default), so the last matmul of a recomputed region, whose output nothing keeps, is not run again:
      selective  each layer's scores matmul (2sh; not x V)
      full       each recomputed chunk's layers but its last MLP matmul (2hf; MoE: `_last_matmul_flops`)
    layers_per_stage: transformer layers on each pipeline stage (default: one stage), which the chunks
    of --recompute-method count per stage, the first stage starting at layer `first_layer` (which
    layers are MoE); attention_share: as training_flops_per_token's. Checked against torch's FLOP counter."""
    m = model
    stages = layers_per_stage if layers_per_stage is not None else [m.num_layers]
    if m.recompute_granularity == "selective":
        # The scores, not x V; documents attended one by one (a share below 1) rerun x V too, all but the
        # micro-batch's last document's (whose output nothing keeps): counted whole.
        rerun = 0.5 if attention_share == 1.0 else 1.0
        return sum(stages) * attention_core_forward_flops(m) * attention_share * rerun
    if m.recompute_granularity != "full":
        return 0.0
    total, offset = 0.0, first_layer
    for layers in stages:
        for start, end, again in recompute_chunks(m.recompute_method, m.recompute_num_layers, layers):
            if again:
                numbers = range(offset + start, offset + end)
                total += (sum(layer_forward_flops(m, False, attention_share, n) for n in numbers)
                          - _last_matmul_flops(m, numbers[-1]))
        offset += layers
    return total


def training_flops_per_token(model: ModelConfig, layers_per_stage: Optional[Sequence[int]] = None,
                             attention_share: float = 1.0) -> float:
    """Megatron-LM's count behind TFLOP/s and MFU: 3x the forward (forward, two backward matmuls),
    plus what activation recompute runs again (recompute_forward_flops_per_token); attention counted
    over all s keys, times the share of it computed (attention_share: model/attention_mask.py
    AttentionWork, below 1 when documents are attended one by one). MoE layers count the k experts a
    token is routed to (`moe_forward_flops`), so MFU follows active parameters, not total."""
    v = model.padded_vocab_size or model.vocab_size or 0
    layers = 3 * sum(layer_forward_flops(model, False, attention_share, n) for n in range(1, model.num_layers + 1))
    return (layers + recompute_forward_flops_per_token(model, layers_per_stage, attention_share)
            + 3 * 2 * model.hidden_size * v)

