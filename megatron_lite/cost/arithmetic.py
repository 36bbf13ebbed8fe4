"""Model arithmetic from the config alone: parameter counts and FLOPs.

The one place these numbers are computed; cost/stages.py (the pipeline split and what each stage
holds), cost/memory.py (the estimate), training/metrics.py (TFLOP/s, MFU) and tuning/ (the planner)
all ask here, and tests/cost/test_arithmetic.py checks them against built models at several TP x PP
layouts. No torch: the planner prices hundreds of layouts without building a layer.

The GPT is a list of specs (model/gpt.py `layer_specs`):
    0            embedding: word [V, h] (split over TP) + learned positions [P, h] (whole)
    1 .. L       transformer layers
    L + 1        final norm (LayerNorm: weight and bias, 2h; RMSNorm: weight, h)
    L + 2, L + 3 with --mtp-num-layers D: the embedding again (tied: what the depths embed their tokens
                 with; a full copy of the embedding module on a later stage), then the D depths
    last         head: the embedding again (tied; a full copy of the embedding module on a
                 later stage) or its own [V, h] weight (untied)
with V the padded vocabulary, h hidden, f FFN width, P max positions, t TP, a heads,
g key/value groups (a without grouped-query attention), d the head width (--kv-channels, h / a when
not given).

One transformer layer (model/transformer.py), each weight [out, in]:
    QKV          [(a + 2g) d, h]   split over TP by Q, K and V rows (parallel/qkv.py)
    projection   [h, a d]          split over TP by columns
    MLP in       [f, h]            GeLU; gated (--swiglu, --quick-geglu): [2f, h] (gate and up), split by rows
    MLP out      [h, f]            split over TP by columns
    biases       (a + 2g) d and f (2f gated) split, h and h whole; none with --disable-bias-linear,
                 but for the QKV's (a + 2g) d with --add-qkv-bias
    sinks        --softmax-type learnable: softmax_offset, one logit per head, a/t per rank
    two norms    2h each (LayerNorm) or h each (RMSNorm), whole on every rank
    QK-norm      --qk-layernorm: two norms of d (q and k; LayerNorm 2d each), whole on every rank

Under --multi-latent-attention (model/latent_attention.py; d_qk = d_n + d_r, d_v, q_l, c its widths) the QKV
and QK-norms are MLA's: q down [q_l, h] and kv down [c + d_r, h] with their biases (--add-bias-linear) and the
latent norms (--qk-layernorm) whole on every rank (replicated: like a norm), q up [a d_qk, q_l] (no --q-lora-rank:
q [a d_qk, h]) and kv up [a (d_n + d_v), c] split by heads; the projection is [h, a d_v] (`latent_attention_tensors`).

An MoE layer (model/moe.py; which layers: model/moe_options.py) has the same attention and norms, and
instead of the MLP, with E experts, k = --moe-router-topk, F the expert width, F_s the shared expert's,
EP the expert-parallel degree:
    router       [E, h] and a bias [E] (but with --disable-bias-linear), whole on every rank
    experts      [E/EP, F, h] ([E/EP, 2F, h] gated) and [E/EP, h, F], split over TP as the MLP (F/t);
                 biases [E/EP, F] (2F) split and [E/EP, h] whole; a rank holds E/EP of the E experts
    shared       the MLP above at width F_s (--moe-shared-expert-intermediate-size), if any
    gate         [1, h] whole (--moe-shared-expert-gate)
A token passes through the router, k experts and the shared expert: `active_parameters` counts those,
and the FLOPs (behind TFLOP/s and MFU) count k experts per token, never E.

Multi-Token Prediction (model/mtp.py, --mtp-num-layers D; `mtp_tensors`) adds D depths, each: enorm and hnorm
(norms over h), eh_proj [h, 2h] whole on every TP rank, a decoder layer of the last layer's kind (numbered L + k:
an MoE layer when the last layer is one, whose E - k unrouted experts `active_parameters` leaves out as in any
MoE layer) and a final norm. A token passes through them in training, so they count as Megatron-LM counts them
(training.py `num_floating_point_operations`): per depth its decoder layer, eh_proj (2 x 2h x h) and one more
head GEMM over its tokens; Megatron-LM's 3h of norms per depth are not matmuls, and we count no norm.

The weight matrices --optimizer muon steps: cost/matrices.py.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from megatron_lite.config import Config, ModelConfig, require_vocab
from megatron_lite.model.moe_options import expert_ffn_hidden_size, is_moe_layer, moe_layer_pattern
from megatron_lite.model.recompute_options import recompute_chunks


def mlp_in_width(model: ModelConfig) -> int:
    """Rows of the MLP's first weight: f, or 2f when gated (gate and up)."""
    return 2 * model.ffn_hidden_size if model.gated_linear_unit else model.ffn_hidden_size


def qkv_width(model: ModelConfig) -> int:
    """Rows of the fused QKV weight: (a + 2g) d, i.e. 3h without grouped-query attention and --kv-channels."""
    a = model.num_attention_heads
    return (a + 2 * (model.num_query_groups or a)) * model.head_dim


def attention_width(model: ModelConfig) -> int:
    """a d_v: the attention's inner width, the projection's input (h unless --kv-channels says otherwise;
    heads x --v-head-dim under MLA)."""
    return model.num_attention_heads * model.value_head_dim


def latent_attention_tensors(model: ModelConfig, tp: int = 1) -> List[int]:
    """MLA's weights before the projection on one TP rank (module docstring): each down projection [out, h],
    its bias and its latent's norm whole, each up projection split by heads."""
    h, heads, q, c = model.hidden_size, model.num_attention_heads, model.q_lora_rank, model.kv_lora_rank

    def down(out: int, latent: int) -> List[int]:
        norm = norm_tensors(model, latent) if model.qk_layernorm else []
        return [out * h] + ([out] if model.add_bias_linear else []) + norm

    whole = (down(q, q) if q else []) + down(c + model.qk_pos_emb_head_dim, c)
    split = [heads * model.head_dim * (q or h), heads * (model.qk_head_dim + model.v_head_dim) * c]
    return whole + [n // tp for n in split]


def norm_tensors(model: ModelConfig, size: Optional[int] = None) -> List[int]:
    """One norm's tensors: LayerNorm's weight and bias (h each, or `size`) or RMSNorm's weight (h)."""
    return [size or model.hidden_size] * (1 if model.normalization == "RMSNorm" else 2)


def qk_norm_tensors(model: ModelConfig) -> List[int]:
    """--qk-layernorm's two norms over one head's width d (query and key); none without it (nor under MLA,
    whose latent norms `latent_attention_tensors` counts)."""
    per_head = model.qk_layernorm and not model.multi_latent_attention
    return norm_tensors(model, model.head_dim) * 2 if per_head else []


def norm_parameters(model: ModelConfig) -> int:
    """One norm: LayerNorm's weight and bias (2h) or RMSNorm's weight (h)."""
    return sum(norm_tensors(model))


def mlp_tensors(model: ModelConfig, tp: int = 1, ffn: Optional[int] = None) -> List[int]:
    """The dense MLP (ParallelMLP) of width `ffn` (--ffn-hidden-size unless given) on one TP rank: [f, h]
    (gated [2f, h]) and [h, f] split, biases f (2f) split and h whole (added after the reduction)."""
    h, f = model.hidden_size, ffn or model.ffn_hidden_size
    inner = 2 * f if model.gated_linear_unit else f
    split = [inner * h, h * f] + ([inner] if model.add_bias_linear else [])
    return [n // tp for n in split] + ([h] if model.add_bias_linear else [])


def expert_tensors(model: ModelConfig, tp: int = 1, ep: int = 1) -> List[int]:
    """One MoE layer's routed experts on one rank: E/EP of them stacked (model/moe.py GroupedExperts),
    weight1 [E/EP, F/t, h] ([E/EP, 2F/t, h] gated), weight2 [E/EP, h, F/t], biases [E/EP, F/t] (2F/t) and
    [E/EP, h]. At ep = E: one expert."""
    h, f, local = model.hidden_size, expert_ffn_hidden_size(model), model.num_experts // ep
    inner = 2 * f if model.gated_linear_unit else f
    tensors = [local * inner * h // tp, local * h * f // tp]
    return tensors + ([local * inner // tp, local * h] if model.add_bias_linear else [])


def moe_mlp_tensors(model: ModelConfig, tp: int = 1, ep: int = 1) -> List[int]:
    """What an MoE layer has instead of the MLP, on one rank: router [E, h] and its bias [E] (with biases), this
    rank's experts (`expert_tensors`), the shared expert (an MLP of --moe-shared-expert-intermediate-size) and its
    gate [1, h]."""
    router = [model.num_experts * model.hidden_size] + ([model.num_experts] if model.add_bias_linear else [])
    tensors = router + expert_tensors(model, tp, ep)
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
    moe = layer_number is not None and is_moe_layer(model, layer_number)
    mlp = moe_mlp_tensors(model, tp, ep) if moe else mlp_tensors(model, tp)
    whole = norm_tensors(model) * 2 + qk_norm_tensors(model) + ([h] if model.add_bias_linear else [])
    sinks = [model.num_attention_heads] if model.softmax_type == "learnable" else []  # split with the heads
    if model.multi_latent_attention:
        split = [h * attention_width(model)] + sinks
        return latent_attention_tensors(model, tp) + [n // tp for n in split] + whole + mlp
    split = [qkv * h, h * attention_width(model)] + ([qkv] if model.qkv_bias else []) + sinks
    return [n // tp for n in split] + whole + mlp


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
    mtp = [embedding, mtp_tensors(m, t, e)] if m.mtp_num_layers else []  # its tied embedding copy, its depths
    return [embedding] + layers + [norm_tensors(m)] + mtp + [head]


def mtp_tensors(model: ModelConfig, tp: int = 1, ep: int = 1) -> List[int]:
    """Multi-Token Prediction's depths (model/mtp.py) on one rank, in parameter order: each its enorm and hnorm,
    eh_proj [h, 2h] (whole on every TP rank), a decoder layer of the last layer's kind (numbered L + k) and its
    final norm."""
    h = model.hidden_size
    return [x for k in range(1, (model.mtp_num_layers or 0) + 1)
            for x in (*norm_tensors(model), *norm_tensors(model), 2 * h * h,
                      *layer_tensors(model, tp, model.num_layers + k, ep), *norm_tensors(model))]


def embedding_specs(model: ModelConfig) -> List[int]:
    """The specs that are the embedding module (TiedLayerSpecs of one key): the embedding, Multi-Token Prediction's
    (L + 2) and the tied head (the last, but with --untie-embeddings-and-output-weights). A stage holding several
    builds one module (DeepSpeed's tied layers; GPTModel likewise); each stage holding any holds a full copy."""
    mtp = [model.num_layers + 2] if model.mtp_num_layers else []
    head = [] if model.untie_embeddings_and_output_weights else [model.num_layers + 2 + 2 * len(mtp)]
    return [0] + mtp + head


def spec_parameters(config: Config, tp: Optional[int] = None, ep: Optional[int] = None) -> List[int]:
    """Parameters each spec holds on one rank (`spec_tensors`, summed)."""
    return [sum(tensors) for tensors in spec_tensors(config, tp, ep)]


def total_parameters(config: Config) -> int:
    """Parameters of the whole model (TP = EP = 1: every expert once), the tied embedding counted once."""
    per_spec = spec_parameters(config, tp=1, ep=1)
    return sum(per_spec) - sum(per_spec[i] for i in embedding_specs(config.model)[1:])


def mtp_moe_layers(model: ModelConfig) -> int:
    """How many of the Multi-Token Prediction depths' decoder layers are MoE (all or none: the last layer's kind)."""
    return sum(is_moe_layer(model, model.num_layers + k) for k in range(1, (model.mtp_num_layers or 0) + 1))


def moe_layers(model: ModelConfig) -> int:
    """How many decoder layers are MoE, the Multi-Token Prediction depths' included (none without --num-experts)."""
    return sum(moe_layer_pattern(model)) + mtp_moe_layers(model)


def active_parameters(config: Config) -> int:
    """Parameters a token passes through: `total_parameters` less, in every MoE layer (a Multi-Token Prediction
    depth's too), the E - k routed experts it is not sent to (the router, the shared expert and everything dense
    count whole). What MoE papers quote as "active" (DeepSeek-V3's 37B leave its MTP module out, which a
    token passes through in training) and what the FLOPs per token follow; the total without --num-experts."""
    m = config.model
    if m.num_experts is None:
        return total_parameters(config)
    one_expert = sum(expert_tensors(m, tp=1, ep=m.num_experts))
    return total_parameters(config) - moe_layers(m) * (m.num_experts - m.moe_router_topk) * one_expert


def mlp_forward_flops(model: ModelConfig, ffn: Optional[int] = None) -> float:
    """Forward FLOPs per token of the dense MLP of width `ffn` (--ffn-hidden-size unless given): two
    matmuls of h x f, three when gated (SwiGLU, quick-GeGLU), 2 FLOPs per multiply-add."""
    return 2.0 * (3 if model.gated_linear_unit else 2) * model.hidden_size * (ffn or model.ffn_hidden_size)


def moe_forward_flops(model: ModelConfig) -> float:
    """Forward FLOPs per token of an MoE layer's MLP, active experts only: the router's logits (2 h E), k
    experts' MLPs of width F, the shared expert and its gate (2 h); the weighted sum of the k outputs is
    elementwise (model/moe.py), not a matmul, so neither this count nor torch's FLOP counter has it. Dropless
    routing sends every token to k experts whatever the balance; with a capacity the dropped copies are not
    computed, counted all the same (as Megatron-LM counts)."""
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


def attention_projection_flops(model: ModelConfig) -> float:
    """Forward FLOPs per token of the attention's linears, 2 per multiply-add: the QKV ((a + 2g) d outputs) and
    the projection (a d -> h), or MLA's down, up and output projections. The MLA terms are Megatron-LM's
    (training.py `num_floating_point_operations`, its multi_latent_attention branch: q_term, the kv lora and
    rope terms, o proj) less its latent norms' q_l + c per token, which are not matmuls: we count no norm."""
    h, heads = model.hidden_size, model.num_attention_heads
    if not model.multi_latent_attention:
        return 2.0 * (qkv_width(model) + attention_width(model)) * h
    q = model.q_lora_rank
    query = q * (h + heads * model.head_dim) if q else h * heads * model.head_dim
    kv = (model.kv_lora_rank * (h + heads * (model.qk_head_dim + model.v_head_dim))
          + h * model.qk_pos_emb_head_dim)
    return 2.0 * (query + kv + attention_width(model) * h)


def layer_forward_flops(model: ModelConfig, causal: bool, attention_share: float = 1.0,
                        layer_number: Optional[int] = None) -> float:
    """Forward FLOPs per token of one transformer layer: the attention's linears (`attention_projection_flops`:
    grouped keys and values cost 2 g d h each, not 2h^2) and MLP matmuls (two of h x f, three when gated;
    2 FLOPs per multiply-add; an MoE layer's: `moe_forward_flops`) plus the two attention matmuls over s keys
    (`attention_core_forward_flops`); `causal` counts the s/2 keys a token attends to on average (Megatron-LM's
    accounting, and what training_flops_per_token counts), otherwise all s (what the fused path computes and
    torch's FLOP counter counts). Norms are not matmuls and not counted (QK-norm and MLA's latent norms neither).
    attention_share: the part of those attention matmuls computed (documents attended one by one skip the blocks
    between them: model/attention_mask.py), applied after the halving: a share of the whole square, halved, is the
    causal half of each document's own square. layer_number (from 1) says whether the layer is MoE; None: a dense
    layer."""
    moe = layer_number is not None and is_moe_layer(model, layer_number)
    mlp = moe_forward_flops(model) if moe else mlp_forward_flops(model)
    core = attention_core_forward_flops(model) * (0.5 if causal else 1.0)
    return attention_projection_flops(model) + mlp + core * attention_share


def head_forward_flops(model: ModelConfig) -> float:
    """The head matmul (2 h V per token)."""
    return 2.0 * model.hidden_size * model.padded_vocab_size


def mtp_forward_flops(model: ModelConfig, causal: bool, attention_share: float = 1.0) -> float:
    """Forward FLOPs per token of the Multi-Token Prediction depths (model/mtp.py): each its eh_proj (2 x 2h x h)
    and its decoder layer (numbered L + k: `layer_forward_flops`, `causal` and `attention_share` as there); their
    head GEMMs (one `head_forward_flops` per depth) apart. No norm, no embedding lookup (not matmuls)."""
    h, layers = model.hidden_size, model.num_layers
    return sum(4.0 * h * h + layer_forward_flops(model, causal, attention_share, layers + k)
               for k in range(1, (model.mtp_num_layers or 0) + 1))


def attention_scores_forward_flops(model: ModelConfig) -> float:
    """Forward FLOPs per token of the scores q k^T over all s keys: 2 s a d (d = d_n + d_r under MLA)."""
    return 2.0 * model.seq_length * model.num_attention_heads * model.head_dim


def attention_core_forward_flops(model: ModelConfig) -> float:
    """Forward FLOPs per token of the attention core over all s keys: the scores and x V (2 s a d_v; d_v = d
    but under MLA)."""
    return attention_scores_forward_flops(model) + 2.0 * model.seq_length * attention_width(model)


def recompute_forward_flops_per_token(model: ModelConfig, layers_per_stage: Optional[Sequence[int]] = None,
                                      attention_share: float = 1.0, first_layer: int = 1,
                                      depths: Optional[int] = None, *, causal: bool) -> float:
    """Forward FLOPs per token that recompute runs again over the whole model. torch's checkpoint stops
    recomputing once it has rebuilt every tensor backward needs (set_checkpoint_early_stop, on by
    default), so the last matmul of a recomputed region, whose output nothing keeps, is not run again:
      selective  each layer's scores matmul (2 s a d; not x V)
      full       each recomputed chunk's layers but its last MLP matmul (2hf; MoE: `_last_matmul_flops`)
    layers_per_stage: transformer layers on each pipeline stage (default: one stage), which the chunks
    of --recompute-method count per stage, the first stage starting at layer `first_layer` (which
    layers are MoE); attention_share: as training_flops_per_token's. depths: the Multi-Token Prediction depths
    among them (default: all the model's), whose layers selective recompute reruns as any; full recompute runs
    the stages' transformer layers again, not the depths' (model/recompute.py). causal: the attention rerun over
    the s/2 keys a token attends to (as the logged count has the forward's: training_flops_per_token), or over
    all s (what the fused path runs again; checked against torch's FLOP counter)."""
    m = model
    stages = layers_per_stage if layers_per_stage is not None else [m.num_layers]
    if m.recompute_granularity == "selective":
        # The scores, not x V; documents attended one by one (a share below 1) rerun x V too, all but the
        # micro-batch's last document's (whose output nothing keeps): counted whole.
        rerun = attention_scores_forward_flops(m) if attention_share == 1.0 else attention_core_forward_flops(m)
        mtp = (m.mtp_num_layers or 0) if depths is None else depths
        return (sum(stages) + mtp) * rerun * (0.5 if causal else 1.0) * attention_share
    if m.recompute_granularity != "full":
        return 0.0
    total, offset = 0.0, first_layer
    for layers in stages:
        for start, end, again in recompute_chunks(m.recompute_method, m.recompute_num_layers, layers):
            if again:
                numbers = range(offset + start, offset + end)
                total += (sum(layer_forward_flops(m, causal, attention_share, n) for n in numbers)
                          - _last_matmul_flops(m, numbers[-1]))
        offset += layers
    return total


def training_flops_per_token(model: ModelConfig, layers_per_stage: Optional[Sequence[int]] = None,
                             attention_share: float = 1.0, *, causal: bool = True) -> float:
    """The count behind TFLOP/s and MFU, Megatron-LM's (training.py `num_floating_point_operations`) term by term
    but where tests/cost/test_megatron_flops.py shows otherwise: 3x the forward (forward, two backward matmuls),
    plus what activation recompute runs again (recompute_forward_flops_per_token; Megatron-LM counts none). The
    attention core counts the causal half of the keys as Megatron-LM does (model FLOPs: the masked half is not
    work, whether or not a kernel computes it), in the forward and in what recompute reruns alike; causal=False
    counts every key, as torch's FLOP counter does. attention_share (model/attention_mask.py AttentionWork, below
    1 when documents are attended one by one) scales that halved core: the causal half of each document's square.
    A sliding window or a document mask computed through the mask has share 1: counted as plain causal attention.
    MoE layers count the k experts a token is routed to (`moe_forward_flops`; the router's GEMM too, which
    Megatron-LM leaves out), so MFU follows active parameters, not total. Multi-Token Prediction's depths add their
    eh_proj and decoder layer (`mtp_forward_flops`) and a head GEMM each, as Megatron-LM adds them; the cross
    entropy, like every elementwise op (norms included, which Megatron-LM counts under MLA and MTP), is not
    counted."""
    v = model.padded_vocab_size or model.vocab_size or 0
    layers = 3 * sum(layer_forward_flops(model, causal, attention_share, n) for n in range(1, model.num_layers + 1))
    heads = 1 + (model.mtp_num_layers or 0)
    return (layers + 3 * mtp_forward_flops(model, causal, attention_share)
            + recompute_forward_flops_per_token(model, layers_per_stage, attention_share, causal=causal)
            + 3 * 2 * model.hidden_size * v * heads)
