#!/usr/bin/env bash
# Install what the tests need (CPU torch first, so nothing pulls CUDA wheels), build the
# package's C++ extension, check that the CUDA sources compile (nvcc, no GPU needed; skipped
# without nvcc), and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q --no-build-isolation -e ".[test]"
bash tools/check_cuda_compile.sh
python3 -m pytest "$@"
