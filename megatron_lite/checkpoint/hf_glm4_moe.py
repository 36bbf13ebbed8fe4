"""Our GPT with grouped-query attention and DeepSeek-V3's experts <-> Hugging Face `Glm4MoeForCausalLM` (GLM-4.5,
4.6, 4.7): the mapping and the config.

transformers builds it from DeepSeek-V3's MoE block and decoder layer around a Llama-shaped attention, so the table
is Llama's (checkpoint/hf_llama.py) with, per layer i (our module 1+i):

    attention.query_key_value.bias   [(a + 2g) hd]  -> self_attn.q_proj.bias, k_proj.bias, v_proj.bias
                                                       (attention_bias, our --add-qkv-bias: o_proj has none)
    attention.q_layernorm.weight     [hd]           -> self_attn.q_norm.weight  (use_qk_norm, our --qk-layernorm)
    attention.k_layernorm.weight     [hd]           -> self_attn.k_norm.weight

and each layer from first_k_dense_replace on with DeepSeek-V3's experts (checkpoint/hf_moe.py: mlp.gate and its
e_score_correction_bias, mlp.experts.e.*, mlp.shared_experts.*; the router's fields: hf_deepseek_moe.py). The
multi-token prediction layers (num_nextn_predict_layers, model.layers.{L + k - 1}.*) are stored as DeepSeek-V3's
and are our --mtp-num-layers depths (hf_deepseek_v3_mtp.py).

RoPE turns the first r = int(partial_rotary_factor x head_dim) dimensions of each head (0.5 when config.json says
nothing), rotate-half over those r, the rest passed: transformers' glm4_moe applies gpt_neox's apply_rotary_pos_emb
(q[..., :r] turned, q[..., r:] kept), which is our --rotary-percent; nothing is permuted (GLM-4's dense
Glm4ForCausalLM interleaves its pairs, this one does not). head_dim is free (--kv-channels), the softmax scale
head_dim^-0.5; every norm, q_norm and k_norm included, uses rms_norm_eps (default 1e-5, not Llama's 1e-6).
"""
from __future__ import annotations

from typing import Iterable, List, Set, Tuple

from megatron_lite.checkpoint import hf_deepseek_moe, hf_deepseek_v3, hf_deepseek_v3_mtp, hf_llama, hf_moe, hf_qwen3
from megatron_lite.checkpoint.hf_fields import real, refusal, whole
from megatron_lite.checkpoint.hf_mapping import Mapped, StateDict
from megatron_lite.config import ModelConfig

ARCHITECTURE = "Glm4MoeForCausalLM"
ARCHITECTURES = (ARCHITECTURE,)
FLAGS = hf_llama.FLAGS + ", --qk-layernorm, --add-qkv-bias, --rotary-percent, --num-experts, --moe-ffn-hidden-size, " \
                         "--moe-layer-freq, --moe-shared-expert-intermediate-size, --mtp-num-layers"
NAMES = hf_deepseek_v3.NAMES
EXPERTS = True
"""The importer asks the files which spelling of the experts they hold (hf_moe.fused_names)."""
KEPT_IN_FP32 = hf_deepseek_v3.KEPT_IN_FP32
"""The selection bias, in fp32 whatever --dtype says (transformers keeps it so: _keep_in_fp32_modules_strict)."""
DEFAULTS = dict(num_key_value_heads=8, rms_norm_eps=1e-5, partial_rotary_factor=0.5, attention_bias=False,
                use_qk_norm=False, first_k_dense_replace=1, n_routed_experts=128, num_experts_per_tok=8,
                moe_intermediate_size=1408, n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                norm_topk_prob=True, num_nextn_predict_layers=1)
"""Glm4MoeConfig's defaults where they are not what Llama's reader assumes: what transformers builds when
config.json leaves a field out."""
ALIASES = {"num_mtp_layers": "num_nextn_predict_layers", "num_local_experts": "n_routed_experts"}
"""Glm4MoeConfig's attribute_map: other names config.json may give a field (the field's own name wins)."""

hf_name, is_derived = hf_llama.hf_name, hf_llama.is_derived


def check_glm4_moe(m: ModelConfig) -> None:
    """Glm4MoeForCausalLM holds our Llama-family block (partial RoPE, QK-norm and q/k/v biases optional) with
    DeepSeek-V3's experts; say why not."""
    hf_llama.check_llama(m, ARCHITECTURE, qkv_bias=True, partial_rotary=True)
    hf_deepseek_moe.refuse_first(ARCHITECTURE, [
        (m.multi_latent_attention, "has grouped-query attention", "with --multi-latent-attention",
         "DeepseekV3ForCausalLM holds it"),
        (m.window_size is not None, "attends over the whole causal context",
         f"with --window-size {m.window_size and ','.join(map(str, m.window_size))}", "drop it"),
        (m.num_experts is None, "has experts from first_k_dense_replace on", "without --num-experts",
         "LlamaForCausalLM or Qwen3ForCausalLM holds a dense model"),
        *hf_deepseek_moe.refusals(m)])


def mapping(m: ModelConfig, fused: bool = False) -> List[Mapped]:
    """Every dense parameter (and the routers' expert bias) with the Hugging Face tensors it holds, in model order,
    the MTP depths' included. `fused`: transformers 5's in-memory spelling of the experts."""
    check_glm4_moe(m)
    table = hf_llama.table(m)
    if m.qk_layernorm:
        table = hf_qwen3.with_qk_norms(table, m)
    if m.add_qkv_bias:  # after the norms' insertion: each bias lands right after its weight, as the model orders them
        table = hf_llama.with_qkv_biases(table)
    return hf_deepseek_v3_mtp.with_depths(hf_moe.with_experts(table, m, NAMES, fused), m)


def to_hf(dense: StateDict, m: ModelConfig, fused: bool = False) -> StateDict:
    """Our dense (TP = PP = 1) state dict -> Glm4MoeForCausalLM's as save_pretrained writes it (`fused`: as its
    state_dict() holds the experts), with the MTP layers as GLM-4.5's release holds them."""
    return hf_deepseek_v3_mtp.to_hf(dense, m, mapping(m, fused), FLAGS)


def from_hf(hf: StateDict, m: ModelConfig) -> StateDict:
    """Glm4MoeForCausalLM's state dict, in either spelling of the experts -> our dense one. With --mtp-num-layers,
    the MTP layers' copies of the embedding and head, where it has them, must be them."""
    return hf_deepseek_v3_mtp.from_hf(hf, m, lambda fused: mapping(m, fused), FLAGS, ARCHITECTURE)


def hf_config(m: ModelConfig) -> dict:
    """config.json of the Glm4MoeForCausalLM that holds our model: Llama's shared keys, the rotary share,
    attention_bias, use_qk_norm, DeepSeek-V3's MoE keys and the MTP layers (--mtp-num-layers)."""
    check_glm4_moe(m)
    drop = ("pretraining_tp", "mlp_bias", "architectures", "model_type")
    config = {k: v for k, v in hf_llama.hf_config(m, qkv_bias=True, partial_rotary=True).items() if k not in drop}
    return dict(config, architectures=[ARCHITECTURE], model_type="glm4_moe",
                partial_rotary_factor=float(m.rotary_percent), attention_bias=bool(m.add_qkv_bias),
                use_qk_norm=bool(m.qk_layernorm), num_nextn_predict_layers=m.mtp_num_layers or 0,
                **hf_deepseek_moe.hf_config(m))


def _with_defaults(c: dict) -> dict:
    given = {k: v for k, v in c.items() if v is not None}
    return {**DEFAULTS, **{ALIASES[k]: v for k, v in given.items() if k in ALIASES}, **given}


def _rotary_share(c: dict, where: str, width: int) -> float:
    """partial_rotary_factor as transformers reads it (the rope parameters' own, else the top-level key), refused
    where it turns an odd number of a head's `width` dimensions (transformers would turn one more)."""
    source = next((c[key] for key in ("rope_scaling", "rope_parameters") if isinstance(c.get(key), dict)
                   and c[key].get("partial_rotary_factor") is not None), c)
    share = real(source, "partial_rotary_factor", where, above=0, maximum=1)
    turned = int(width * share)
    if turned % 2 or turned < 2:
        raise hf_deepseek_moe.field_error(where, "partial_rotary_factor", share, f"it turns int({share:g} x head_dim "
                                          f"{width}) = {turned} dimensions of each head, and RoPE turns pairs of them")
    return share


def model_fields(c: dict, where: str) -> dict:
    """Our ModelConfig fields for a Glm4MoeForCausalLM config.json; a field we cannot represent is refused by name
    (Llama's shared fields: hf_llama.model_fields; the experts': hf_deepseek_moe.model_fields)."""
    c = _with_defaults(c)
    for key in ("attention_bias", "use_qk_norm"):
        if not isinstance(c[key], bool):
            raise refusal(where, key, c[key], "must be true or false")
    if c.get("sliding_window") is not None:  # transformers' Glm4Moe reads none; the importer would apply it
        raise hf_deepseek_moe.field_error(where, "sliding_window", c["sliding_window"], f"transformers' "
                                          f"{ARCHITECTURE} attends over the whole causal context whatever it says; "
                                          f"remove it")
    # Whether its layers import as --mtp-num-layers, the folder's weights decide (hf_deepseek_v3_mtp.import_fields).
    whole(c, "num_nextn_predict_layers", where, minimum=0)
    fields = hf_llama.model_fields(dict(c, attention_bias=False, partial_rotary_factor=1.0), where)
    layers = fields["num_layers"]
    experts = hf_deepseek_moe.model_fields(c, where, layers, ARCHITECTURE)
    if not experts:
        raise hf_deepseek_moe.field_error(where, "first_k_dense_replace", c["first_k_dense_replace"], f"it leaves all "
                                          f"{layers} layers dense: a {ARCHITECTURE} without experts is not "
                                          f"supported here (its export would be another architecture)")
    width = fields["kv_channels"] or fields["hidden_size"] // fields["num_attention_heads"]
    fields.update(rotary_percent=_rotary_share(c, where, width), **experts)
    if c["use_qk_norm"]:
        fields["qk_layernorm"] = True
    if c["attention_bias"]:
        fields["add_qkv_bias"] = True
    return fields


def file_fields(c: dict, names: Iterable[str], where: str) -> Tuple[dict, List[str]]:
    """The importer's fields that the weights decide, not config.json alone: --mtp-num-layers when the folder holds
    the multi-token prediction layers (hf_deepseek_v3_mtp.import_fields); and notes."""
    fields, note = hf_deepseek_v3_mtp.import_fields(_with_defaults(c), names, where, ARCHITECTURE, DEFAULTS)
    return fields, [note] if note else []


def unmapped(files, m: ModelConfig) -> Set[str]:
    """The folder's tensors the table leaves out: the MTP layers' copies of the embedding and head, checked equal."""
    return set(hf_deepseek_v3_mtp.check_copies(files.read, files.names(), m, files.folder, ARCHITECTURE))
