"""Measure the model itself for the throughput model: real engines, this model's shape, every layout kind.

On a GPU the kernels of a layer are big enough that GEMM FLOP/s and collective fits price a step. On a
CPU, and for any small model, most of a step is neither: per-operator overhead, the LayerNorms, softmax
and dropout, the optimizer, the engine's own work per micro-batch and per step. So `calibrate -- <model
flags>` also times the model's real training step (megatron_lite.training.engine.Engine: DeepSpeed's
pipeline engine, ZeRO 0, PP 1) on `world` spawned ranks, all stepping at once as in a real run (on a
machine with fewer cores than ranks they share them, as the real run's ranks will), at each layout kind
the plan can choose and each micro batch b: TP degree t, context-parallel size c and, for an MoE model,
expert-parallel size e (DP = world / (t c); EP splits DP x CP), every combination validation allows. A
point at CP c times its all-to-alls and its attention on the rank's 1/c of the sequence as they run; one at
EP e its expert all-to-alls and its experts' GEMMs at their rows. Every pipeline instruction is timed
(deepspeed_compat.pipeline.time_pipeline_instructions), so one run splits its step into

    per micro-batch: forward + backward (LoadMicroBatch, ForwardPass, BackwardPass)
    per step:        the gradient all-reduce over DP (ReduceGrads, ReduceTiedGrads), the optimizer
                     (OptimizerStep), and the engine's own time between instructions (the rest)

Runs at 1 and 3 layers (gas 4) split forward + backward into `layer` and `ends` (embedding, final norm,
head, loss) and the optimizer into per-layer and fixed parts; a run at 3 layers and gas 1 splits the
engine's rest into per-step and per-micro-batch parts, and more at 3 layers and gas 4 price the
variants per layer and micro-batch: sequence parallelism (t > 1), selective and full recompute, and each
recompute with sequence parallelism (t > 1) (each against the plain 3-layer gas-4 run). Each run: 2 steps
of warm-up, then `reps` steps; each quantity is the slowest rank's (a barrier before each step), its median over the steps. Then `smooth` fits each per-micro-batch part
linearly in the micro batch and averages each per-step part over the micro batches of a layout.

Pricing CP from the generic terms (the profile's GEMM and all-to-all fits) instead ran 2.6-2.9x fast on this
VM (issue 48); benchmarks/cp_step_breakdown.py times a CP step's parts against those terms.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_lite.model.moe_options import layer_freq_for
from megatron_lite.tuning.calibration import ModelTimes, describe, point_layout
from megatron_lite.tuning.measure import spawn_ranks

RUNS = (("l1g4", 1, 4, {}), ("l3g4", 3, 4, {}), ("l3g1", 3, 1, {}),
        ("sp", 3, 4, {"parallel__sequence_parallel": True}),
        ("selective", 3, 4, {"model__recompute_granularity": "selective"}),
        ("full", 3, 4, {"model__recompute_granularity": "full", "model__recompute_method": "uniform",
                        "model__recompute_num_layers": 1}),
        ("sp_selective", 3, 4, {"parallel__sequence_parallel": True, "model__recompute_granularity": "selective"}),
        ("sp_full", 3, 4, {"parallel__sequence_parallel": True, "model__recompute_granularity": "full",
                           "model__recompute_method": "uniform", "model__recompute_num_layers": 1}))
"""(name, layers, gas, config fields): the runs of one (TP, micro batch) point; the sp* runs at TP > 1 only.
The variants run at gas 4 against the plain gas-4 run: at gas 1 their extra (a difference of two runs' 5-step
medians) scattered by up to 2x between micro batches (selective recompute at TP 1: +0 ms and +71 ms a step).
Sequence parallelism and recompute are measured together too: their costs do not add (at TP 2, micro batch
1, SP + full recompute measured 36 ms a layer where SP's and full recompute's extras added up to 50)."""
PARTS = ("step", "micro", "reduce", "optimizer", "rest")
"""What one timed step is split into: its seconds, forward + backward per micro-batch, the gradient
reduction, the optimizer step, the rest (the engine between instructions)."""
PER_MICRO = ("LoadMicroBatch", "ForwardPass", "BackwardPass")
REDUCE = ("ReduceGrads", "ReduceTiedGrads")
WARMUP = 2


def model_base(model_argv: Sequence[str]):
    """The Config the flags describe (unvalidated; the layout fields are set per run)."""
    from megatron_lite.arguments import build_parser, given_fields
    from megatron_lite.config import Config

    return Config().replace(**given_fields(build_parser().parse_args(list(model_argv))))


def shape_key(config) -> Dict[str, Any]:
    """What a profile's model times depend on besides the layout: the model's fields but its layer count and
    recompute settings, and the training dtype. A plan uses the times only for a model with the same key."""
    model = asdict(config.model)
    for name in ("num_layers", "recompute_activations", "recompute_granularity", "recompute_method",
                 "recompute_num_layers", "padded_vocab_size"):
        model.pop(name, None)
    model["dtype"] = config.precision.dtype_name
    return model


def run_config(base, world: int, tp: int, micro: int, layers: int, gas: int, fields: Dict[str, Any], cp: int = 1,
               ep: int = 1):
    """The validated config of one calibration run at TP tp, CP cp, EP ep, PP 1, DP world / (tp cp)."""
    from megatron_lite.validation import validate

    dp = world // (tp * cp)
    config = base.replace(
        model__num_layers=layers, model__moe_layer_freq=layer_freq_for(base.model, layers),
        parallel__tensor_model_parallel_size=tp, parallel__pipeline_model_parallel_size=1,
        parallel__context_parallel_size=cp, parallel__expert_model_parallel_size=ep, parallel__zero_stage=0,
        parallel__cpu_offload=False,
        parallel__sequence_parallel=False, batch__micro_batch_size=micro, batch__global_batch_size=micro * gas * dp,
        batch__gradient_accumulation_steps=None, model__recompute_activations=False,
        model__recompute_granularity=None, model__recompute_method=None, model__recompute_num_layers=None)
    return validate(config.replace(**fields), world)[0]


def solve(runs: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    """The point's parts from its runs' PARTS (module docstring): layer_s, ends_s per micro-batch; optimizer_s +
    optimizer_per_layer_s, engine_s + engine_per_micro_s, reduce_s + reduce_per_layer_s per step (the reduction
    over the calibration's DP); and each variant's extra seconds per layer and micro-batch."""
    one, three, single = runs["l1g4"], runs["l3g4"], runs["l3g1"]
    layer = (three["micro"] - one["micro"]) / 2
    out = {"layer_s": layer, "ends_s": one["micro"] - layer}
    for part in ("optimizer", "reduce"):
        per_layer = (three[part] - one[part]) / 2
        out[f"{part}_per_layer_s"] = per_layer
        out[f"{part}_s"] = one[part] - per_layer
    per_micro = (three["rest"] - single["rest"]) / 3
    out["engine_per_micro_s"] = per_micro
    out["engine_s"] = single["rest"] - per_micro
    for name in VARIANTS:
        if name in runs:
            out[f"{name}_extra_s"] = (runs[name]["micro"] - three["micro"]) / 3
    return out


VARIANTS = ("sp", "selective", "full", "sp_selective", "sp_full")
PER_MICRO_PARTS = ("layer_s", "ends_s", "engine_per_micro_s") + tuple(f"{v}_extra_s" for v in VARIANTS)
PER_STEP_PARTS = ("optimizer_s", "optimizer_per_layer_s", "reduce_s", "reduce_per_layer_s", "engine_s")


def smooth(points: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The points of one layout (TP, CP, EP) made consistent with each other, which halves the scatter a 2-core machine
    leaves in single runs: a per-micro-batch part is a + b x micro (least squares over the micro batches: a
    micro-batch's work grows with its tokens, plus a fixed cost per call), a per-step part (optimizer,
    reduction, engine) does not depend on the micro batch (their mean). Each point keeps its own solve() as
    `measured`."""
    out = []
    for layout in sorted({point_layout(p) for p in points}):
        group = [p for p in points if point_layout(p) == layout]
        micros = [p["micro"] for p in group]
        for p in group:
            q = {k: v for k, v in p.items() if k not in PER_MICRO_PARTS + PER_STEP_PARTS}
            q["measured"] = {k: p[k] for k in PER_MICRO_PARTS + PER_STEP_PARTS if k in p}
            for key in PER_STEP_PARTS:
                q[key] = statistics.fmean(g[key] for g in group)
            for key in PER_MICRO_PARTS:
                if key not in p:
                    continue
                if len(set(micros)) < 2:
                    q[key] = p[key]
                    continue
                mx, my = statistics.fmean(micros), statistics.fmean(g[key] for g in group)
                slope = (sum((m - mx) * (g[key] - my) for m, g in zip(micros, group))
                         / sum((m - mx) ** 2 for m in micros))
                q[key] = my + slope * (p["micro"] - mx)
            out.append(q)
    return out


def random_batches(config, seed: int = 0, cp_rank: int = 0):
    """Endless random micro-batches ((tokens, positions), (labels, loss mask)) of the config's shape; under
    context parallelism the CP rank's part of each, as the training data loader hands it over."""
    from megatron_lite.data.context_parallel import context_parallel_part, mtp_context_parallel_part
    from megatron_lite.data.mtp import mtp_arrays

    g = torch.Generator().manual_seed(seed)
    micro, seq, cp = config.batch.micro_batch_size, config.model.seq_length, config.parallel.context_parallel_size
    depths = config.model.mtp_num_layers or 0
    positions = torch.arange(seq).expand(micro, seq).contiguous()
    while True:
        sample = torch.randint(0, config.model.vocab_size, (micro, seq + 1), generator=g)
        arrays = (sample[:, :-1].contiguous(), positions, sample[:, 1:].contiguous(), torch.ones(micro, seq))
        mtp = mtp_arrays(arrays[0], arrays[2], arrays[3], None, depths) if depths else ()  # the depths' inputs too
        if cp > 1:
            arrays = tuple(a.contiguous() for a in context_parallel_part(arrays, cp_rank, cp))
            mtp = tuple(a.contiguous() for a in mtp_context_parallel_part(mtp, cp_rank, cp)) if mtp else ()
        tokens, position_ids, labels, mask = arrays
        yield (tokens, position_ids, *mtp[:1]), (labels, mask, *mtp[1:])


def _timed_parts(engine, data, reps: int) -> Dict[str, float]:
    """Each of PARTS as its median over `reps` steps, each step's the slowest rank's (the odd slow step of a
    shared machine moves a median of a few steps less than their mean)."""
    import torch.distributed as dist

    from megatron_lite.deepspeed_compat import pipeline

    seconds: Dict[str, float] = {}
    pipeline.time_pipeline_instructions(
        engine.engine, lambda name, s: seconds.__setitem__(name, seconds.get(name, 0.0) + s), lambda: None)
    for _ in range(WARMUP):
        engine.train_step(data)
    gas = engine.config.batch.gradient_accumulation_steps
    steps = []
    for _ in range(reps):
        dist.barrier()
        seconds.clear()
        start = time.perf_counter()
        engine.train_step(data)
        step = time.perf_counter() - start
        parts = [step, sum(seconds.get(n, 0.0) for n in PER_MICRO) / gas, sum(seconds.get(n, 0.0) for n in REDUCE),
                 seconds.get("OptimizerStep", 0.0)]
        parts.append(step - sum(seconds.values()))
        slowest = torch.tensor(parts, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        steps.append(slowest.tolist())
    return {part: statistics.median(step[i] for step in steps) for i, part in enumerate(PARTS)}


def _worker(rank: int, port: int, world: int, model_argv: List[str], layout: Tuple[int, int, int], micro: int,
            reps: int, results) -> None:
    """One (TP, CP, EP, micro batch) point's runs on this rank. Fresh processes per point: every engine leaves gloo
    groups behind whose threads keep waking up, and a process that had built a dozen engines measured later
    points up to 1.5x slow (the TP 2 layer at micro batch 2: 35.6 ms there, the real run's 18)."""
    import gc
    import logging

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    # The engines print their partition tables and DeepSpeed its banners: calibrate prints its own lines.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine

    base = model_base(model_argv)
    tp, cp, ep = layout
    try:
        state.initialize(tp, 1, context_parallel_size=cp, expert_model_parallel_size=ep)
        runs = {}
        for name, layers, gas, fields in RUNS:
            if name.startswith("sp") and tp == 1:
                continue
            config = run_config(base, world, tp, micro, layers, gas, fields, cp, ep)
            engine = Engine(config, with_scheduler=False)
            # Samples differ over DP, a sample's CP ranks read the same one (its parts).
            data = random_batches(config, state.get_data_parallel_rank(), state.get_context_parallel_rank())
            runs[name] = _timed_parts(engine, data, reps)
            del engine
            gc.collect()
        state.destroy()
        results.put((rank, {"tp": tp, "cp": cp, "ep": ep, "micro": micro, "runs": runs, **solve(runs)}, None))
    except Exception as e:  # reported by the parent, which would otherwise wait for the queue
        import traceback

        results.put((rank, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def _powers_of_two(limit: int) -> List[int]:
    return [2 ** k for k in range(limit.bit_length()) if limit % 2 ** k == 0]


def layouts(base, world: int, max_context_parallel: Optional[int] = None,
            max_expert_parallel: Optional[int] = None) -> List[Tuple[int, int, int]]:
    """(TP, CP, EP) at PP 1 the plan may choose on `world` ranks, as its candidates: TP, CP and EP powers of 2,
    TP x CP dividing world, EP dividing DP x CP = world / TP (1 for a dense model), CP at most
    `max_context_parallel` and EP at most `max_expert_parallel` (None: no bound); validation decides what the
    model's heads, groups, sequence, FFN and experts allow."""
    from megatron_lite.config import ConfigError

    experts = base.model.num_experts
    out = []
    for tp in _powers_of_two(world):
        for cp in _powers_of_two(world // tp):
            if max_context_parallel is not None and cp > max_context_parallel:
                continue
            for ep in _powers_of_two(world // tp) if experts else [1]:
                if ep > 1 and (experts % ep or (max_expert_parallel is not None and ep > max_expert_parallel)):
                    continue
                try:
                    run_config(base, world, tp, 1, 1, 1, {}, cp, ep)
                except ConfigError:
                    continue
                out.append((tp, cp, ep))
    return out


def fastest_runs(passes: Sequence[Dict[str, Dict[str, float]]]) -> Dict[str, Dict[str, float]]:
    """One point's runs over several passes: each run's each part its smallest over the passes. A shared
    machine's slow spells (another process, the hypervisor) only ever lengthen a measurement, and a 2-core VM
    has them for tens of seconds at a time: two calibrations of the bench's model an hour apart timed the same
    runs 0.65x to 1.40x of each other (world 2, TP 2), so the fastest of passes spread over time is the
    machine's speed."""
    return {name: {part: min(p[name][part] for p in passes) for part in passes[0][name]}
            for name in passes[0] if all(name in p for p in passes)}


def merge_model_times(a: ModelTimes, b: ModelTimes) -> ModelTimes:
    """Two calibrations of one model and world as one, every run its fastest of both (fastest_runs): passes
    taken apart in time, e.g. between a sweep's repeats, so that both see the machine's same spells."""
    if (a.world, a.shape) != (b.world, b.shape):
        raise ValueError(f"model times of world {a.world} and {b.world} or of different shapes do not merge")
    measured = []
    for p in a.points:
        tp, cp, ep = point_layout(p)
        q = b.point(tp, p["micro"], cp, ep)
        if q is None:
            raise ValueError(f"model times to merge: TP {tp}, CP {cp}, EP {ep}, micro batch {p['micro']} missing "
                             f"from one")
        best = fastest_runs([p["runs"], q["runs"]])
        measured.append({"tp": tp, "cp": cp, "ep": ep, "micro": p["micro"], "runs": best,
                         "passes": p.get("passes", 1) + q.get("passes", 1), **solve(best)})
    return ModelTimes(world=a.world, model_argv=a.model_argv, shape=a.shape, points=smooth(measured))


def measure_model(model_argv: Sequence[str], world: int, micro_batches: Sequence[int], reps: int = 3,
                  timeout: float = 1800.0, progress=lambda line: None, passes: int = 1,
                  max_context_parallel: Optional[int] = None, max_expert_parallel: Optional[int] = None) -> ModelTimes:
    """The model's times on `world` spawned gloo ranks (CPU) at every layout (TP, CP, EP) it allows (`layouts`)
    and each micro batch; with passes > 1 every point is measured that many times, each pass in the opposite
    order of the one before (a slow spell falls on different points), and each run keeps its fastest
    (fastest_runs)."""
    if passes < 1:
        raise ValueError(f"passes must be at least 1, got {passes}")
    base = model_base(model_argv)
    order = [(layout, micro) for layout in layouts(base, world, max_context_parallel, max_expert_parallel)
             for micro in micro_batches]
    runs: Dict[Any, List[Dict[str, Dict[str, float]]]] = {key: [] for key in order}
    for n in range(passes):
        for layout, micro in (order if n % 2 == 0 else order[::-1]):
            point = spawn_ranks(_worker, world, (list(model_argv), layout, micro, reps), timeout,
                                f"model calibration at world size {world}, TP {layout[0]}, CP {layout[1]}, "
                                f"EP {layout[2]}, micro batch {micro}")[0]
            runs[(layout, micro)].append(point["runs"])
    measured = []
    for (tp, cp, ep), micro in order:
        best = fastest_runs(runs[((tp, cp, ep), micro)])
        measured.append({"tp": tp, "cp": cp, "ep": ep, "micro": micro, "runs": best, "passes": passes, **solve(best)})
    points_out = smooth(measured)
    for p in points_out:
        progress(describe(world, p))
    return ModelTimes(world=world, model_argv=list(model_argv), shape=shape_key(run_config(base, world, 1, 1, 1, 1, {})),
                      points=points_out)
