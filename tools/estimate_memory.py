"""Memory per rank, stage by stage, for a model and a layout (pretrain_gpt.py's flags).

    python tools/estimate_memory.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \\
        --seq-length 2048 --vocab-size 50257 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --micro-batch-size 1 --global-batch-size 512 --zero-stage 1 --bf16 --world-size 64 [--gpu-memory-gb 80]

--longest-sequence searches the longest --seq-length (a multiple of --sequence-step, and the longest power
of two) whose peak fits --gpu-memory-gb less --memory-margin, for that model and layout:

    python tools/estimate_memory.py <model and layout flags> --context-parallel-size 2 --world-size 64 \\
        --gpu-memory-gb 80 --memory-margin 0.1 --longest-sequence

Formulas and their sources: megatron_lite/cost/memory.py.
"""
import argparse
import json
import os
import sys
from typing import List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.arguments import parse_args  # noqa: E402
from megatron_lite.config import Config, ConfigError  # noqa: E402
from megatron_lite.cost import memory, model_state  # noqa: E402
from megatron_lite.deepspeed_config import deepspeed_config  # noqa: E402
from megatron_lite.flag_numbers import GPU_MEMORY_GB_MAX, add_number  # noqa: E402


def estimate_for(model_argv: Sequence[str], world_size: int, device: str) -> Tuple[Config, List[memory.StageMemory]]:
    config, _ = parse_args(list(model_argv), world_size)
    return config, memory.estimate(config, deepspeed_config(config), device=device)


def peak_at(model_argv: Sequence[str], world_size: int, device: str, seq: int) -> int:
    """The worst stage's peak at --seq-length seq (the last --seq-length given wins)."""
    return max(st.peak for st in estimate_for(list(model_argv) + ["--seq-length", str(seq)], world_size, device)[1])


def longest_sequence(model_argv: Sequence[str], world_size: int, budget: int, step: int = 1024,
                     device: str = "cuda", powers_of_two: bool = False) -> Tuple[int, Optional[int]]:
    """The longest sequence, a multiple of `step` (with powers_of_two: step x 2^k), whose peak is at most
    `budget` bytes, and that peak; (0, None) when `step` itself does not fit. The peak grows with the
    sequence, so the search doubles, then halves the interval. A length validation refuses (`step` not
    a multiple of CP, or of CP x TP with sequence parallelism) raises its ConfigError."""
    def fits(units: int) -> Optional[int]:
        peak = peak_at(model_argv, world_size, device, step << units if powers_of_two else step * units)
        return peak if peak <= budget else None

    first = 0 if powers_of_two else 1
    if fits(first) is None:
        return 0, None
    low, high = first, first + 1
    while fits(high) is not None:
        low, high = high, (high + 1 if powers_of_two else high * 2)
        if (step << high if powers_of_two else step * high) > 1 << 30:
            raise ConfigError("--longest-sequence: more than 2^30 tokens fit; is --gpu-memory-gb right?")
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) is not None else (low, middle)
    return (step << low if powers_of_two else step * low), fits(low)


def layout_line(config: Config) -> str:
    """The layout in one line: TP x CP x PP x DP, the sequence (and each CP rank's part), the savers."""
    p, seq = config.parallel, config.model.seq_length
    cp = p.context_parallel_size
    split = f" ({seq // cp} per CP rank, {p.cp_comm_type})" if cp > 1 else ""
    zero = f" over DP x CP = {model_state.zero_partitions(config)}" if p.zero_stage and cp > 1 else ""
    return (f"TP {p.tensor_model_parallel_size} x CP {cp} x PP {p.pipeline_model_parallel_size} x DP "
            f"{p.data_parallel_size}, seq {seq}{split}, micro batch {config.batch.micro_batch_size}, gas "
            f"{config.batch.gradient_accumulation_steps}, ZeRO {p.zero_stage}{' + offload' if p.cpu_offload else ''}"
            f"{zero}, {config.precision.dtype_name}{', sequence parallel' if p.sequence_parallel else ''}"
            f"{_recompute(config.model)}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="estimate_memory.py",
        description="Per-stage memory estimate. Every other flag is a pretrain_gpt.py flag (model, layout, batch, "
                    "precision); --data-path is not needed (give --vocab-size).", allow_abbrev=False)
    add_number(parser, "--world-size", minimum=1, required=True, example=8, help="GPUs (processes) in the job")
    add_number(parser, "--gpu-memory-gb", kind=float, above=0, maximum=GPU_MEMORY_GB_MAX, default=None, example=80,
               help="say whether the peak fits in this many GiB")
    add_number(parser, "--memory-margin", kind=float, minimum=0, below=1, default=0.0,
                        help="fraction of --gpu-memory-gb kept free (the CUDA context, allocator cache, "
                             "fragmentation); default 0, tune_parallelism.py plan's default is 0.1")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where training runs (only dropout masks differ); default cuda")
    parser.add_argument("--longest-sequence", action="store_true",
                        help="search the longest --seq-length that fits --gpu-memory-gb (less --memory-margin)")
    add_number(parser, "--sequence-step", minimum=1, default=1024,
                        help="with --longest-sequence: lengths are multiples of this (default 1024)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    own, model_argv = parser.parse_known_args(argv)
    if own.longest_sequence and own.gpu_memory_gb is None:
        parser.error("--longest-sequence needs --gpu-memory-gb (the memory the sequence must fit in)")
    gpu = int(own.gpu_memory_gb * memory.GIB * (1 - own.memory_margin)) if own.gpu_memory_gb else None
    try:
        if own.longest_sequence:
            return _print_longest(model_argv, own, gpu)
        config, stages = estimate_for(model_argv, own.world_size, own.device)
    except ConfigError as e:
        print(f"estimate_memory.py: error: {e}", file=sys.stderr)
        return 2
    if own.json:
        print(json.dumps([st.to_dict() for st in stages], indent=1))
        return 0
    print(f"{layout_line(config)} (GiB per rank)")
    print(memory.format_table(stages, gpu))
    return 0


def _print_longest(model_argv, own, budget: int) -> int:
    multiple, multiple_peak = longest_sequence(model_argv, own.world_size, budget, own.sequence_step, own.device)
    power, power_peak = longest_sequence(model_argv, own.world_size, budget, own.sequence_step, own.device,
                                         powers_of_two=True)
    if own.json:
        print(json.dumps({"budget_bytes": budget, "sequence_step": own.sequence_step,
                          "longest_multiple": multiple, "peak_bytes_multiple": multiple_peak,
                          "longest_power_of_two": power, "peak_bytes_power_of_two": power_peak}))
        return 0 if multiple else 1
    if not multiple:
        print(f"longest sequence: none; --seq-length {own.sequence_step} already needs more than "
              f"{budget / memory.GIB:.2f} GiB")
        return 1
    config, stages = estimate_for(list(model_argv) + ["--seq-length", str(multiple)], own.world_size, own.device)
    print(f"{layout_line(config)} (GiB per rank)")
    print(memory.format_table(stages))
    print(f"longest sequence: {multiple:,} (multiple of {own.sequence_step}, peak {multiple_peak / memory.GIB:.2f} GiB)"
          + (f", {power:,} as a power of two (peak {power_peak / memory.GIB:.2f} GiB)" if power else "")
          + f"; budget {budget / memory.GIB:.2f} GiB = {own.gpu_memory_gb:g} GiB less {own.memory_margin:.0%}")
    return 0


def _recompute(model) -> str:
    if model.recompute_granularity == "full":
        return f", full recompute ({model.recompute_method}, {model.recompute_num_layers})"
    return ", selective recompute" if model.recompute_granularity == "selective" else ""


if __name__ == "__main__":
    sys.exit(main())
