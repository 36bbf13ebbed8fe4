"""Tokenizers behind the small interface the rest of the code uses.

`vocab_size`, `eod`, `bos`, `pad`, `tokenize(text) -> list[int]`,
`tokenize_batch(texts) -> list of int arrays`, `detokenize(ids) -> str`. An id
of -1 means the tokenizer has no such token (SentencePiece's convention). Each
gives the ids Megatron-LM's tokenizer of the same `--tokenizer-type` gives, so
that tools/preprocess_data.py writes Megatron-LM's bytes. No torch here:
tools/preprocess_data.py imports this module in every worker.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from megatron_lite.config import TOKENIZER_TYPES
from megatron_lite.reading import UnreadableFile, file_problem, read_json, read_text

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")
GPT2_EOD = "<|endoftext|>"
TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")
"""The config fields (data section; flags of the same names) that say which tokenizer."""
TOKENIZER_FILE_FIELDS = {**{kind: ("tokenizer_model",) for kind in SENTENCEPIECE_TYPES + ("HuggingFaceTokenizer",)},
                         "GPT2BPETokenizer": ("vocab_file", "merge_file"), "NullTokenizer": ()}
"""The config fields (flags) naming each type's files."""
TOKENIZER_NEEDS = {**{kind: "--tokenizer-model PATH.model" for kind in SENTENCEPIECE_TYPES},
                   "HuggingFaceTokenizer": "--tokenizer-model FOLDER (a Hugging Face tokenizer folder, or its "
                                           "tokenizer.json)",
                   "GPT2BPETokenizer": "--vocab-file VOCAB.json and --merge-file MERGES.txt",
                   "NullTokenizer": "--vocab-size N"}
"""What each type's flags are, as messages name them."""
HF_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
"""Files beside a tokenizer.json that name its special tokens (eos, bos, pad), as transformers reads them."""
GPT2_HINT = ("give GPT-2-style vocab.json and merges.txt (tools/train_tokenizer.py --model-type byte-level-bpe "
             "writes both)")
HF_HINT = ("give a Hugging Face tokenizer folder holding tokenizer.json, or the tokenizer.json "
           "(tools/train_tokenizer.py --model-type byte-level-bpe writes one)")


def _folder_holds(path: str) -> str:
    """What tokenizer a folder given where a file was wanted holds, and the flags that read it: a user who
    points --tokenizer-model at a byte-level BPE folder under SentencePieceTokenizer needs the type, not
    'no such file'."""
    def has(*names):
        return all(os.path.isfile(os.path.join(path, n)) for n in names)

    if has("tokenizer.json"):
        return "of a Hugging Face tokenizer (tokenizer.json): --tokenizer-type HuggingFaceTokenizer reads it"
    if has("vocab.json", "merges.txt"):
        return (f"of GPT-2's vocab.json and merges.txt: --tokenizer-type GPT2BPETokenizer --vocab-file "
                f"{os.path.join(path, 'vocab.json')} --merge-file {os.path.join(path, 'merges.txt')} reads them")
    if has("tokenizer.model"):
        return f"holding a SentencePiece model: give --tokenizer-model {os.path.join(path, 'tokenizer.model')}"
    return "not a file"


def file_refusal(path: str, flag: str, hint: str) -> Optional[str]:
    """Why `flag path` cannot be read as a file, in one line naming both, or None."""
    why = file_problem(path)
    if why is None:
        return None
    if os.path.isdir(path):
        return f"{flag} {path} is a folder {_folder_holds(path)}; {hint}"
    return f"{flag} {path}: {why}; {hint}"


def check_file(path: Optional[str], flag: str, hint: str) -> str:
    """`path` if it names a readable file; else FileNotFoundError naming the flag and the file."""
    if not path:
        raise ValueError(f"{flag} is needed: {hint}")
    refusal = file_refusal(path, flag, hint)
    if refusal:
        raise FileNotFoundError(refusal)
    return path


class SentencePieceTokenizer:
    """A trained SentencePiece model; end of document is the model's EOS id, as in Megatron-LM."""

    def __init__(self, model_path: str) -> None:
        if not model_path:
            raise ValueError("SentencePieceTokenizer needs --tokenizer-model PATH.model")
        check_file(model_path, "--tokenizer-model", "train one with tools/train_tokenizer.py")
        import sentencepiece

        self.model_path = model_path
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(model_path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"--tokenizer-model {model_path}: not a readable SentencePiece model ({e})") from None

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id()

    def tokenize(self, text: str) -> List[int]:
        # Default options (no BOS/EOS added) is what Megatron-LM's preprocessing calls.
        return self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        """Same ids as tokenize() per text, as int32 arrays; one call into C++ (one thread: workers are processes).

        Arrays, not lists: building a Python int per token cost 12-14% of the
        encode time on the stdlib corpus, and the ids are packed into arrays anyway.
        """
        return self._sp.encode_as_numpy(list(texts), num_threads=1)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))


class NullTokenizer:
    """For tests and synthetic data: text is whitespace-separated ids; eod is the last id."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or vocab_size < 2:
            raise ValueError(f"NullTokenizer needs --vocab-size of at least 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.bos = -1
        self.pad = -1

    def tokenize(self, text: str) -> List[int]:
        ids = [int(t) for t in text.split()]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer: ids {bad[:5]} outside [0, {self.vocab_size})")
        return ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        return [np.array(self.tokenize(t), dtype=np.int64) for t in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class _TokenizersBacked:
    """What both `tokenizers`-library tokenizers share: encode, decode, per-text batches. `_tokenizer` is the
    library's Tokenizer; `add_special_tokens`: whether its post-processor runs (a BOS it adds)."""

    _tokenizer = None
    add_special_tokens = False

    def tokenize(self, text: str) -> List[int]:
        return self._tokenizer.encode(text, add_special_tokens=self.add_special_tokens).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        return [np.array(self.tokenize(text), dtype=np.int32) for text in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


class GPT2BPETokenizer(_TokenizersBacked):
    """GPT-2's byte-level BPE from vocab.json + merges.txt, read as Megatron-LM's GPT2BPETokenizer reads them.

    Megatron-LM runs OpenAI's Python BPE: GPT-2's pre-tokenizer regex, bytes mapped to printable
    characters, merges applied by rank, a token missing from the vocabulary becoming id 0. The `tokenizers`
    library does the same steps in Rust. Text that spells <|endoftext|> is ordinary text there, so there
    are no added tokens here. Its merges are the lines of merges.txt after the first (the '#version'
    header) and before the last newline, split on whitespace; so they are here. eod: <|endoftext|>'s id.
    """

    def __init__(self, vocab_file: Optional[str], merge_file: Optional[str]) -> None:
        check_file(vocab_file, "--vocab-file", GPT2_HINT)
        check_file(merge_file, "--merge-file", GPT2_HINT)
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        try:
            vocab = read_json(vocab_file)
        except UnreadableFile as e:
            raise ValueError(f"--vocab-file {e}; give GPT-2's vocab.json") from None
        if not isinstance(vocab, dict) or not all(isinstance(i, int) and i >= 0 for i in vocab.values()):
            raise ValueError(f"--vocab-file {vocab_file}: not a GPT-2 vocab.json (a JSON object of token: id)")
        if GPT2_EOD not in vocab:
            raise ValueError(f"--vocab-file {vocab_file} has no {GPT2_EOD} token, which GPT2BPETokenizer uses as "
                             f"end of document")
        if vocab and max(vocab.values()) >= len(vocab):
            raise ValueError(f"--vocab-file {vocab_file}: ids must be 0..{len(vocab) - 1} for its {len(vocab)} "
                             f"tokens, but it has id {max(vocab.values())}")
        try:
            lines = read_text(merge_file).split("\n")[1:-1]
        except UnreadableFile as e:
            raise ValueError(f"--merge-file {e}; give GPT-2's merges.txt") from None
        merges = [pair for pair in (tuple(line.split()) for line in lines) if len(pair) == 2]
        id_zero = [token for token, i in vocab.items() if i == 0]
        try:
            model = models.BPE(vocab=vocab, merges=merges, unk_token=id_zero[0] if id_zero else None)
        except Exception as e:  # tokenizers raises a bare Exception for a merge whose result has no id
            raise ValueError(f"--merge-file {merge_file} does not fit --vocab-file {vocab_file} ({e})") from None
        self._tokenizer = Tokenizer(model)
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._tokenizer.decoder = decoders.ByteLevel()
        self.vocab_size = len(vocab)
        self.eod = vocab[GPT2_EOD]
        self.bos = -1
        self.pad = -1



def hf_tokenizer_json(path: Optional[str]) -> str:
    """--tokenizer-model of a HuggingFaceTokenizer (a folder, or its tokenizer.json) -> the tokenizer.json."""
    if not path:
        raise ValueError(f"HuggingFaceTokenizer needs --tokenizer-model: {HF_HINT}")
    if os.path.isdir(path):
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"--tokenizer-model {path}: the folder has no tokenizer.json (a slow "
                                    f"tokenizer's files alone are not read); {HF_HINT}")
        return check_file(file, "--tokenizer-model", HF_HINT)
    if not os.path.exists(path):
        raise FileNotFoundError(f"--tokenizer-model {path}: no such file or folder; {HF_HINT}")
    return check_file(path, "--tokenizer-model", HF_HINT)


def hf_side_files(tokenizer_json: str) -> List[str]:
    """The tokenizer_config.json / special_tokens_map.json beside a file named tokenizer.json (its folder is a
    Hugging Face tokenizer folder; beside a file of another name they would belong to something else)."""
    if os.path.basename(tokenizer_json) != "tokenizer.json":
        return []
    folder = os.path.dirname(tokenizer_json)
    return [os.path.join(folder, name) for name in HF_SIDE_FILES if os.path.isfile(os.path.join(folder, name))]


class HuggingFaceTokenizer(_TokenizersBacked):
    """A Hugging Face tokenizer.json, run by the `tokenizers` library as transformers runs it.

    Megatron-LM's HuggingFaceTokenizer loads the folder with transformers' AutoTokenizer and tokenizes with
    `tokenizer(text).input_ids`: the tokenizer.json's normalizer, pre-tokenizer, model and post-processor
    (which may add a BOS), with its truncation and padding switched off. Those are the steps here. eod, bos
    and pad are the eos, bos and pad tokens named by special_tokens_map.json, else tokenizer_config.json
    (transformers' precedence), beside tokenizer.json; -1 where none is named.
    """

    add_special_tokens = True

    def __init__(self, path: Optional[str]) -> None:
        from tokenizers import Tokenizer

        file = hf_tokenizer_json(path)
        try:
            self._tokenizer = Tokenizer.from_file(file)
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ValueError(f"--tokenizer-model {file}: not a readable tokenizer.json ({e})") from None
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.path = path
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        special = {}
        for side in hf_side_files(file):  # special_tokens_map.json comes last and wins
            special.update(_named_special_tokens(side))
        self.eod, self.bos, self.pad = (self._id_of(special.get(key), key, file)
                                        for key in ("eos_token", "bos_token", "pad_token"))

    def _id_of(self, token: Optional[str], key: str, file: str) -> int:
        if token is None:
            return -1
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"--tokenizer-model {file}: its {key} {token!r} is not in the vocabulary")
        return token_id



def _named_special_tokens(path: str) -> dict:
    """{"eos_token": "</s>", ...} from a tokenizer_config.json or special_tokens_map.json (a token may be
    written as a string or as {"content": ...})."""
    try:
        data = read_json(path)
    except UnreadableFile as e:
        raise ValueError(f"--tokenizer-model {e}") from None
    named = {}
    for key in ("eos_token", "bos_token", "pad_token"):
        value = data.get(key) if isinstance(data, dict) else None
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            named[key] = value
    return named


def inferred_tokenizer_type(tokenizer_model, vocab_file, merge_file, vocab_size) -> Optional[str]:
    """--tokenizer-type when not given: --vocab-file/--merge-file -> GPT2BPETokenizer; --tokenizer-model naming a
    folder or a .json file -> HuggingFaceTokenizer, another file -> SentencePieceTokenizer; --vocab-size alone ->
    NullTokenizer."""
    if vocab_file is not None or merge_file is not None:
        return "GPT2BPETokenizer"
    if tokenizer_model is not None:
        hf = os.path.isdir(tokenizer_model) or tokenizer_model.endswith(".json")
        return "HuggingFaceTokenizer" if hf else "SentencePieceTokenizer"
    return "NullTokenizer" if vocab_size is not None else None


def tokenizer_flags_refusal(tokenizer_type: str, files: dict, complete: bool = True) -> Optional[str]:
    """Why the file flags `files` ({"tokenizer_model": path or None, ...}) do not fit `--tokenizer-type`: a
    file the type does not read, or (`complete`: these are all there will be) one it needs left out; None when
    they fit."""
    for field, path in files.items():
        if path is not None and field not in TOKENIZER_FILE_FIELDS[tokenizer_type]:
            flag = "--" + field.replace("_", "-")
            return (f"{flag} {path} is not read by --tokenizer-type {tokenizer_type}, which takes "
                    f"{TOKENIZER_NEEDS[tokenizer_type]}; drop {flag} or give the type that reads it")
    if complete and any(files.get(field) is None for field in TOKENIZER_FILE_FIELDS[tokenizer_type]):
        return f"--tokenizer-type {tokenizer_type} needs {TOKENIZER_NEEDS[tokenizer_type]}"
    return None


def tokenizer_files(tokenizer_type: Optional[str], tokenizer_model: Optional[str] = None,
                    vocab_file: Optional[str] = None, merge_file: Optional[str] = None) -> List[Tuple[str, str]]:
    """(path, its name in a Hugging Face model folder) of each file the tokenizer reads, the file that
    defines its ids first: what an export copies beside the weights. NullTokenizer reads none."""
    if tokenizer_type in SENTENCEPIECE_TYPES:
        return [(check_file(tokenizer_model, "--tokenizer-model", "the SentencePiece model"), "tokenizer.model")]
    if tokenizer_type == "HuggingFaceTokenizer":
        file = hf_tokenizer_json(tokenizer_model)
        return [(file, "tokenizer.json")] + [(side, os.path.basename(side)) for side in hf_side_files(file)]
    if tokenizer_type == "GPT2BPETokenizer":
        return [(check_file(vocab_file, "--vocab-file", GPT2_HINT), "vocab.json"),
                (check_file(merge_file, "--merge-file", GPT2_HINT), "merges.txt")]
    return []


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str] = None, vocab_size: Optional[int] = None,
                    vocab_file: Optional[str] = None, merge_file: Optional[str] = None):
    """`--tokenizer-type` and the flags naming its files (`--tokenizer-model`, or `--vocab-file` and
    `--merge-file`), or `--vocab-size` for NullTokenizer -> a tokenizer. A missing file raises
    FileNotFoundError, an unusable one ValueError, each naming the flag and the file."""
    if tokenizer_type in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}")
