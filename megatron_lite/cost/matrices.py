"""The weight matrices --optimizer muon steps (training/muon.py), from the config alone: their shapes, how TP
splits them and which are experts'. cost/muon.py prices their step, cost/model_state.py their one moment, and
cost/stages.py gathers each stage's.

The layers' matrices (parallel/layers.py tags them `hidden_matrix`): the QKV or MLA's down and up projections,
the projection, the MLPs' two, every routed expert's two; Multi-Token Prediction's depths add their eh_proj [h, 2h]
(whole on every TP rank) before their decoder layer's. The router (and its bias), the gate, norms, biases, the
attention sinks (softmax_offset), embeddings and the head stay AdamW.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from megatron_lite.config import ModelConfig
from megatron_lite.cost.arithmetic import attention_width
from megatron_lite.model.moe_options import expert_ffn_hidden_size, is_moe_layer


@dataclass(frozen=True)
class HiddenMatrix:
    """A weight Muon steps (parallel/layers.py tags it `hidden_matrix`): `copies` stacked [rows, cols] matrices
    (a rank's E/EP experts, else 1), each whole over TP, which splits `partition_dim` (0: the rows of a
    column-parallel weight, 1: the columns of a row-parallel one, -1: none, whole on every rank: MLA's down
    projections, Multi-Token Prediction's eh_proj) section by section; `sections`: the lengths along it of its
    fused parts (`fused` 'qkv': Q, K, V; 'gate_up': a gated MLP's halves), else the whole."""
    rows: int
    cols: int
    partition_dim: int
    sections: Tuple[int, ...]
    copies: int = 1
    fused: Optional[str] = None
    expert: bool = False

    @property
    def replicated(self) -> bool:
        return self.partition_dim < 0

    def elements(self, tp: int = 1) -> int:
        """Values one TP rank holds."""
        return self.copies * self.rows * self.cols // (1 if self.replicated else tp)


def mlp_matrices(model: ModelConfig, ffn: Optional[int] = None, copies: int = 1, expert: bool = False
                 ) -> List[HiddenMatrix]:
    """The MLP's [f, h] ([2f, h] gated: gate and up) and [h, f] weights (`copies` stacked for experts)."""
    h, f = model.hidden_size, ffn or model.ffn_hidden_size
    first = (HiddenMatrix(2 * f, h, 0, (f, f), copies, "gate_up", expert) if model.gated_linear_unit
             else HiddenMatrix(f, h, 0, (f,), copies, None, expert))
    return [first, HiddenMatrix(h, f, 1, (f,), copies, None, expert)]


def latent_attention_matrices(model: ModelConfig) -> List[HiddenMatrix]:
    """MLA's matrices before the projection, in its parameter order: q down (whole on every rank) and q up, or
    the one q projection; kv down (whole) and kv up (module docstring)."""
    h, q, c = model.hidden_size, model.q_lora_rank, model.kv_lora_rank
    q_up, kv_up = model.num_attention_heads * model.head_dim, model.num_attention_heads * (
        model.qk_head_dim + model.v_head_dim)
    kv_down = c + model.qk_pos_emb_head_dim
    query = ([HiddenMatrix(q, h, -1, (q,)), HiddenMatrix(q_up, q, 0, (q_up,))] if q
             else [HiddenMatrix(q_up, h, 0, (q_up,))])
    return query + [HiddenMatrix(kv_down, h, -1, (kv_down,)), HiddenMatrix(kv_up, c, 0, (kv_up,))]


def layer_matrices(model: ModelConfig, layer_number: Optional[int] = None, ep: int = 1) -> List[HiddenMatrix]:
    """One transformer layer's weights that --optimizer muon steps, in the layer's parameter order: QKV
    ((a + 2g) d x h, sections Q, K, V) or MLA's four (three without --q-lora-rank: `latent_attention_matrices`),
    the projection (h x a d), then the dense MLP's two, or an MoE layer's E/EP experts' two (stacked) and the
    shared expert's two (`layer_tensors` holds them all)."""
    h, q, kv = model.hidden_size, attention_width(model), (model.num_query_groups or model.num_attention_heads)
    kv *= model.head_dim
    attention = ([*latent_attention_matrices(model), HiddenMatrix(h, q, 1, (q,))] if model.multi_latent_attention
                 else [HiddenMatrix(q + 2 * kv, h, 0, (q, kv, kv), fused="qkv"), HiddenMatrix(h, q, 1, (q,))])
    if layer_number is None or not is_moe_layer(model, layer_number):
        return attention + mlp_matrices(model)
    shared = model.moe_shared_expert_intermediate_size
    return (attention + mlp_matrices(model, expert_ffn_hidden_size(model), model.num_experts // ep, expert=True)
            + (mlp_matrices(model, shared) if shared is not None else []))


def mtp_matrices(model: ModelConfig, ep: int = 1) -> List[HiddenMatrix]:
    """Multi-Token Prediction's depths' matrices in their parameter order (model/mtp.py): each depth's eh_proj
    [h, 2h], whole on every TP rank (parallel/layers.ReplicatedLinear), then its decoder layer's (numbered L + k)."""
    h, layers = model.hidden_size, model.num_layers
    return [x for k in range(1, (model.mtp_num_layers or 0) + 1)
            for x in (HiddenMatrix(h, 2 * h, -1, (h,)), *layer_matrices(model, layers + k, ep))]
