"""DeepSeek-V3's multi-token prediction layers <-> our Multi-Token Prediction depths (model/mtp.py), for
checkpoint/hf_deepseek_v3.py and hf_glm4_moe.py (GLM-4.5 stores its layer as DeepSeek-V3 does). DeepSeek-V3
stores depth k (1..D, D = num_nextn_predict_layers) as one more decoder layer, model.layers.{L + k - 1}
(L = num_hidden_layers), with its MTP parts beside the layer's; ours are module L + 3 of the dense GPTModel
(numbered as the layer specs: the final norm L + 1, the embedding's second use L + 2, which holds no tensor; the
untied head moves to L + 4):

    depths.{k-1}.enorm, .hnorm          [h]      -> model.layers.{L+k-1}.enorm, .hnorm
    depths.{k-1}.eh_proj                [h, 2h]  -> model.layers.{L+k-1}.eh_proj  (columns 0:h act on the embedding)
    depths.{k-1}.layer.*                         -> model.layers.{L+k-1}.*  (as layer L-1's: the last layer's kind)
    depths.{k-1}.final_layernorm        [h]      -> model.layers.{L+k-1}.shared_head.norm
    (the shared embedding and head)              -> model.layers.{L+k-1}.embed_tokens, .shared_head.head: copies

The copies are in DeepSeek's release (each MTP layer standalone, for inference engines): export writes them; the
import, where the folder has them, only checks that they are the model's own, since our depths share the embedding
and head (copies that differ were trained as weights of their own: refused, naming the tensor). transformers'
save_pretrained writes no MTP layer (DeepseekV3ForCausalLM builds none), yet num_nextn_predict_layers 1: such a
folder imports without depths, with a note. transformers' MtpModel builds its layers with experts whatever
first_k_dense_replace says, and our depth is of the last layer's kind: both need a model with experts.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, List, Optional, Tuple

import torch

from megatron_lite.checkpoint import hf_llama, hf_mapping, hf_moe
from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_deepseek_v3_config import ARCHITECTURE, DEFAULTS
from megatron_lite.checkpoint.hf_mapping import Mapped, StateDict
from megatron_lite.config import ModelConfig

COPIES = ("embed_tokens.weight", "shared_head.head.weight")
"""A depth's copies of the shared embedding and head, under model.layers.{L+k-1}."""


def _layer_of(name: str) -> Optional[int]:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else None


def _span(layers: int, depths: int) -> str:
    return f"model.layers.{layers}" + (f"-{layers + depths - 1}" if depths > 1 else "") + ".*"


def _moved(entry: Mapped, ours: Tuple[str, str], theirs: Tuple[str, str]) -> Mapped:
    """The entry with its names' prefixes replaced (ours[0] -> ours[1], theirs[0] -> theirs[1])."""
    assert entry.ours.startswith(ours[0]) and all(t.startswith(theirs[0]) for t in entry.theirs), entry
    return dataclasses.replace(entry, ours=ours[1] + entry.ours[len(ours[0]):],
                               theirs=tuple(theirs[1] + t[len(theirs[0]):] for t in entry.theirs))


def with_depths(table: List[Mapped], m: ModelConfig) -> List[Mapped]:
    """The model's table (embedding, layers, final norm, [head]) with the depths after the final norm, each with
    the last decoder layer's entries renamed, and the untied head as module L + 4."""
    layers, depths, h = m.num_layers, m.mtp_num_layers or 0, m.hidden_size
    if not depths:
        return table
    last, head = f"layers.{layers}.", f"layers.{layers + 2}."
    out = [e for e in table if not e.ours.startswith(head)]
    for k in range(1, depths + 1):
        ours, theirs = f"layers.{layers + 3}.depths.{k - 1}.", f"model.layers.{layers + k - 1}."
        out += [Mapped(ours + f"{n}.weight", (h,), (theirs + f"{n}.weight",), (h,)) for n in ("enorm", "hnorm")]
        out.append(Mapped(ours + "eh_proj.weight", (h, 2 * h), (theirs + "eh_proj.weight",), (h,)))
        out += [_moved(e, (last, ours + "layer."), (f"model.layers.{layers - 1}.", theirs)) for e in table
                if e.ours.startswith(last)]
        out.append(Mapped(ours + "final_layernorm.weight", (h,), (theirs + "shared_head.norm.weight",), (h,)))
    return out + [_moved(e, (head, f"layers.{layers + 4}."), ("", "")) for e in table if e.ours.startswith(head)]


def copies(m: ModelConfig) -> List[Tuple[str, str]]:
    """(a depth's copy, the model's tensor it must equal) for every depth."""
    head = "lm_head.weight" if m.untie_embeddings_and_output_weights else "model.embed_tokens.weight"
    return [(f"model.layers.{m.num_layers + k - 1}.{copy}", main) for k in range(1, (m.mtp_num_layers or 0) + 1)
            for copy, main in zip(COPIES, ("model.embed_tokens.weight", head))]


def add_copies(hf: StateDict, m: ModelConfig) -> StateDict:
    """Export's state dict with the depths' copies, tensors of their own (safetensors refuses shared memory)."""
    return {**hf, **{copy: hf[main].clone() for copy, main in copies(m)}}


def to_hf(dense: StateDict, m: ModelConfig, table: List[Mapped], flags: str) -> StateDict:
    """Our dense state dict -> the architecture's (`table`: its mapping, the depths' included), with the depths'
    copies of the embedding and head as DeepSeek's release holds them."""
    return add_copies(hf_mapping.to_hf(dense, table, flags), m)


def from_hf(hf: StateDict, m: ModelConfig, table_of: Callable[[bool], List[Mapped]], flags: str,
            architecture: str = ARCHITECTURE) -> StateDict:
    """The architecture's state dict, in either spelling of the experts (`table_of(fused)`: its mapping) -> our
    dense one; the depths' copies of the embedding and head, where it has them, must be the model's."""
    hf = hf_llama.weights_of(hf, m)
    held = set(check_copies(hf.__getitem__, hf, m, "the Hugging Face state dict", architecture))
    hf = {k: t for k, t in hf.items() if k not in held}
    return hf_mapping.from_hf(hf, table_of(hf_moe.fused_names(hf)), flags)


def check_copies(read: Callable[[str], torch.Tensor], names: Iterable[str], m: ModelConfig, where: str,
                 architecture: str = ARCHITECTURE) -> List[str]:
    """The depths' copies among `names`, each checked equal to the model's tensor (one pair read at a time) and
    refused by name if not. A folder without them imports (transformers' MtpModel loads none either)."""
    held = set(names)
    for copy, main in copies(m):
        if copy in held and not torch.equal(read(copy), read(main)):
            raise CheckpointError(f"{where}: {copy} differs from {main}: our Multi-Token Prediction depths share the "
                                  f"model's embedding and output head ({architecture}'s copies are for inference "
                                  f"engines), so a depth with its own cannot be imported")
    return [copy for copy, _ in copies(m) if copy in held]


def import_fields(c: dict, names: Iterable[str], where: str, architecture: str = ARCHITECTURE,
                  defaults: dict = DEFAULTS) -> Tuple[dict, Optional[str]]:
    """(--mtp-num-layers D when the folder holds num_nextn_predict_layers = D layers' weights, a note); a folder
    without them (transformers' save_pretrained) imports without depths. The config's numbers are model_fields';
    `defaults`: the architecture's config class's, for the keys config.json leaves out."""
    c = {**defaults, **{k: v for k, v in c.items() if v is not None}}
    layers, depths = int(c["num_hidden_layers"]), int(c.get("num_nextn_predict_layers") or 0)
    if not depths:
        return {}, None
    span = _span(layers, depths)
    held = {_layer_of(n) for n in names} & set(range(layers, layers + depths))
    if not held:
        return {}, (f"num_nextn_predict_layers {depths}: no weights of its multi-token prediction layers ({span}) in "
                    f"the folder (transformers' save_pretrained writes none): imported without --mtp-num-layers, the "
                    f"model predicts the next token as transformers' {architecture} does")
    dense = c["first_k_dense_replace"]
    if dense >= layers:
        raise CheckpointError(f"{where}: first_k_dense_replace = {dense} leaves every layer dense, but the folder "
                              f"holds multi-token prediction layers ({span}), which transformers builds with experts, "
                              f"and our depths are of the last layer's kind (dense here); remove their tensors from "
                              f"the folder to import the model without them")
    return {"mtp_num_layers": depths}, (f"num_nextn_predict_layers {depths}: its multi-token prediction layer"
                                        f"{'s' * (depths > 1)} ({span}) imported as --mtp-num-layers {depths}")
