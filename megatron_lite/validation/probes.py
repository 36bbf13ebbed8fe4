"""Rules that read files: datasets, the tokenizer model, the DeepSpeed JSON.

They run in the same validation pass as the field rules, before any process
group exists, so a missing file or an empty split costs one clear line.
"""
from __future__ import annotations

import math
import os
from typing import List

from megatron_lite.config import Config, ConfigError, pad_vocab_size, vocab_padding_note
from megatron_lite.data.tokenizer import (
    GPT2_HINT, SENTENCEPIECE_TYPES, TOKENIZER_NEEDS, TOKENIZER_TYPES, build_tokenizer, file_refusal,
    inferred_tokenizer_type, tokenizer_flags_refusal,
)
from megatron_lite.reading import UnreadableFile, read_json
from megatron_lite.validation.rules import split_rules

DATA_HINT = ("give the prefix of a .bin/.idx pair written by tools/preprocess_data.py "
             "(e.g. data/corpus_text_document)")
TOKENIZER_FILE_HINT = ("train one with tools/train_tokenizer.py or point at an existing .model file, Hugging Face "
                       "tokenizer folder or tokenizer.json")
# What each tokenizer type's files are called in messages.
TOKENIZER_FILES_NAME = {"SentencePieceTokenizer": "a SentencePiece model", "HuggingFaceTokenizer": "a tokenizer.json",
                        "GPT2BPETokenizer": "a vocab.json + merges.txt"}


def check_readable_file(path: str, flag: str, hint: str) -> None:
    refusal = file_refusal(path, flag, hint)
    if refusal:
        raise ConfigError(refusal)


def data_path_weight_rules(data_path) -> None:
    """--data-path's weights positive and finite (training's, and evaluate.py's own --data-path)."""
    for weight, prefix in data_path:
        if not 0 < weight < math.inf:  # a NaN weight passes `weight <= 0`, then breaks the sample counts
            raise ConfigError(f"--data-path weight {weight:g} for '{prefix}' must be a positive finite number, "
                              f"e.g. 1 (weights are relative)")


def data_rules(config: Config, notes: List[str]) -> Config:
    """Weights, readable and well-formed .bin/.idx pairs, and a split that leaves every wanted split data."""
    d = config.data
    split_rules(d.split)
    data_path_weight_rules(d.data_path)
    if not d.data_path:
        return config
    for _, prefix in d.data_path:
        for suffix in (".bin", ".idx"):
            check_readable_file(prefix + suffix, "--data-path", DATA_HINT)
    from megatron_lite.data.gpt_dataset import check_splits
    from megatron_lite.data.indexed_dataset import IndexedDataset

    try:
        datasets = [IndexedDataset(prefix) for _, prefix in d.data_path]
        gbs, t = config.batch.global_batch_size, config.training
        check_splits(datasets, d.split, (t.train_iters * gbs, t.eval_iters * gbs, t.eval_iters * gbs))
    except ValueError as e:  # the data modules name the file and what is wrong with it
        raise ConfigError(f"--data-path: {e}" if not str(e).startswith("--") else str(e)) from None
    return config


def tokenizer_matches_data(config: Config, notes: List[str]) -> Config:
    """Data tokenized with one tokenizer must not train with another: preprocess_data.py's sidecar records the
    SHA-256 of the tokenizer's files. Data without a sidecar (made by Megatron-LM) passes with a note. A
    section of its own, after the tokenizer's and the data's: it reads the files both of them checked."""
    from megatron_lite.data.sidecar import SidecarError, read_sidecar, sidecar_path, tokenizer_sha256

    d = config.data
    if not d.data_path or d.tokenizer_type == "NullTokenizer":  # ids are taken as they are: nothing to compare
        return config
    ours = None
    for _, prefix in d.data_path:
        if not os.path.isfile(sidecar_path(prefix)):
            notes.append(f"--data-path {prefix}: no {os.path.basename(sidecar_path(prefix))} sidecar (not made by "
                         f"tools/preprocess_data.py), so its tokenizer cannot be checked against {_files_flags(d)}")
            continue
        try:
            recorded = (read_sidecar(prefix).get("tokenizer") or {}).get("model_sha256")
        except SidecarError as e:
            raise ConfigError(f"--data-path: {e}") from None
        if not recorded:
            continue
        ours = ours or tokenizer_sha256(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file)
        if recorded != ours:
            raise ConfigError(f"--data-path {prefix} was tokenized with {TOKENIZER_FILES_NAME[d.tokenizer_type]} of "
                              f"SHA-256 {recorded[:12]}..., but {_files_flags(d)} "
                              f"{'are' if d.vocab_file else 'is'} {ours[:12]}...: the token ids would mean other "
                              f"tokens; give the tokenizer the data was made with")
    return config


def _files_flags(d) -> str:
    """'--tokenizer-model PATH' or '--vocab-file V --merge-file M': the flags naming a run's tokenizer files."""
    given = [(flag, path) for flag, path in (("--tokenizer-model", d.tokenizer_model), ("--vocab-file", d.vocab_file),
                                             ("--merge-file", d.merge_file)) if path]
    return " ".join(f"{flag} {path}" for flag, path in given) or "the tokenizer"


def tokenizer_rules(config: Config, notes: List[str]) -> Config:
    """Which tokenizer, and the vocabulary it decides: a tokenizer read from files (SentencePiece, GPT-2 BPE,
    Hugging Face) has its own size, and a --vocab-size that disagrees with it is refused. Every file flag is
    checked before anything else, so a missing file costs one line naming it. The padded size is derived here."""
    d, m = config.data, config.model
    for flag, path in (("--tokenizer-model", d.tokenizer_model), ("--vocab-file", d.vocab_file),
                       ("--merge-file", d.merge_file)):
        if path is not None and not (flag == "--tokenizer-model" and os.path.isdir(path)):
            check_readable_file(path, flag, GPT2_HINT if flag != "--tokenizer-model" else TOKENIZER_FILE_HINT)
    kind = d.tokenizer_type
    if kind is not None and kind not in TOKENIZER_TYPES:
        raise ConfigError(f"--tokenizer-type {kind} is not one of {', '.join(TOKENIZER_TYPES)}")
    if kind in SENTENCEPIECE_TYPES:
        kind = "SentencePieceTokenizer"
    kind = kind or inferred_tokenizer_type(d.tokenizer_model, d.vocab_file, d.merge_file, m.vocab_size)
    vocab = m.vocab_size
    if kind is None:
        if d.data_path:
            raise ConfigError("--data-path needs a vocabulary: give --tokenizer-type SentencePieceTokenizer "
                              "--tokenizer-model PATH.model (or GPT2BPETokenizer --vocab-file --merge-file, or "
                              "HuggingFaceTokenizer --tokenizer-model FOLDER), or --tokenizer-type NullTokenizer "
                              "--vocab-size N")
        return config
    refusal = tokenizer_flags_refusal(kind, {field: getattr(d, field) for field in ("tokenizer_model", "vocab_file",
                                                                                  "merge_file")})
    if refusal or (kind == "NullTokenizer" and vocab is None):
        raise ConfigError(refusal or f"--tokenizer-type {kind} needs {TOKENIZER_NEEDS[kind]}")
    config = config.replace(data__tokenizer_type=kind)
    if kind != "NullTokenizer":
        try:
            tokenizer = build_tokenizer(kind, d.tokenizer_model, None, d.vocab_file, d.merge_file)
        except (OSError, ValueError) as e:  # the tokenizer names the flag and the file
            raise ConfigError(str(e)) from None
        if vocab is not None and vocab != tokenizer.vocab_size:
            raise ConfigError(
                f"--vocab-size {vocab} disagrees with {_files_flags(d)}, which has {tokenizer.vocab_size} "
                f"{'pieces' if kind == 'SentencePieceTokenizer' else 'tokens'}; the tokenizer decides the "
                f"vocabulary: drop --vocab-size (or use --vocab-size {tokenizer.vocab_size})"
            )
        vocab = tokenizer.vocab_size
        if d.eod_mask_loss and tokenizer.eod < 0:
            raise ConfigError(f"--eod-mask-loss masks the end-of-document token, but {_files_flags(d)} names "
                              f"none (no eos_token); drop --eod-mask-loss or give a tokenizer with one")
    tp = config.parallel.tensor_model_parallel_size
    note = vocab_padding_note(vocab, m.make_vocab_size_divisible_by, tp)
    if note:
        notes.append(note)
    return config.replace(model__vocab_size=vocab,
                          model__padded_vocab_size=pad_vocab_size(vocab, m.make_vocab_size_divisible_by, tp))


def deepspeed_rules(config: Config, notes: List[str]) -> Config:
    """Read --deepspeed-config once, keep its contents in the config, and check that merging it
    under ours contradicts nothing (the merge is what the engine will use)."""
    t = config.training
    if t.deepspeed_config is None:
        return config
    path = t.deepspeed_config
    if t.deepspeed_config_contents is None:
        check_readable_file(path, "--deepspeed-config", "give a DeepSpeed JSON file")
        try:
            contents = read_json(path)
        except UnreadableFile as e:
            raise ConfigError(f"--deepspeed-config {e}") from None
        if not isinstance(contents, dict):
            raise ConfigError(f"--deepspeed-config {path}: must hold a JSON object, got {type(contents).__name__}")
        config = config.replace(training__deepspeed_config_contents=contents)
    from megatron_lite.deepspeed_config import deepspeed_config

    deepspeed_config(config)  # raises ConfigError naming the contradicting key
    return config

