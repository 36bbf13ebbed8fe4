"""The tokenizer a checkpoint's model is read with: the one its config records, or one the tools name instead.

generate.py, evaluate.py and convert_checkpoint.py import-hf take Megatron-LM's `--tokenizer-type`,
`--tokenizer-model`, `--vocab-file` and `--merge-file`: a model imported from a Hugging Face folder without
tokenizer files records NullTokenizer (ids as text) until one is named, and a run's files may have moved.
Without --tokenizer-type, file flags the recorded type reads are its files in a new place; others imply
their own type, as in pretrain_gpt.py. A recorded file stands in for one left out only under the recorded
type. The tokenizer's vocabulary must be the model's: an id past the model's rows has no embedding, and a
smaller vocabulary is another tokenizer's (ours is always the model's, before padding). No torch here: the
tools refuse these flags before torch starts.
"""
from __future__ import annotations

import os
from typing import Tuple

from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.config import TOKENIZER_TYPES, Config, DataConfig
from megatron_lite.data.tokenizer import (
    GPT2_HINT, HF_HINT, SENTENCEPIECE_TYPES, TOKENIZER_FIELDS, TOKENIZER_FILE_FIELDS, TOKENIZER_NEEDS, build_tokenizer,
    file_refusal, inferred_tokenizer_type, tokenizer_flags_refusal,
)

FILE_FIELDS = TOKENIZER_FIELDS[1:]


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def add_tokenizer_flags(parser, default: str) -> None:
    """The four flags on a tool's parser; `default`: what leaving them out means there."""
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                        help=f"the tokenizer of the model's ids (default: {default}); without it, file flags "
                             f"the recorded type does not read imply their own, as in pretrain_gpt.py")
    parser.add_argument("--tokenizer-model", default=None,
                        help="SentencePiece .model, or Hugging Face tokenizer folder or its tokenizer.json")
    parser.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json")
    parser.add_argument("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt")


def given_tokenizer(args) -> dict:
    """{field: value} of the tokenizer flags given on a tool's command line."""
    return {field: getattr(args, field) for field in TOKENIZER_FIELDS if getattr(args, field) is not None}


def _canonical(kind: str) -> str:
    return "SentencePieceTokenizer" if kind in SENTENCEPIECE_TYPES else kind


def check_tokenizer_flags(given: dict) -> None:
    """What the flags earn on their own, before any checkpoint is read: a file their type does not read, or a
    file that is not there. CheckpointError naming the flag."""
    files = {field: given.get(field) for field in FILE_FIELDS}
    kind = given.get("tokenizer_type") or inferred_tokenizer_type(*files.values(), None)
    if kind is None:
        return
    refusals = [tokenizer_flags_refusal(kind, files, complete=False)]
    for field, path in files.items():
        if path is not None and not (kind == "HuggingFaceTokenizer" and os.path.isdir(path)):
            hint = (GPT2_HINT if field != "tokenizer_model" else HF_HINT if kind == "HuggingFaceTokenizer"
                    else "give a SentencePiece .model (tools/train_tokenizer.py trains one)")
            refusals.append(file_refusal(path, _flag(field), hint))
    refusal = next((r for r in refusals if r), None)
    if refusal:
        raise CheckpointError(refusal)


def chosen_tokenizer(recorded: DataConfig, given: dict) -> dict:
    """The tokenizer fields to use: the given flags, over the recorded ones. Without --tokenizer-type, files
    the recorded type reads are its files moved; others imply their own type."""
    check_tokenizer_flags(given)
    files = {field: given.get(field) for field in FILE_FIELDS}
    recorded_kind = recorded.tokenizer_type or "NullTokenizer"
    kind = given.get("tokenizer_type")
    if kind is None:
        reads_them = all(field in TOKENIZER_FILE_FIELDS[recorded_kind] for field, path in files.items() if path)
        kind = recorded_kind if reads_them else inferred_tokenizer_type(*files.values(), None)
    if _canonical(kind) == _canonical(recorded_kind):
        files = {field: path or getattr(recorded, field) for field, path in files.items()}
    files = {field: path for field, path in files.items() if field in TOKENIZER_FILE_FIELDS[kind]}
    refusal = tokenizer_flags_refusal(kind, files)
    if refusal:
        raise CheckpointError(refusal)
    return {"tokenizer_type": kind, **{field: files.get(field) for field in FILE_FIELDS}}


def fitting_tokenizer(fields: dict, vocab_size: int, model: str):
    """The tokenizer `fields` name, built; CheckpointError naming its flags unless its vocabulary is the one of
    `model` (words for the message: "the model in ckpt")."""
    kind = fields["tokenizer_type"]
    try:
        tokenizer = build_tokenizer(kind, fields["tokenizer_model"], vocab_size, fields["vocab_file"],
                                    fields["merge_file"])
    except (OSError, ValueError) as e:  # the tokenizer names the flag and the file
        raise CheckpointError(str(e)) from None
    if tokenizer.vocab_size != vocab_size:
        named = " ".join(f"{_flag(field)} {fields[field]}" for field in TOKENIZER_FILE_FIELDS[kind])
        unit = "pieces" if kind in SENTENCEPIECE_TYPES else "tokens"
        why = (f"its ids from {vocab_size} on have no row in the model" if tokenizer.vocab_size > vocab_size
               else "it is another tokenizer's (a model's vocabulary is its tokenizer's)")
        raise CheckpointError(f"{named} ({kind}) has {tokenizer.vocab_size} {unit}, but {model} has a vocabulary "
                              f"of {vocab_size}: {why}; give the model's tokenizer with --tokenizer-type and "
                              f"{TOKENIZER_NEEDS[kind]}")
    return tokenizer


def _refuse_moved_files(fields: dict, given: dict, model: str) -> None:
    """CheckpointError naming a recorded tokenizer file that is gone (moved or deleted since training) and the flag
    that gives its new place; a file given on the command line is checked by the flags' own checks. Before: "train
    one with tools/train_tokenizer.py", as if the user had never had one."""
    for field in TOKENIZER_FILE_FIELDS[fields["tokenizer_type"]]:
        path = fields[field]
        if path and field not in given and not os.path.exists(path):
            raise CheckpointError(f"{model} was trained with {_flag(field)} {path}, which is not there any more: "
                                  f"give its new place with {_flag(field)} PATH")


def checkpoint_tokenizer(config: Config, given: dict, model: str) -> Tuple[dict, object]:
    """(the tokenizer fields, the tokenizer) a tool reads the checkpoint's model with; see fitting_tokenizer."""
    fields = chosen_tokenizer(config.data, given)
    _refuse_moved_files(fields, given, model)
    return fields, fitting_tokenizer(fields, config.model.vocab_size, model)


def recorded_tokenizer(config: Config, model: str) -> dict:
    """The tokenizer fields the checkpoint records, its files still where they were (checked without building the
    tokenizer, which the tool builds later: evaluate's dataset, export-hf's copy)."""
    fields = chosen_tokenizer(config.data, {})
    _refuse_moved_files(fields, {}, model)
    return fields


def with_tokenizer(config: Config, given: dict, model: str) -> Tuple[Config, str]:
    """(config recording the tokenizer the flags name, a note saying which) for a model imported without one;
    refused unless it fits. The files are recorded by absolute path: the tools run from anywhere."""
    if not given:
        return config, ("tokenizer: NullTokenizer (ids as text); name the model's tokenizer with --tokenizer-type "
                        "and its files here, or to generate.py and evaluate.py")
    fields, _ = checkpoint_tokenizer(config, given, model)
    fields = {field: os.path.abspath(value) if field in FILE_FIELDS and value else value
              for field, value in fields.items()}
    named = " ".join(f"{_flag(field)} {value}" for field, value in fields.items() if value)
    return (config.replace(**{f"data__{field}": value for field, value in fields.items()}),
            f"tokenizer: {named}, recorded: generate.py, evaluate.py and pretrain_gpt.py --use-checkpoint-args "
            f"read the model with it")
