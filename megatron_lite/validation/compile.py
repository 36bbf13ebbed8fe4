"""--compile: the combinations that cannot run compiled, refused before any process group exists.

  --compile-backend aot_eager without --compile   nothing would be compiled: the flag would be ignored
  --compile with --zero-stage 3                    ZeRO 3 gathers each layer's parameters in module hooks that change
                                                   what dynamo guards on: every call recompiled until dynamo's limit
                                                   (measured: the recompile limit is hit in the first step)
  --compile (inductor) without its code generator  a C++ compiler on CPU, triton on CUDA; aot_eager needs neither
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from typing import List

from megatron_lite.config import Config, ConfigError


def compile_rules(config: Config, notes: List[str]) -> Config:
    m = config.model
    if not m.compile:
        if m.compile_backend != "inductor":
            raise ConfigError(f"--compile-backend {m.compile_backend} without --compile compiles nothing; add "
                              f"--compile, or drop --compile-backend", code="compile_backend_without_compile")
        return config
    if config.parallel.zero_stage == 3:
        raise ConfigError("--compile with --zero-stage 3: ZeRO 3 gathers each layer's parameters in module hooks "
                          "that a compiled layer recompiles for at every call; use --zero-stage 0, 1 or 2 with "
                          "--compile, or drop --compile", code="compile_zero3")
    if m.compile_backend == "inductor":
        missing = _inductor_missing()
        if missing:
            raise ConfigError(f"--compile (backend inductor) {missing}; or use --compile-backend aot_eager (traced, "
                              f"no generated kernels), or drop --compile", code="compile_inductor_missing")
    return config


def _inductor_missing() -> str:
    """What inductor lacks on this machine's device to generate kernels, or ''."""
    import torch  # here: the tools validate their flags before they pay torch's import (tests/test_tool_startup.py)

    if torch.cuda.is_available():
        return "" if importlib.util.find_spec("triton") else "needs triton on CUDA: pip install triton (the version torch pins)"
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) or shutil.which("c++"):
        return ""
    return f"needs a C++ compiler on CPU ({compiler} not found): install g++ or set CXX"
