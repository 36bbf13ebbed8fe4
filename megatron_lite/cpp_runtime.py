"""Which C++ runtime the built extension (megatron_lite._C) loads: it must be the shared libstdc++.

Measured on the H100 GPU image (torch 2.11.0+cu130, 2026-11-26): its CXX was a wrapper,
/opt/gcc/bin/g++, whose library search path made the link take libstdc++ statically (the built
module listed no libstdc++ among its needed libraries). A second C++ runtime beside the one torch
loads broke C++ error reporting: every fused-softmax argument check whose message formats a
number or a shape ended the process with a segmentation fault instead of raising RuntimeError
(checks that format only a dtype raised), in the CPU op as well as the CUDA one. Built with
/usr/bin/g++ on the same machine, the same check raised. Reproduced here on the CPU with
LDFLAGS=-static-libstdc++: the check raised, but its message ended where the first number
should have been ("mask shape ["). setup.py calls check_shared_cpp_runtime
after building, so such a build fails there, naming CXX, instead of crashing a training run.

Stdlib only: setup.py loads this file before the package is installed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import List, Optional

MARKER = "links the C++ runtime statically"


def needed_libraries(path: str) -> Optional[List[str]]:
    """The shared libraries an ELF file names as needed (DT_NEEDED), or None where that cannot be
    read here (not Linux, no readelf, not an ELF file)."""
    readelf = shutil.which("readelf")
    if not sys.platform.startswith("linux") or readelf is None:
        return None
    done = subprocess.run([readelf, "-d", path], capture_output=True, text=True)
    if done.returncode != 0:
        return None
    return [line.split("[", 1)[1].split("]", 1)[0] for line in done.stdout.splitlines()
            if "(NEEDED)" in line and "[" in line]


def check_shared_cpp_runtime(path: str) -> None:
    """Raise RuntimeError, naming the compiler, when the C++ extension at `path` does not load libstdc++.so."""
    needed = needed_libraries(path)
    if needed is None or any(name.startswith("libstdc++") for name in needed):
        return
    compiler = os.environ.get("CXX", "c++ (CXX unset)")
    raise RuntimeError(
        f"{os.path.basename(path)} {MARKER}: its needed libraries are {', '.join(needed) or 'none'}, without "
        f"libstdc++.so. The compiler, {compiler}, took libstdc++.a (or LDFLAGS asked for -static-libstdc++); with a "
        "second C++ runtime beside torch's, a C++ check crashes the process (segmentation fault) or loses its "
        "message instead of raising. Build with a compiler that links libstdc++.so and no -static-libstdc++, e.g. "
        "CXX=/usr/bin/g++ CC=/usr/bin/gcc pip install --no-build-isolation -e .")
