#!/usr/bin/env bash
# GPU validation in one command, on a machine with CUDA torch (see README.md, "GPU check"):
# installs the wheels scripts/gpu_wheels.sh put in .whl/, builds megatron_lite._C with its CUDA
# kernels, runs the CUDA tests, the fused-softmax table, a ~1.3B GPT and a bf16-vs-fp32 curve, each
# within a time budget, and writes gpu_check.md (summary table first), .json and .log into $OUT
# when set, else gpu_check_report/. Exits 1 when a step failed; the report says which.
#
#   bash scripts/gpu_check.sh                               # all steps (~20 min on one H100)
#   bash scripts/gpu_check.sh --steps env,install,build,a --total-budget 540   # in parts, where one
#   bash scripts/gpu_check.sh --steps b,c --resume --total-budget 540     # command may run at most
#   bash scripts/gpu_check.sh --steps d --resume --total-budget 540       # 10 minutes
#   bash scripts/gpu_check.sh --dry-run                     # on the CPU, tiny sizes (the test suite runs it)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" benchmarks/gpu_check/run.py "$@"
