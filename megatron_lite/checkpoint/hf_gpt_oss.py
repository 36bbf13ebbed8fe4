"""Our GPT with attention sinks and biased, clamped quick-GeGLU experts <-> Hugging Face `GptOssForCausalLM`
(gpt-oss-20b, gpt-oss-120b): the parameter mapping (the config and its refusals: checkpoint/hf_gpt_oss_config.py).

Llama's embedding, norms, attention and head (checkpoint/hf_llama.py) with every linear's bias, each layer's sinks
and its MoE MLP (layer i is our module 1+i, theirs model.layers.i):

    attention.softmax_offset   [a]                            -> self_attn.sinks
    attention.query_key_value  weight [(a + 2g) hd, h], bias  -> self_attn.q_proj, k_proj, v_proj .weight, .bias
    attention.dense            weight [h, a hd], bias [h]      -> self_attn.o_proj .weight, .bias
    mlp.router                 weight [E, h], bias [E]         -> mlp.router .weight, .bias
    mlp.experts.weight1        [E, 2F, h]  ([gate; up])        -> mlp.experts.gate_up_proj [E, h, 2F]  (interleaved)
    mlp.experts.bias1          [E, 2F]     ([gate; up])        -> mlp.experts.gate_up_proj_bias [E, 2F] (interleaved)
    mlp.experts.weight2        [E, h, F]                       -> mlp.experts.down_proj [E, F, h]
    mlp.experts.bias2          [E, h]                          -> mlp.experts.down_proj_bias [E, h]

transformers' GptOssExperts keeps its stacks as [in, out] (x @ W) and the gate and up columns of gate_up_proj
interleaved (gate = [..., ::2], up = [..., 1::2]; its use_experts_implementation(is_concatenated=False,
is_transposed=True)), ours as nn.Linear's [out, in] with the halves apart: `as_ours` turns their expert tensors
into our layout and `as_theirs` back. The table names their tensors with shapes in our layout; to_hf/from_hf apply
the turn around it, and the importer reads the folder through `OurExpertLayout`, which turns each expert as it is
read (one expert at a time: the importer's bound holds). The released weights' MXFP4 expert stacks are read
dequantized first (checkpoint/hf_mxfp4.py), to the bf16 layout above. save_pretrained writes these names as they
are (transformers has no conversion mapping for gpt-oss).
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from megatron_lite.checkpoint import hf_gpt_oss_config, hf_llama, hf_mapping
from megatron_lite.checkpoint.hf_mapping import Mapped, StateDict
from megatron_lite.config import ModelConfig
from megatron_lite.model.moe_options import expert_ffn_hidden_size

ARCHITECTURE = hf_gpt_oss_config.ARCHITECTURE
ARCHITECTURES = (ARCHITECTURE,)
FLAGS = hf_llama.FLAGS + ", --num-experts, --moe-ffn-hidden-size (expert tensors compared in our layout: " \
                         "gate_up_proj as [E, 2F, h], down_proj as [E, h, F])"
SLIDING_WINDOW_SWITCH = True
"""The importer's Mistral rule (sliding_window on every layer) is off: layer_types decide (hf_gpt_oss_config.py)."""
GATE_UP, GATE_UP_BIAS, DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.gate_up_proj_bias", ".mlp.experts.down_proj"

hf_name, is_derived = hf_llama.hf_name, hf_llama.is_derived
check_gpt_oss = hf_gpt_oss_config.check_gpt_oss
hf_config, model_fields = hf_gpt_oss_config.hf_config, hf_gpt_oss_config.model_fields


def _layer(m: ModelConfig, i: int) -> List[Mapped]:
    """Layer i's (0-based) entries past its input norm, in our module's parameter order."""
    h, a, g, hd = m.hidden_size, m.num_attention_heads, m.num_query_groups or m.num_attention_heads, m.head_dim
    experts, ffn = m.num_experts, expert_ffn_hidden_size(m)
    ours, theirs = f"layers.{i + 1}.", f"model.layers.{i}."
    qkv = (a * hd, g * hd, g * hd)
    return [
        Mapped(ours + "attention.softmax_offset", (a,), (theirs + "self_attn.sinks",), (a,)),
        Mapped(ours + "attention.query_key_value.weight", (sum(qkv), h),
               tuple(theirs + f"self_attn.{p}_proj.weight" for p in "qkv"), qkv),
        Mapped(ours + "attention.query_key_value.bias", (sum(qkv),),
               tuple(theirs + f"self_attn.{p}_proj.bias" for p in "qkv"), qkv),
        Mapped(ours + "attention.dense.weight", (h, a * hd), (theirs + "self_attn.o_proj.weight",), (h,)),
        Mapped(ours + "attention.dense.bias", (h,), (theirs + "self_attn.o_proj.bias",), (h,)),
        Mapped(ours + "post_attention_layernorm.weight", (h,), (theirs + "post_attention_layernorm.weight",), (h,)),
        Mapped(ours + "mlp.router.weight", (experts, h), (theirs + "mlp.router.weight",), (experts,)),
        Mapped(ours + "mlp.router.bias", (experts,), (theirs + "mlp.router.bias",), (experts,)),
        # In our layout (as_ours): one row of theirs per expert.
        Mapped(ours + "mlp.experts.weight1", (experts, 2 * ffn, h), (theirs[:-1] + GATE_UP,), (experts,)),
        Mapped(ours + "mlp.experts.weight2", (experts, h, ffn), (theirs[:-1] + DOWN,), (experts,)),
        Mapped(ours + "mlp.experts.bias1", (experts, 2 * ffn), (theirs[:-1] + GATE_UP_BIAS,), (experts,)),
        Mapped(ours + "mlp.experts.bias2", (experts, h), (theirs + "mlp.experts.down_proj_bias",), (experts,)),
    ]


def mapping(m: ModelConfig) -> List[Mapped]:
    """Every dense parameter with the Hugging Face tensors it holds (expert stacks in our layout), in model order."""
    check_gpt_oss(m)
    table = []
    for entry in hf_llama.table(m):  # Llama's embedding, norms and head; each layer's rest is gpt-oss's
        parts = entry.ours.split(".")
        if parts[0] == "layers" and 1 <= int(parts[1]) <= m.num_layers:
            if entry.ours.endswith(".input_layernorm.weight"):
                table += [entry] + _layer(m, int(parts[1]) - 1)
            continue
        table.append(entry)
    return table


def _halves(rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return rows[:, 0::2], rows[:, 1::2]


def as_ours(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """One of their tensors (or a run of experts of it) in our layout: gate_up_proj [n, h, 2F] interleaved ->
    [n, 2F, h] [gate; up], gate_up_proj_bias [n, 2F] interleaved -> [gate; up], down_proj [n, F, h] -> [n, h, F];
    any other tensor as it is. A tensor of the wrong rank is left as it is, for the shape check to name."""
    if name.endswith(GATE_UP) and tensor.dim() == 3:
        return torch.cat(_halves(tensor.transpose(1, 2)), dim=1).contiguous()
    if name.endswith(GATE_UP_BIAS) and tensor.dim() == 2:
        return torch.cat(_halves(tensor), dim=1)
    if name.endswith(DOWN) and tensor.dim() == 3:
        return tensor.transpose(1, 2).contiguous()
    return tensor


def as_theirs(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """as_ours' inverse (a new tensor for the expert stacks: safetensors refuses views that share memory)."""
    if name.endswith((GATE_UP, GATE_UP_BIAS)):
        gate, up = tensor.chunk(2, dim=1)
        interleaved = torch.stack((gate, up), dim=2).flatten(1, 2)  # [n, F, 2, ...] -> [n, 2F, ...]: g0 u0 g1 u1 ..
        return interleaved.transpose(1, 2).contiguous() if name.endswith(GATE_UP) else interleaved
    if name.endswith(DOWN):
        return tensor.transpose(1, 2).contiguous()
    return tensor


def _turned(shape: Tuple[int, ...], name: str) -> Tuple[int, ...]:
    """A stored expert stack's shape in our layout (as_ours' on shapes)."""
    if name.endswith((GATE_UP, DOWN)) and len(shape) == 3:
        return shape[0], shape[2], shape[1]
    return shape


class OurExpertLayout:
    """A folder's tensors (WeightFiles, or a dequantizing wrapper of it) with the expert stacks in our layout:
    shape(), read() and read_rows() (rows: experts) as as_ours gives them."""

    def __init__(self, files):
        self.files = files

    def __getattr__(self, name: str):  # folder, kind, names, where: the files'
        return getattr(self.files, name)

    def shape(self, name: str) -> Tuple[int, ...]:
        return _turned(tuple(self.files.shape(name)), name)

    def read(self, name: str) -> torch.Tensor:
        return as_ours(name, self.files.read(name))

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return as_ours(name, self.files.read_rows(name, start, stop))


def weights_view(files) -> OurExpertLayout:
    """The importer's view of the folder: the table's tensors, expert stacks in our layout."""
    return OurExpertLayout(files)


def to_hf(dense: StateDict, m: ModelConfig) -> StateDict:
    """Our dense (TP = PP = 1) state dict -> GptOssForCausalLM's, as save_pretrained writes it."""
    return {name: as_theirs(name, t) for name, t in hf_mapping.to_hf(dense, mapping(m), FLAGS).items()}


def from_hf(hf: StateDict, m: ModelConfig) -> StateDict:
    """GptOssForCausalLM's state dict -> our dense one (a tied head as hf_llama.weights_of takes it)."""
    hf = {name: as_ours(name, t) for name, t in hf_llama.weights_of(hf, m).items()}
    return hf_mapping.from_hf(hf, mapping(m), FLAGS)
