"""ConfigError: the one exception of a refused flag or config, with the kind of problem it is."""
from __future__ import annotations

from typing import Optional, Sequence


class ConfigError(ValueError):
    """An inconsistent or unusable flag; the message names the flag, the value and a fix.

    `code` says what kind of problem it is (e.g. `batch_not_divisible`), for tools that sort
    problems (the tuning planner's rejections); `codes` lists one per problem when validation
    found several."""

    def __init__(self, message: str, code: str = "invalid", codes: Optional[Sequence[str]] = None):
        super().__init__(message)
        self.codes = tuple(codes) if codes else (code,)
        self.code = self.codes[0]
