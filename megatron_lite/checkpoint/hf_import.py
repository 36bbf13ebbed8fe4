"""A Hugging Face model folder -> a checkpoint of ours at iteration 0, under any TP x PP layout.

`GPT2LMHeadModel` maps through checkpoint/hf_gpt2.py, `LlamaForCausalLM` and `MistralForCausalLM` through
checkpoint/hf_llama.py, `Qwen3ForCausalLM` through checkpoint/hf_qwen3.py, the MoE models
`MixtralForCausalLM`, `Qwen2MoeForCausalLM` and `Qwen3MoeForCausalLM` through hf_mixtral.py, hf_qwen2_moe.py and
hf_qwen3_moe.py (either spelling of their experts: checkpoint/hf_moe.py), `DeepseekV3ForCausalLM` through
hf_deepseek_v3.py (its multi-token prediction layers, when the folder holds them, as --mtp-num-layers depths),
`Glm4MoeForCausalLM` through hf_glm4_moe.py (the same MTP layers), `GptOssForCausalLM` through hf_gpt_oss.py (its
release's MXFP4 experts read dequantized: hf_mxfp4.py):
the tables export uses, walked the other way. Our layer files hold every expert of a layer (by global index,
whatever the EP), so the target EP (--target-expert-model-parallel-size) is the recorded layout's, checked
against the expert count. config.json becomes our model flags (a field we cannot represent is refused by name,
before anything is written); the weights are read one tensor at a time (checkpoint/hf_folder.py), fused
and padded to our vocabulary padding, cut into the target's TP slices and written per layer file and TP
rank, so the importer holds one output file and the tensor being cut, not the model; a tensor split by
rows is read only in the rows the rank holds. Tensors are stored in fp32 (our masters), as a resharded
checkpoint is; the model-states files hold an empty optimizer. The metadata says where the checkpoint
came from (`imported_from`), so `pretrain_gpt.py --load` starts it at iteration 0 with a fresh optimizer.

The folder is written under a temporary name and renamed at the end; an existing --output is never
written into.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Callable, Iterable, Optional

import torch

from megatron_lite.atomic import atomic_folder, torch_save
from megatron_lite.checkpoint import (
    hf_deepseek_v3,
    hf_glm4_moe,
    hf_gpt2,
    hf_gpt_oss,
    hf_llama,
    hf_mapping,
    hf_mixtral,
    hf_moe,
    hf_qwen2_moe,
    hf_qwen3,
    hf_qwen3_moe,
    slicing,
)
from megatron_lite.checkpoint.format import (
    CheckpointError,
    fused_weights,
    layer_file,
    layout_of,
    tag_for,
    write_latest,
    write_metadata,
)
from megatron_lite.checkpoint.hf_fields import as_json, whole
from megatron_lite.checkpoint.hf_folder import WeightFiles, read_config
from megatron_lite.checkpoint.hf_fp8 import BlockScaledWeights, block_size
from megatron_lite.checkpoint.hf_mxfp4 import Mxfp4Weights, is_mxfp4
from megatron_lite.checkpoint.layout import ModelLayout, slice_shape
from megatron_lite.checkpoint.layout_free import RunState
from megatron_lite.checkpoint.preflight import refuse_existing
from megatron_lite.checkpoint.reshard import target_config, write_engine_states
from megatron_lite.checkpoint.tokenizer import with_tokenizer
from megatron_lite.config import Config, ConfigError
from megatron_lite.data.sidecar import tokenizer_sha256

ARCHITECTURES = {name: module for module in (hf_gpt2, hf_llama, hf_qwen3, hf_mixtral, hf_qwen2_moe, hf_qwen3_moe,
                                              hf_deepseek_v3, hf_glm4_moe, hf_gpt_oss)
                 for name in module.ARCHITECTURES}
BUFFERS = (".router.expert_bias",)
"""Tables' entries that are buffers (saved state, not parameters): not counted as parameters."""


def architecture(hf: dict, where: str):
    names = hf.get("architectures") or []
    known = [n for n in names if n in ARCHITECTURES]
    if not known:
        raise CheckpointError(f"{where}: architectures = {as_json(names)} is not supported; import-hf reads "
                              f"{', '.join(ARCHITECTURES)}")
    return known[0], ARCHITECTURES[known[0]]


def _sliding_window(hf: dict, fields: dict, where: str, switched: bool = False) -> Optional[str]:
    """Mistral's sliding window -> --window-size: transformers' mask keeps a key when it is fewer than
    sliding_window tokens behind the query (masking_utils' sliding-window overlay), so a token sees itself
    and the sliding_window - 1 before it: --window-size sliding_window - 1,0, on every layer. `switched`: the
    architecture applies sliding_window only under use_sliding_window (Qwen3's), not unless it is false."""
    if hf.get("sliding_window") is None or hf.get("use_sliding_window", not switched) is False:
        return None
    window = whole(hf, "sliding_window", where, minimum=2)
    fields["window_size"] = (window - 1, 0)
    return f"sliding_window {window}: --window-size {window - 1},0 (a token sees itself and {window - 1} before it)"


def imported_config(hf: dict, module, tp: int, pp: int, partition_method: Optional[str],
                    seq_length: Optional[int], where: str, validate: Callable[[Config], Config], ep: int = 1,
                    names: Iterable[str] = ()):
    """(our Config at the target layout, notes) for a Hugging Face config.json; refusals name the field.
    `validate` is training's validation (megatron_lite.validation, a layer above this one: the caller's).
    `names`: the folder's tensors, for the fields the weights decide (DeepSeek-V3's MTP layers: module.file_fields)."""
    try:
        fields = module.model_fields(hf, where)
    except KeyError as e:
        raise CheckpointError(f"{where}: lacks {e.args[0]}, which the model's shape needs") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: a model field has a value of the wrong kind ({e})") from None
    switched = getattr(module, "SLIDING_WINDOW_SWITCH", False)
    notes = [n for n in [_sliding_window(hf, fields, where, switched)] if n]
    if hasattr(module, "file_fields"):
        more, said = module.file_fields(hf, names, where)
        fields.update(more)
        notes += said
    positions = fields["max_position_embeddings"]
    if seq_length is not None and seq_length > positions:  # said here: validation would name a training flag
        raise CheckpointError(f"--seq-length {seq_length} is longer than the model's {positions} positions "
                              f"({where}: max_position_embeddings {positions}); use --seq-length {positions} or less")
    fields["seq_length"] = seq_length or fields["max_position_embeddings"]
    config = Config().replace(**{f"model__{k}": v for k, v in fields.items()})
    try:
        config = validate(config)
    except ConfigError as e:
        raise CheckpointError(f"{where} describes a model megatron_lite cannot build: "
                              f"{in_config_terms(str(e), hf)}") from None
    experts = config.model.num_experts
    if ep > 1 and (experts is None or experts % ep):
        fits = [d for d in range(1, (experts or 1) + 1) if experts and not experts % d]
        raise CheckpointError(f"--target-expert-model-parallel-size {ep} does not divide the model's "
                              + (f"{experts} experts ({where}); use one of {', '.join(map(str, fits))}" if experts
                                 else f"experts: {where} describes a dense model; leave it at 1"))
    config = target_config(config, tp, pp, partition_method)
    return config.replace(parallel__expert_model_parallel_size=ep), notes


def _check_weights(files: WeightFiles, table, module, hf: dict, skipped=frozenset()) -> None:
    """Every tensor the table needs is there and nothing else is (derived buffers and the `skipped` aside); a
    tied model's head, when the file has one, must be the embedding."""
    wanted = {n for e in table for n in e.theirs}
    have = {n for n in files.names() if not module.is_derived(n)} - set(skipped)
    head = "lm_head.weight"
    if head in have and head not in wanted:
        embedding = table[0].theirs[0]
        if not torch.equal(files.read(head), files.read(embedding)):
            raise CheckpointError(f"{files.folder}: config.json ties the output head to the embedding "
                                  f"(tie_word_embeddings), but {head} differs from {embedding}")
        have.discard(head)
    missing = sorted(wanted - have)
    if missing:
        raise CheckpointError(f"{files.folder} lacks the tensor {missing[0]}"
                              f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}, which config.json "
                              f"({'untied head' if head in missing else 'its shape'}) needs")
    extra = sorted(have - wanted)
    if extra:
        raise CheckpointError(f"{files.folder} has the tensor {extra[0]}"
                              f"{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}, which the model "
                              f"config.json describes does not have ({hf.get('architectures')})")


def _rows_of_rank(entry, info, tp: int, rank: int, files: WeightFiles, flags: str) -> torch.Tensor:
    """A row-split tensor's slice for one TP rank, reading only its rows: the rank's piece of every section
    (checkpoint/slicing.py), in fp32."""
    pieces, offset = [], 0
    for length in info.partition_sections:
        n = length // tp
        pieces.append(hf_mapping.ours_rows(entry, offset + rank * n, offset + (rank + 1) * n,
                                           files.shape, files.read_rows, flags).to(torch.float32))
        offset += length
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _expert_slice(entry, info, tp: int, rank: int, files: WeightFiles, flags: str) -> torch.Tensor:
    """One TP rank's slice of an expert stack [E, ...], filled expert by expert: an expert's tensors (per-expert
    spelling: its pieces; fused: its row of the [E, ...] tensor) are read, its rank piece copied in, and freed.
    Read whole and then sliced, a stack cost the stack and its slice at once: 1.03x the importer's bound at TP 2
    in benchmarks/bench_import_hf.py --num-experts 8; 0.26x with this (0.65x at TP 1)."""
    experts = info.experts
    for index, name in enumerate(entry.theirs):
        hf_mapping.check_shape(name, files.shape(name), entry.their_shape(index), flags)
    out = torch.empty(slice_shape(info, tp), dtype=torch.float32)
    per_expert = len(entry.theirs) // experts if entry.experts else 0
    for e in range(experts):
        if per_expert:  # this expert's tensors stacked along its rows, as the flattened entry stacks them
            names = entry.theirs[e * per_expert:(e + 1) * per_expert]
            whole = torch.cat([files.read(n) for n in names]) if per_expert > 1 else files.read(names[0])
        else:
            whole = files.read_rows(entry.theirs[0], e, e + 1)[0]
        out[e] = slicing.piece(whole, tp, rank, info.partition_dim - 1, info.partition_sections)
        del whole
    return out


def _owned_slice(full: torch.Tensor, info, tp: int, rank: int) -> torch.Tensor:
    """TP rank `rank`'s slice in storage of its own: torch.save writes a view's whole storage, and a view
    would keep the full tensor alive."""
    piece = slicing.piece(full, tp, rank, info.partition_dim, info.partition_sections)
    return piece.clone() if tp > 1 else piece


# Our model flags as config.json spells them (the first a folder has, else the first): validation's refusals name
# flags, and import-hf takes none. Before, a folder with 3 key/value heads of 4 was told "Use --num-query-groups".
CONFIG_NAMES = {"--num-query-groups": ("num_key_value_heads",), "--kv-channels": ("head_dim",),
                "--num-attention-heads": ("num_attention_heads", "n_head"), "--hidden-size": ("hidden_size", "n_embd"),
                "--ffn-hidden-size": ("intermediate_size", "n_inner"), "--num-layers": ("num_hidden_layers", "n_layer"),
                "--num-experts": ("num_local_experts", "num_experts", "n_routed_experts"),
                "--moe-ffn-hidden-size": ("moe_intermediate_size",), "--moe-router-topk": ("num_experts_per_tok",),
                "--max-position-embeddings": ("max_position_embeddings", "n_positions"),
                "--vocab-size": ("vocab_size",), "--norm-epsilon": ("rms_norm_eps", "layer_norm_epsilon"),
                "--moe-shared-expert-intermediate-size": ("shared_expert_intermediate_size",),
                "--rotary-base": ("rope_theta",), "--window-size": ("sliding_window",)}


def in_config_terms(message: str, hf: dict) -> str:
    """A validation refusal with each model flag it names replaced by its config.json field."""
    def field(match) -> str:
        names = CONFIG_NAMES.get(match.group(0))
        return next((n for n in names if n in hf), names[0]) if names else match.group(0)

    return re.sub(r"--[a-z][a-z0-9-]*", field, message)


# config.json's fields that give tensor shapes, as the architectures we read spell them.
SHAPE_FIELDS = ("num_hidden_layers", "n_layer", "hidden_size", "n_embd", "intermediate_size", "n_inner",
                "num_attention_heads", "n_head", "num_key_value_heads", "head_dim", "vocab_size",
                "max_position_embeddings", "n_positions", "moe_intermediate_size", "num_local_experts", "num_experts",
                "n_routed_experts", "n_shared_experts", "shared_expert_intermediate_size", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_nextn_predict_layers")


def shape_fields(hf: dict, where: str) -> str:
    """The config.json fields a tensor's shape comes from, as a refusal names them."""
    named = ", ".join(f"{k} {hf[k]}" for k in SHAPE_FIELDS if k in hf)
    return f"the fields of {where} ({named})"


def import_hf(input_folder: str, output: str, tp: int, pp: int, validate: Callable[[Config], Config],
              partition_method: Optional[str] = None, seq_length: Optional[int] = None,
              log: Callable[[str], None] = print, overwrite: bool = False, ep: int = 1,
              tokenizer: Optional[dict] = None) -> dict:
    """`validate(config) -> config`: the checks and derived fields training applies, on the imported model's
    config at TP = PP = 1 (tools/convert_checkpoint.py passes megatron_lite.validation's). `tokenizer`: the
    tokenizer flags' fields to record (checkpoint/tokenizer.py; refused unless it fits the vocabulary)."""
    refuse_existing(output, "--output", overwrite, input_folder, "--input")
    hf = read_config(input_folder)
    where = os.path.join(input_folder, "config.json")
    name, module = architecture(hf, where)
    files = WeightFiles(input_folder, module.hf_name)  # its names (the headers): nothing read yet
    if is_mxfp4(hf):  # gpt-oss's release: expert stacks read dequantized (hf_mxfp4.py)
        files = Mxfp4Weights(files)
    else:
        block = block_size(hf, where)
        files = BlockScaledWeights(files, block) if block else files  # fp8 weights read dequantized (hf_fp8.py)
    # The tensors as the table reads them (gpt-oss's expert stacks turned to our layout as they are read).
    files = module.weights_view(files) if hasattr(module, "weights_view") else files
    config, notes = imported_config(hf, module, tp, pp, partition_method, seq_length, where, validate, ep,
                                    files.names())
    config, note = with_tokenizer(config, tokenizer or {}, f"the model of {where}")
    notes.append(note)
    # An MoE folder spells its experts one way or the other (hf_moe.py): the table follows the files, and
    # config.json's options (DeepSeek-V3's rope_interleave).
    options = {"fused": hf_moe.fused_names(files.names())} if getattr(module, "EXPERTS", False) else {}
    options.update(module.table_options(hf) if hasattr(module, "table_options") else {})
    table = module.mapping(config.model, **options)
    # Tensors no entry maps that the model holds all the same (DeepSeek-V3's MTP copies of the embedding and head).
    skipped = module.unmapped(files, config.model) if hasattr(module, "unmapped") else set()
    _check_weights(files, table, module, hf, skipped)
    by_ours = {e.ours: e for e in table}
    layout = ModelLayout(config)
    bounds = layout.stage_bounds(pp, config.parallel.pipeline_partition_method)

    def read(name: str) -> torch.Tensor:
        return files.read(name).to(torch.float32)

    fields = shape_fields(hf, where)  # what a shape refusal names: import-hf takes no model flag

    tag = tag_for(0)
    largest = 0
    with atomic_folder(output, replace=overwrite) as tmp_root:
        tmp = os.path.join(tmp_root, tag)
        os.makedirs(tmp)
        for spec in layout.layer_specs_with_files():
            # One TP rank's file at a time, each tensor read again per rank: the importer holds one output
            # file and one full tensor, whatever the model's size.
            for r in range(tp):
                shard = {}
                for info in layout.params[spec]:
                    entry = by_ours[f"layers.{spec}.{info.name}"]
                    largest = max(largest, math.prod(entry.shape))
                    if info.experts:
                        shard[info.name] = _expert_slice(entry, info, tp, r, files, fields)
                    elif info.partition_dim == 0 and tp > 1 and not entry.transposed:
                        shard[info.name] = _rows_of_rank(entry, info, tp, r, files, fields)
                    else:
                        full = hf_mapping.ours_of(entry, read, fields)
                        shard[info.name] = _owned_slice(full, info, tp, r)
                        del full  # the next tensor is read with this one freed
                for buffer in layout.buffers[spec]:  # a router's expert bias: whole in every TP rank's file
                    shard[buffer] = hf_mapping.ours_of(by_ours[f"layers.{spec}.{buffer}"], read, fields)
                torch_save(shard, os.path.join(tmp, layer_file(spec, r)))
                del shard
            log(f"  layer {spec:02d}: {len(layout.params[spec])} tensors x {tp} TP ranks")
        run = RunState(iteration=0, consumed_samples=0)
        write_engine_states(tmp, config, layout, bounds, run)
        p, d = config.parallel, config.data
        write_metadata(tmp, {
            "iteration": 0, "consumed_samples": 0,
            "layout": layout_of(tp, pp, p.data_parallel_size),
            "layers_per_stage": layout.layers_per_stage(bounds),
            "fused_weights": fused_weights(dataclasses.asdict(config.model)),
            "tokenizer_sha256": tokenizer_sha256(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file),
            "storage": {"zero_stage": 0, "precision": "fp32"},
            "optimizer_states": False, "config": config.to_dict(),
            "imported_from": {"path": os.path.abspath(input_folder), "architecture": name,
                              "weights": files.kind}})
        write_latest(tmp_root, tag)
    m = config.model
    return {"tag": tag, "architecture": name, "target": (tp, pp, ep), "notes": notes, "config": config,
            "parameters": sum(sum(e.rows) * math.prod(e.flat_shape[1:]) for e in table  # theirs: no padding
                              if not e.ours.endswith(BUFFERS)),
            "vocab": (m.vocab_size, m.padded_vocab_size), "largest_tensor_elements": largest}
