"""A small corpus and GPT-2-style tokenizer files built the same, byte for byte, on every machine.

The BPE is learnt here in plain Python (greedy: the most frequent pair, ties by the pair's text), not by a
library trainer, so the files, and the token ids Megatron-LM writes from them (whose hash the tests keep),
cannot change with a library version. The Hugging Face folder holds the same BPE as a tokenizer.json that
also adds a BOS (as Llama 3's does) and treats <|endoftext|> in text as its special token.
"""
import collections
import json
import os
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

EOD = "<|endoftext|>"
BOS = "<|begin|>"
WORDS = ["the", "model", "tokenizer", "isn't", "they're", "we've", "I'm", "you'll", "she'd", "it's", "data",
         "parallel", "café", "naïve", "日本語", "テキスト", "😀", "🚀🚀", "12345", "3.14", "x=y+1;", "def", "return",
         EOD, BOS, "Ünïcödé", "-- ", "\t", "\n", "  ", "\r\n", "a" * 40, "((", "))", "€100", "\x1c", "\u00a0",
         "\u2028", "\u3000"]


def corpus_texts(documents=150, seed=0):
    """Documents of random words and separators, some empty, some with <|endoftext|> spelled out."""
    rng = random.Random(seed)
    return ["".join(rng.choice(WORDS) + rng.choice([" ", " ", " ", "", "\n", ", "])
                    for _ in range(rng.randrange(0, 60))) for _ in range(documents)]


def byte_alphabet():
    """GPT-2's printable stand-in for each byte, in GPT-2's id order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(rest))]


def learn_bpe(texts, merges_wanted):
    """(vocab, merges): the 256 byte symbols, then one token per merge, then <|endoftext|> last (as GPT-2's)."""
    words = collections.Counter(piece for text in texts
                                for piece, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text))
    vocab = {symbol: i for i, symbol in enumerate(byte_alphabet())}
    parts = {word: list(word) for word in words}
    merges = []
    for _ in range(merges_wanted):
        pairs = collections.Counter()
        for word, count in words.items():
            for pair in zip(parts[word], parts[word][1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        vocab.setdefault(best[0] + best[1], len(vocab))
        for word, symbols in parts.items():
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            parts[word] = merged
    vocab[EOD] = len(vocab)
    return vocab, merges


def write_corpus(path, texts):
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return str(path)


def write_gpt2_files(folder, texts, merges_wanted=300):
    """(vocab.json, merges.txt) as GPT-2 writes them: the merges after a '#version' header."""
    os.makedirs(folder, exist_ok=True)
    vocab, merges = learn_bpe(texts, merges_wanted)
    vocab_file, merge_file = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        f.write(json.dumps(vocab, ensure_ascii=False))
    with open(merge_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return vocab_file, merge_file


def write_hf_folder(folder, vocab_file, merge_file, config=None):
    """A Hugging Face tokenizer folder with the same BPE: tokenizer.json (BOS added to every text, <|endoftext|>
    and <|begin|> special) and a tokenizer_config.json naming eos and bos (`config` replaces it; False: none)."""
    os.makedirs(folder, exist_ok=True)
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(merge_file, encoding="utf-8") as f:
        merges = [tuple(line.split(" ")) for line in f.read().splitlines()[1:]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOD, BOS])
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                             special_tokens=[(BOS, bos)])
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    if config is not False:
        config = config or {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOD}
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
    return str(folder)
