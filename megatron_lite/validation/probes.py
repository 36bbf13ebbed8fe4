"""Rules that read files: datasets, the tokenizer model, the DeepSpeed JSON.

They run in the same validation pass as the field rules, before any process
group exists, so a missing file or an empty split costs one clear line.
"""
from __future__ import annotations

import json
import os
from typing import List

from megatron_lite.config import Config, ConfigError, pad_vocab_size, vocab_padding_note
from megatron_lite.data.tokenizer import SENTENCEPIECE_TYPES, TOKENIZER_TYPES
from megatron_lite.validation.rules import split_rules

DATA_HINT = ("give the prefix of a .bin/.idx pair written by tools/preprocess_data.py "
             "(e.g. data/corpus_text_document)")


def check_readable_file(path: str, flag: str, hint: str) -> None:
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file; {hint}")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{flag} {path}: file is not readable (permissions); {hint}")


def data_rules(config: Config, notes: List[str]) -> Config:
    """Weights, readable and well-formed .bin/.idx pairs, and a split that leaves every wanted split data."""
    d = config.data
    if d.num_workers < 0:
        raise ConfigError(f"--num-workers must be 0 or more, got {d.num_workers}")
    split_rules(d.split)
    for weight, prefix in d.data_path:
        if weight <= 0:
            raise ConfigError(f"--data-path weight {weight:g} for '{prefix}' must be positive")
    if not d.data_path:
        return config
    for _, prefix in d.data_path:
        for suffix in (".bin", ".idx"):
            check_readable_file(prefix + suffix, "--data-path", DATA_HINT)
    tokenizer_matches_data(config, notes)
    from megatron_lite.data.gpt_dataset import check_splits
    from megatron_lite.data.indexed_dataset import IndexedDataset

    try:
        datasets = [IndexedDataset(prefix) for _, prefix in d.data_path]
        gbs, t = config.batch.global_batch_size, config.training
        check_splits(datasets, d.split, (t.train_iters * gbs, t.eval_iters * gbs, t.eval_iters * gbs))
    except ValueError as e:  # the data modules name the file and what is wrong with it
        raise ConfigError(f"--data-path: {e}" if not str(e).startswith("--") else str(e)) from None
    return config


def tokenizer_matches_data(config: Config, notes: List[str]) -> None:
    """Data tokenized with one SentencePiece model must not train with another: preprocess_data.py's
    sidecar records the model's SHA-256. Data without a sidecar (made by Megatron-LM) passes with a note."""
    from megatron_lite.data.sidecar import SidecarError, file_sha256, read_sidecar, sidecar_path

    model = config.data.tokenizer_model
    if not model:  # a NullTokenizer: ids are taken as they are, there is no model to compare
        return
    ours = None
    for _, prefix in config.data.data_path:
        if not os.path.isfile(sidecar_path(prefix)):
            notes.append(f"--data-path {prefix}: no {os.path.basename(sidecar_path(prefix))} sidecar (not made by "
                         f"tools/preprocess_data.py), so its tokenizer cannot be checked against --tokenizer-model")
            continue
        try:
            recorded = (read_sidecar(prefix).get("tokenizer") or {}).get("model_sha256")
        except SidecarError as e:
            raise ConfigError(f"--data-path: {e}") from None
        if not recorded:
            continue
        ours = ours or file_sha256(model)
        if recorded != ours:
            raise ConfigError(f"--data-path {prefix} was tokenized with a SentencePiece model of SHA-256 "
                              f"{recorded[:12]}..., but --tokenizer-model {model} is {ours[:12]}...: the token ids "
                              f"would mean other pieces; give the tokenizer model the data was made with")


def tokenizer_rules(config: Config, notes: List[str]) -> Config:
    """Which tokenizer, and the vocabulary it decides: a SentencePiece model's size wins, and a
    --vocab-size that disagrees with it is refused. The padded size is derived here."""
    d, m = config.data, config.model
    kind = d.tokenizer_type
    if kind is not None and kind not in TOKENIZER_TYPES:
        raise ConfigError(f"--tokenizer-type {kind} is not one of {', '.join(TOKENIZER_TYPES)}")
    if kind in SENTENCEPIECE_TYPES:
        kind = "SentencePieceTokenizer"
    vocab = m.vocab_size
    if d.tokenizer_model is not None:
        check_readable_file(d.tokenizer_model, "--tokenizer-model",
                            "train one with tools/train_tokenizer.py or point at an existing .model file")
        if kind is None:
            kind = "SentencePieceTokenizer"
    if kind is None and vocab is not None:
        kind = "NullTokenizer"
    if kind == "SentencePieceTokenizer" and d.tokenizer_model is None:
        raise ConfigError("--tokenizer-type SentencePieceTokenizer needs --tokenizer-model PATH.model")
    if kind == "NullTokenizer" and vocab is None:
        raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size N")
    if d.data_path and kind is None:
        raise ConfigError(
            "--data-path needs a vocabulary: give --tokenizer-type SentencePieceTokenizer --tokenizer-model "
            "PATH.model, or --tokenizer-type NullTokenizer --vocab-size N"
        )
    if kind == "SentencePieceTokenizer":
        model_vocab = sentencepiece_vocab_size(d.tokenizer_model)
        if vocab is not None and vocab != model_vocab:
            raise ConfigError(
                f"--vocab-size {vocab} disagrees with --tokenizer-model {d.tokenizer_model}, which has "
                f"{model_vocab} pieces; the tokenizer decides the vocabulary: drop --vocab-size "
                f"(or use --vocab-size {model_vocab})"
            )
        vocab = model_vocab
    config = config.replace(data__tokenizer_type=kind)
    if vocab is None:
        return config
    tp = config.parallel.tensor_model_parallel_size
    note = vocab_padding_note(vocab, m.make_vocab_size_divisible_by, tp)
    if note:
        notes.append(note)
    return config.replace(model__vocab_size=vocab,
                          model__padded_vocab_size=pad_vocab_size(vocab, m.make_vocab_size_divisible_by, tp))


def sentencepiece_vocab_size(path: str) -> int:
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(path)
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"--tokenizer-model {path}: not a readable SentencePiece model ({e})") from None
    return processor.vocab_size()


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
            with open(path) as f:
                contents = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"--deepspeed-config {path}: not valid JSON ({e})") from None
        if not isinstance(contents, dict):
            raise ConfigError(f"--deepspeed-config {path}: must hold a JSON object, got {type(contents).__name__}")
        config = config.replace(training__deepspeed_config_contents=contents)
    from megatron_lite.training.deepspeed_config import deepspeed_config

    deepspeed_config(config)  # raises ConfigError naming the contradicting key
    return config

