"""generate.py's --prompt as token ids: text through the model's tokenizer, or, for a NullTokenizer model (which
has no text form), whitespace-separated ids below its vocabulary size. Torch-free."""
from __future__ import annotations

from typing import List


def prompt_ids(tokenizer, prompt: str) -> List[int]:
    """The ids of `prompt`; ValueError naming --prompt when a NullTokenizer model is given text."""
    if type(tokenizer).__name__ != "NullTokenizer":
        return tokenizer.tokenize(prompt)
    words = prompt.split()
    bad = [w for w in words if not (w.isascii() and w.isdigit() and int(w) < tokenizer.vocab_size)]
    if bad:
        raise ValueError(f"--prompt: {bad[0]!r} is not a token id: a NullTokenizer model's prompt is whitespace-separated "
                         f"token ids 0 to {tokenizer.vocab_size - 1}, such as \"1 2 3\" (or give --tokenizer-type "
                         f"and --tokenizer-model of a tokenizer with this vocabulary)")
    return [int(w) for w in words]
