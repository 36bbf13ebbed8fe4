"""Keys and values of the tokens seen so far, one cache per attention layer, for incremental decoding."""
from __future__ import annotations

from typing import Optional, Tuple

import torch


class KVCache:
    def __init__(self):
        self.keys: Optional[torch.Tensor] = None  # [b, np, tokens so far, hd]
        self.values: Optional[torch.Tensor] = None

    @property
    def offset(self) -> int:
        """Tokens already cached: the position of the next token."""
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        return self.keys, self.values
