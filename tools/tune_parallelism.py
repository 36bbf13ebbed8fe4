"""Find a fast TP / CP / PP / EP / micro-batch / gas layout: plan candidates, sweep them as short real runs, report.

    python tools/tune_parallelism.py calibrate --output profile.json [--device cpu|cuda] [--world-size 4]
    python tools/tune_parallelism.py plan --nodes 4 --gpus-per-node 8 --gpu-memory-gb 80 \\
        <pretrain_gpt.py model flags> --global-batch-size 1024 [--profile profile.json] --output plan.json
    python tools/tune_parallelism.py sweep --plan plan.json --results sweep/ \\
        --launcher "torchrun --nproc_per_node {gpus_per_node} --nnodes {nodes} --master_port {port}" \\
        -- <fixed pretrain_gpt.py flags: --data-path, --tokenizer-*, ...>
    python tools/tune_parallelism.py report --results sweep/ [--sort-by tokens_per_s]

calibrate: measures this machine (GEMM FLOP/s, copy GB/s, each collective's latency and bandwidth) and, given
model flags after `--`, the model's own steps on CPU ranks at world sizes 2, 4, ... (tuning/measure_model.py) into a
JSON profile that `plan --profile` prices layouts with instead of the --peak-tflops / --*-gbps constants.
plan: the model is described with pretrain_gpt.py's own flags (no --data-path needed; give --vocab-size).
sweep: launcher placeholders are listed by `sweep --help`. report: markdown, CSV, PNG plots, best command line.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.config import ConfigError  # noqa: E402
from megatron_lite.flag_numbers import GPU_MEMORY_GB_MAX, add_number  # noqa: E402
from megatron_lite.targets import OVERWRITE_HELP, target_problem  # noqa: E402


def add_parallel_bounds(parser: argparse.ArgumentParser, verb: str, none: str) -> None:
    """--max-context-parallel and --max-expert-parallel: plan and calibrate bound the same layouts (calibrate
    times the CP and EP sizes plan may try, so give both the same bounds)."""
    add_number(parser, "--max-context-parallel", minimum=1, default=None, example=2,
               help=f"largest --context-parallel-size {verb} (1, 2, 4, ...; default: up to the heads per TP rank; 1 "
                    f"{none} context parallelism)")
    add_number(parser, "--max-expert-parallel", minimum=1, default=None, example=2,
               help=f"an MoE model's largest --expert-model-parallel-size {verb} (default: up to --num-experts; 1 "
                    f"{none} expert parallelism)")


def plan_parser() -> argparse.ArgumentParser:
    from megatron_lite.tuning import candidates

    parser = argparse.ArgumentParser(prog="tune_parallelism.py plan", allow_abbrev=False,
                                     description="Candidate layouts for a cluster. Every flag not listed here is a "
                                                 "pretrain_gpt.py flag describing the model and the batch.")
    add_number(parser, "--nodes", minimum=1, required=True, example=4)
    add_number(parser, "--gpus-per-node", minimum=1, required=True, example=8)
    add_number(parser, "--gpu-memory-gb", kind=float, above=0, maximum=GPU_MEMORY_GB_MAX, required=True, example=80,
               help="memory per GPU, GiB")
    add_number(parser, "--memory-margin", kind=float, minimum=0, below=1, default=0.1,
               help="fraction of GPU memory kept free for the CUDA context, allocator cache and fragmentation "
                    "(default 0.1)")
    add_number(parser, "--max-micro-batch", minimum=1, default=8, help="largest micro batch tried (powers of 2)")
    parser.add_argument("--order", choices=("shaden", "throughput"), default="shaden",
                        help="shaden: the recipe's order (gas >= 8 PP, TP = GPUs per node (TP x EP for an MoE "
                             "model), fewest stages, the largest EP, micro batch 1 first); throughput: predicted "
                             "tokens/s")
    parser.add_argument("--micro-batch-probe", action="store_true",
                        help="Samyam's mode: one node, --probe-layers layers at full hidden size, micro batch 1..64")
    add_number(parser, "--probe-layers", minimum=1, default=2)
    add_parallel_bounds(parser, "tried", "plans without")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the runs will train")
    add_number(parser, "--peak-tflops", kind=float, above=0, maximum=1e6, default=312.0,
               help="16-bit dense peak per GPU (A100 312)")
    add_number(parser, "--intra-node-gbps", kind=float, above=0, maximum=1e6, default=150.0)
    add_number(parser, "--inter-node-gbps", kind=float, above=0, maximum=1e6, default=25.0)
    parser.add_argument("--profile", default=None,
                        help="a profile from `tune_parallelism.py calibrate` (measured on --device): predict step "
                             "times from it instead of --peak-tflops and the --*-gbps constants")
    parser.add_argument("--all-savers", action="store_true",
                        help="keep every memory saver that fits a layout as its own candidate (sweep recompute and "
                             "sequence parallelism too), not only the fastest")
    parser.add_argument("--output", default=None, help=f"plan JSON (default: print only); the ZeRO-3 candidates' "
                                                       f"{candidates.OFFLOAD_PARAM_JSON} is written beside it")
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    add_number(parser, "--show", minimum=0, default=30, help="rows of the table to print")
    return parser


def _plan(argv) -> int:
    from megatron_lite.tuning import calibration, candidates, plan_output, recipe
    from megatron_lite.tuning.throughput import Hardware

    parser = plan_parser()
    own, model_argv = parser.parse_known_args(argv)
    if own.output:
        why = (target_problem("--output", own.output, [own.output], own.overwrite)
               or candidates.offload_json_problem(own.output, own.overwrite))
        if why:
            parser.error(why)
    profile = None
    if own.profile:
        profile = calibration.load(own.profile)
        calibration.check_device(profile, own.profile, own.device)
    hw = Hardware(gpus_per_node=own.gpus_per_node, peak_tflops=own.peak_tflops,
                  intra_node_gbps=own.intra_node_gbps, inter_node_gbps=own.inter_node_gbps)
    # The ZeRO-3 parameter-offload candidates name a DeepSpeed JSON written next to the plan.
    workdir = os.path.dirname(os.path.abspath(own.output)) if own.output else None  # None: plan makes a temporary one
    start = time.time()
    p = recipe.plan(model_argv, own.nodes, own.gpus_per_node, own.gpu_memory_gb, own.memory_margin,
                    own.max_micro_batch, own.order, hw, own.device, workdir, own.micro_batch_probe, own.probe_layers,
                    max_context_parallel=own.max_context_parallel, profile=profile, all_savers=own.all_savers,
                    max_expert_parallel=own.max_expert_parallel)
    print(plan_output.format_plan(p, own.show))
    print(f"first: {plan_output.first_choice_reason(p)}")
    if own.output:
        p.save(own.output)
    best = p.candidates[0].layout if p.candidates else "none"
    print(f"plan: {len(p.candidates)} candidates, {len(p.rejected)} rejected, first {best}, "
          f"{time.time() - start:.1f}s" + (f"; wrote {own.output}" if own.output else ""))
    return 0 if p.candidates else 1


def calibrate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tune_parallelism.py calibrate", allow_abbrev=False,
                                     description="Measure this machine for `plan --profile` (about a minute with "
                                                 "the defaults): GEMM FLOP/s at a few token counts, the bandwidth of "
                                                 "a large copy, and latency + bandwidth of all-reduce, all-gather, "
                                                 "reduce-scatter, send/recv and all-to-all at group sizes 2, 4, ... "
                                                 "up to --world-size (gloo on CPU, NCCL on CUDA).")
    parser.add_argument("--output", required=True, help="the profile JSON to write")
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    add_number(parser, "--world-size", minimum=1, default=2,
               help="the largest collective group measured (2, 4, ...); 1 measures compute and memory only (one "
                    "GPU: NCCL takes one rank per GPU), and plans priced by it stay at one rank")
    add_number(parser, "--gemm-tokens", minimum=1, nargs="+", default=[128, 512, 2048],
               help="GEMM rows m (tokens of a micro-batch on a rank) measured")
    add_number(parser, "--gemm-hidden", minimum=1, default=1024, help="h of the [m, h] x [h, 4h] GEMM")
    add_number(parser, "--copy-megabytes", minimum=1, maximum=1 << 20, default=256,
               help="size of the copied buffer, MiB")
    add_number(parser, "--message-bytes", minimum=4, nargs="+", default=[2 ** 12, 2 ** 16, 2 ** 20, 2 ** 22, 2 ** 24],
               help="collective message sizes the latency + bandwidth fit uses")
    add_number(parser, "--iters", minimum=1, default=10, help="calls timed per collective and size")
    add_number(parser, "--min-seconds", kind=float, above=0, maximum=3600, default=1.0,
               help="time spent per GEMM size and on the copy")
    add_number(parser, "--threads", minimum=1, default=None, example=1,
               help="threads for the GEMMs and the copy (default 1 on CPU: what a gloo rank gets)")
    add_number(parser, "--micro-batches", minimum=1, nargs="+", default=[1, 2, 4],
               help="with model flags after --: the micro batches the model is timed at")
    add_number(parser, "--model-reps", minimum=1, default=3, help="with model flags: timed steps per run (their median)")
    add_number(parser, "--model-passes", minimum=1, default=1,
               help="with model flags: times every run is measured, in passes of alternating order, each keeping "
                    "its fastest (2 on a shared machine: its slow spells last tens of seconds)")
    add_parallel_bounds(parser, "timed (with model flags)", "measures no")
    return parser


def _calibrate(argv) -> int:
    parser = calibrate_parser()
    argv = list(argv)
    model_argv = []
    if "--" in argv:
        cut = argv.index("--")
        argv, model_argv = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    why = target_problem("--output", args.output, [args.output], args.overwrite)
    if why:
        parser.error(why)
    if len(set(args.message_bytes)) < 2:
        parser.error(f"--message-bytes needs two different sizes (the fit has two unknowns), got "
                     f"{' '.join(map(str, args.message_bytes))}; e.g. 4096 1048576")
    if model_argv and args.device != "cpu":
        parser.error("model times (flags after --) are measured on CPU ranks only; on a GPU the GEMM and "
                     "collective fits price the step")
    if model_argv:  # the model flags are checked before a minute of measurements, not after
        from megatron_lite.arguments import build_parser, given_fields
        from megatron_lite.config import Config
        from megatron_lite.tuning.candidates import validate_model_flags

        # measure_model.model_base's Config, built here without importing torch
        validate_model_flags(Config().replace(**given_fields(build_parser().parse_args(model_argv))))
    from megatron_lite.tuning.measure import measure  # imports torch, so after the flags are checked

    start = time.time()
    try:
        profile = measure(args.device, args.world_size, args.gemm_tokens, args.gemm_hidden, args.copy_megabytes,
                          args.message_bytes, args.iters, args.min_seconds, args.threads,
                          progress=lambda line: print(line, flush=True))
        if model_argv:
            from megatron_lite.tuning.measure_model import measure_model

            group = 1
            while group * 2 <= args.world_size:
                group *= 2
            for world in sorted({2 ** k for k in range(1, group.bit_length())} | {group}) if group > 1 else [1]:
                profile.models.append(measure_model(model_argv, world, args.micro_batches, args.model_reps,
                                                    progress=lambda line: print(line, flush=True),
                                                    passes=args.model_passes,
                                                    max_context_parallel=args.max_context_parallel,
                                                    max_expert_parallel=args.max_expert_parallel))
    except RuntimeError as e:
        print(f"tune_parallelism.py calibrate: error: {e}", file=sys.stderr)
        return 1
    profile.save(args.output)
    print(profile.summary())
    print(f"calibrate: {args.device} profile, collectives up to {args.world_size} ranks, {time.time() - start:.1f}s; "
          f"wrote {args.output}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"calibrate": _calibrate, "plan": _plan}
    try:
        from megatron_lite.tuning import report, sweep
        commands.update(sweep=sweep.main, report=report.main)
    except ImportError:
        pass
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print(f"\ncommands: {' | '.join(commands)}; `tune_parallelism.py COMMAND --help` lists a command's flags")
        return 0
    if not argv or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr)
        print(f"\ntune_parallelism.py: error: give a command: {' | '.join(commands)}", file=sys.stderr)
        return 2
    try:
        return commands[argv[0]](argv[1:])
    except ConfigError as e:
        print(f"tune_parallelism.py {argv[0]}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
