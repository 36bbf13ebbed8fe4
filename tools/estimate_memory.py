"""Memory per rank, stage by stage, for a model and a layout (pretrain_gpt.py's flags).

    python tools/estimate_memory.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \\
        --seq-length 2048 --vocab-size 50257 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --micro-batch-size 1 --global-batch-size 512 --zero-stage 1 --bf16 --world-size 64 [--gpu-memory-gb 80]

Formulas and their sources: megatron_lite/model/memory.py.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.arguments import parse_args  # noqa: E402
from megatron_lite.config import ConfigError  # noqa: E402
from megatron_lite.model import memory  # noqa: E402
from megatron_lite.deepspeed_config import deepspeed_config  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Per-stage memory estimate. Every other flag is a pretrain_gpt.py flag (model, layout, batch, "
                    "precision); --data-path is not needed (give --vocab-size).", allow_abbrev=False)
    parser.add_argument("--world-size", type=int, required=True, help="GPUs (processes) in the job")
    parser.add_argument("--gpu-memory-gb", type=float, default=None, help="say whether the peak fits in this many GiB")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where training runs (only dropout masks differ); default cuda")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    own, model_argv = parser.parse_known_args(argv)
    if own.world_size < 1:
        parser.error(f"--world-size must be at least 1, got {own.world_size}")
    if own.gpu_memory_gb is not None and own.gpu_memory_gb <= 0:
        parser.error(f"--gpu-memory-gb must be a positive number of GiB per GPU (e.g. 80), got {own.gpu_memory_gb}")
    try:
        config, _ = parse_args(model_argv, own.world_size)
        stages = memory.estimate(config, deepspeed_config(config), device=own.device)
    except ConfigError as e:
        print(f"estimate_memory.py: error: {e}", file=sys.stderr)
        return 2
    if own.json:
        print(json.dumps([st.to_dict() for st in stages], indent=1))
        return 0
    p = config.parallel
    print(f"TP {p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size} x DP {p.data_parallel_size}, "
          f"micro batch {config.batch.micro_batch_size}, gas {config.batch.gradient_accumulation_steps}, "
          f"ZeRO {p.zero_stage}{' + offload' if p.cpu_offload else ''}, {config.precision.dtype_name}"
          f"{', sequence parallel' if p.sequence_parallel else ''}{_recompute(config.model)} (GiB per rank)")
    gpu = int(own.gpu_memory_gb * memory.GIB) if own.gpu_memory_gb else None
    print(memory.format_table(stages, gpu))
    return 0


def _recompute(model) -> str:
    if model.recompute_granularity == "full":
        return f", full recompute ({model.recompute_method}, {model.recompute_num_layers})"
    return ", selective recompute" if model.recompute_granularity == "selective" else ""


if __name__ == "__main__":
    sys.exit(main())
