"""Our GPT with Multi-head Latent Attention <-> Hugging Face `DeepseekV3ForCausalLM` (DeepSeek-V3/R1, Kimi K2).

Llama's norms, embeddings, head and dense MLPs (checkpoint/hf_llama.py), each layer's attention as MLA
(model/latent_attention.py; layer i is our module 1+i, theirs model.layers.i.self_attn):

    attention.linear_q_down_proj   [q_lora, h]                -> q_a_proj
    attention.q_layernorm          [q_lora]                   -> q_a_layernorm
    attention.linear_q_up_proj     [n (d_n + d_r), q_lora]    -> q_b_proj  (each head's rows [nope | rope])
    attention.linear_q_proj        [n (d_n + d_r), h]         -> q_proj    (instead of the three: no q_lora_rank)
    attention.linear_kv_down_proj  [kv_lora + d_r, h]         -> kv_a_proj_with_mqa  ([c_kv | k_rope])
    attention.kv_layernorm         [kv_lora]                  -> kv_a_layernorm
    attention.linear_kv_up_proj    [n (d_n + d_v), kv_lora]   -> kv_b_proj (each head's rows [k_nope | v])
    attention.dense                [h, n d_v]                 -> o_proj

and the layers from first_k_dense_replace on with experts (checkpoint/hf_moe.py: mlp.gate and its
e_score_correction_bias, mlp.experts.e.*, mlp.shared_experts.*). With rope_interleave (DeepSeek-V3's and Kimi's
checkpoints) the d_r rotary rows of each q head and of k_rope hold pairs side by side, where our RoPE turns halves:
they are permuted on the way in and back on the way out (hf_mapping.Mapped.rotary); export writes rope_interleave
true. The config (router, YaRN, what is refused): checkpoint/hf_deepseek_v3_config.py.

The multi-token prediction layers (num_nextn_predict_layers D, stored as model.layers.{L + k - 1}.*, k = 1..D) are
our --mtp-num-layers D depths: checkpoint/hf_deepseek_v3_mtp.py.
"""
from __future__ import annotations

from typing import Iterable, List, Set, Tuple

from megatron_lite.checkpoint import hf_deepseek_v3_config, hf_deepseek_v3_mtp, hf_llama, hf_moe
from megatron_lite.checkpoint.hf_mapping import Mapped, StateDict
from megatron_lite.config import ModelConfig

ARCHITECTURE = hf_deepseek_v3_config.ARCHITECTURE
ARCHITECTURES = (ARCHITECTURE,)
FLAGS = hf_llama.FLAGS + ", --multi-latent-attention, --q-lora-rank, --kv-lora-rank, --qk-head-dim, " \
                         "--qk-pos-emb-head-dim, --v-head-dim, --num-experts, --moe-ffn-hidden-size, " \
                         "--moe-layer-freq, --moe-shared-expert-intermediate-size, --mtp-num-layers"
NAMES = hf_moe.ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj", shared="shared_experts")
EXPERTS = True
"""The importer asks the files which spelling of the experts they hold (hf_moe.fused_names)."""
KEPT_IN_FP32 = (".mlp.gate.e_score_correction_bias",)
"""Written in fp32 whatever --dtype says, as DeepSeek-V3's own checkpoints keep the selection bias: in bf16 its
small differences between experts, which decide the routing, would round away."""

hf_name, is_derived = hf_llama.hf_name, hf_llama.is_derived
# The config's half (the importer's and exporter's entry points, with the refusals): hf_deepseek_v3_config.py.
check_deepseek_v3 = hf_deepseek_v3_config.check_deepseek_v3
hf_config, model_fields = hf_deepseek_v3_config.hf_config, hf_deepseek_v3_config.model_fields


def _attention(m: ModelConfig, i: int, interleaved: bool) -> List[Mapped]:
    """Layer i's (0-based) MLA entries, in our module's parameter order."""
    ours, theirs = f"layers.{i + 1}.attention.", f"model.layers.{i}.self_attn."
    h, n, rope = m.hidden_size, m.num_attention_heads, m.qk_pos_emb_head_dim
    q_rows, kv_down = n * m.head_dim, m.kv_lora_rank + rope
    # Each query head's last d_r rows, and k_rope (the down projection's last d_r rows), are the rotary ones.
    q_rotary, k_rotary = ((m.head_dim, rope), (kv_down, rope)) if interleaved else ((0, 0), (0, 0))
    if m.q_lora_rank:
        out = [Mapped(ours + "linear_q_down_proj.weight", (m.q_lora_rank, h), (theirs + "q_a_proj.weight",),
                      (m.q_lora_rank,)),
               Mapped(ours + "q_layernorm.weight", (m.q_lora_rank,), (theirs + "q_a_layernorm.weight",),
                      (m.q_lora_rank,)),
               Mapped(ours + "linear_q_up_proj.weight", (q_rows, m.q_lora_rank), (theirs + "q_b_proj.weight",),
                      (q_rows,), rotary=q_rotary)]
    else:
        out = [Mapped(ours + "linear_q_proj.weight", (q_rows, h), (theirs + "q_proj.weight",), (q_rows,),
                      rotary=q_rotary)]
    kv_up = n * (m.qk_head_dim + m.v_head_dim)
    return out + [
        Mapped(ours + "linear_kv_down_proj.weight", (kv_down, h), (theirs + "kv_a_proj_with_mqa.weight",), (kv_down,),
               rotary=k_rotary),
        Mapped(ours + "kv_layernorm.weight", (m.kv_lora_rank,), (theirs + "kv_a_layernorm.weight",), (m.kv_lora_rank,)),
        Mapped(ours + "linear_kv_up_proj.weight", (kv_up, m.kv_lora_rank), (theirs + "kv_b_proj.weight",), (kv_up,)),
        Mapped(ours + "dense.weight", (h, n * m.v_head_dim), (theirs + "o_proj.weight",), (h,))]


def mapping(m: ModelConfig, fused: bool = False, interleaved: bool = True) -> List[Mapped]:
    """Every dense parameter (and the routers' expert bias) with the Hugging Face tensors it holds, in model order,
    the MTP depths' included. `fused`: transformers 5's in-memory spelling of the experts; `interleaved`: the
    folder's rope_interleave."""
    check_deepseek_v3(m)
    table = []
    for entry in hf_llama.table(m):  # Llama's, its attention entries replaced by MLA's
        if entry.ours.endswith(".attention.query_key_value.weight"):
            table += _attention(m, int(entry.ours.split(".")[1]) - 1, interleaved)
        elif not entry.ours.endswith(".attention.dense.weight"):
            table.append(entry)
    return hf_deepseek_v3_mtp.with_depths(hf_moe.with_experts(table, m, NAMES, fused), m)


def to_hf(dense: StateDict, m: ModelConfig, fused: bool = False, interleaved: bool = True) -> StateDict:
    """Our dense (TP = PP = 1) state dict -> DeepseekV3ForCausalLM's as save_pretrained writes it (rope_interleave;
    `fused`: as its state_dict() holds the experts), with the MTP layers as DeepSeek's release holds them."""
    return hf_deepseek_v3_mtp.to_hf(dense, m, mapping(m, fused, interleaved), FLAGS)


def from_hf(hf: StateDict, m: ModelConfig, interleaved: bool = True) -> StateDict:
    """DeepseekV3ForCausalLM's state dict, in either spelling of the experts -> our dense one; `interleaved`: its
    config's rope_interleave. With --mtp-num-layers, the MTP layers' copies of the embedding and head must be them."""
    return hf_deepseek_v3_mtp.from_hf(hf, m, lambda fused: mapping(m, fused, interleaved), FLAGS)


def table_options(c: dict) -> dict:
    """mapping()'s options that config.json decides (the importer's): whether the rotary rows are interleaved,
    as transformers reads rope_interleave (absent: true)."""
    return {"interleaved": c.get("rope_interleave", True) is not False}


def file_fields(c: dict, names: Iterable[str], where: str) -> Tuple[dict, List[str]]:
    """The importer's fields that the weights decide, not config.json alone: --mtp-num-layers when the folder holds
    the multi-token prediction layers (hf_deepseek_v3_mtp.import_fields); and notes."""
    fields, note = hf_deepseek_v3_mtp.import_fields(c, names, where)
    return fields, [note] if note else []


def unmapped(files, m: ModelConfig) -> Set[str]:
    """The folder's tensors the table leaves out: the MTP layers' copies of the embedding and head, checked equal."""
    return set(hf_deepseek_v3_mtp.check_copies(files.read, files.names(), m, files.folder))
