"""A measured hardware profile: the JSON `tune_parallelism.py calibrate` writes and `plan --profile` reads.

The throughput model (tuning/throughput.py) prices compute and communication with it instead of
fixed constants:

  GEMM:        achieved FLOP/s at a few token counts m of an [m, k] x [k, n] matmul (fp32 on CPU, bf16
               on CUDA); between measured m it is interpolated linearly in log(m), outside clamped
  memory:      GB/s of a large copy (bytes read + bytes written), for offloaded optimizer work
  collectives: per collective and group size, time = latency + bytes / bandwidth, fitted by least squares
               over a few message sizes. `bytes` is the size of the tensor the collective is about: the
               tensor all-reduced, the gathered output of an all-gather, the input of a reduce-scatter,
               one rank's tensor of an all-to-all, the tensor sent by send/recv (so the bandwidth is what
               the caller sees, ring factors included)

model times (optional, `calibrate -- <model flags>`, tuning/measure_model.py): for one model shape and world
               size, per layout (TP degree, context-parallel size, expert-parallel size) and micro batch, the
               seconds of a layer and of the embedding + head + loss per micro-batch, the per-step seconds
               (fixed and per layer), and what sequence parallelism, selective and full recompute add per layer
               and micro-batch, from real engines

A group size that was not measured is priced from the nearest measured one by the ring algorithm's
scaling: latency x (g-1)/(g0-1), bytes x ((g-1)/g)/((g0-1)/g0). Loading checks every field and names the
file and the field on bad input; the file is plain JSON, nothing in it is executed.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from megatron_lite.atomic import write_text
from megatron_lite.config import ConfigError
from megatron_lite.reading import UnreadableFile, read_json

FORMAT_VERSION = 1
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all")
"""The collectives the layouts use: TP's all-reduce (or sequence parallelism's all-gather and reduce-scatter),
PP's send/recv, DP's all-reduce, CP's all-to-all and EP's (the MoE dispatch and combine)."""


@dataclass(frozen=True)
class GemmPoint:
    tokens: int
    """m of the [m, k] x [k, n] matmul: the tokens of a micro-batch a rank holds."""
    k: int
    n: int
    flops_per_s: float
    """Achieved 2 m k n / seconds."""


@dataclass(frozen=True)
class LinkFit:
    latency_s: float
    """Seconds a message costs whatever its size (the fit's intercept, at least 0)."""
    bandwidth_gbps: float
    """Bytes per second / 1e9 (the inverse of the fit's slope)."""
    sizes_bytes: List[int] = field(default_factory=list)
    """The message sizes measured."""
    seconds: List[float] = field(default_factory=list)
    """The measured seconds per message at each size."""

    def seconds_for(self, nbytes: float, messages: float = 1.0) -> float:
        return messages * self.latency_s + nbytes / (self.bandwidth_gbps * 1e9)


MODEL_POINT_FIELDS = ("layer_s", "ends_s", "engine_per_micro_s", "optimizer_s", "optimizer_per_layer_s", "reduce_s",
                      "reduce_per_layer_s", "engine_s")
VARIANT_FIELDS = ("sp_extra_s", "selective_extra_s", "full_extra_s", "sp_selective_extra_s", "sp_full_extra_s")


@dataclass
class ModelTimes:
    world: int
    """Ranks that stepped at once while measured (the world size the times hold for)."""
    model_argv: List[str]
    """The model flags calibrate was given."""
    shape: Dict[str, Any]
    """measure_model.shape_key of the model: a plan uses these times only for a model with the same key."""
    points: List[Dict[str, Any]]
    """Per (tp, cp, ep, micro) (cp and ep 1 where a profile predates them): layer_s, ends_s, engine_per_micro_s
    per micro-batch; optimizer_s (+ optimizer_per_layer_s x layers), reduce_s (+ reduce_per_layer_s x layers: the
    gradient reduction over world / tp ranks), engine_s per step; the variants' sp_extra_s, sp_selective_extra_s,
    sp_full_extra_s (TP > 1), selective_extra_s, full_extra_s per layer and micro-batch; runs, each run's
    measured parts (tuning/measure_model.py)."""

    def point(self, tp: int, micro: int, cp: int = 1, ep: int = 1) -> Optional[Dict[str, Any]]:
        return next((p for p in self.points if (*point_layout(p), p["micro"]) == (tp, cp, ep, micro)), None)


def point_layout(point: Dict[str, Any]) -> Tuple[int, int, int]:
    """(TP, CP, EP) of a model-times point; CP and EP 1 where it has TP only (a profile written before they were
    calibrated)."""
    return point["tp"], point.get("cp", 1), point.get("ep", 1)


def describe(world: int, p: Dict[str, Any]) -> str:
    """One line of a model-times point, in ms."""
    _, cp, ep = point_layout(p)
    layout = "".join(f" {name} {size}" for name, size in (("cp", cp), ("ep", ep)) if size > 1)
    return (f"model x{world} tp {p['tp']}{layout} micro {p['micro']}: per micro-batch layer {p['layer_s'] * 1e3:.2f} ms, ends "
            f"{p['ends_s'] * 1e3:.2f} ms, engine {p['engine_per_micro_s'] * 1e3:.2f} ms; per step optimizer "
            f"{p['optimizer_s'] * 1e3:.2f} + {p['optimizer_per_layer_s'] * 1e3:.2f} ms/layer, reduction "
            f"{p['reduce_s'] * 1e3:.2f} + {p['reduce_per_layer_s'] * 1e3:.2f} ms/layer, engine {p['engine_s'] * 1e3:.2f} ms")


@dataclass
class Profile:
    device: str
    """cpu or cuda: planning for another device type is refused."""
    device_name: str
    """The CPU model or GPU name."""
    backend: str
    """The torch.distributed backend the collectives ran over (gloo, nccl)."""
    torch_version: str
    date: str
    """When it was measured (UTC, ISO 8601)."""
    dtype: str
    """The GEMMs' dtype (float32 on CPU, bfloat16 on CUDA)."""
    threads: int
    """CPU threads per process the GEMMs ran with (what each training rank gets)."""
    gemm: List[GemmPoint]
    memory_gbps: float
    collectives: Dict[str, Dict[int, LinkFit]]
    """collective name -> group size -> fit."""
    version: int = FORMAT_VERSION
    models: List[ModelTimes] = field(default_factory=list)
    """Model times (optional), one entry per (model shape, world size) calibrated."""

    def model_times(self, shape: Dict[str, Any], world: int) -> Optional[ModelTimes]:
        """The times measured for this model shape at this world size, if calibrate measured them."""
        return next((m for m in self.models if m.world == world and m.shape == shape), None)

    def gemm_flops_per_s(self, tokens: float) -> float:
        """Achieved FLOP/s at `tokens` rows: log-linear between measured sizes, clamped outside them."""
        points = sorted(self.gemm, key=lambda p: p.tokens)
        if tokens <= points[0].tokens:
            return points[0].flops_per_s
        for lo, hi in zip(points, points[1:]):
            if tokens <= hi.tokens:
                w = math.log(tokens / lo.tokens) / math.log(hi.tokens / lo.tokens)
                return lo.flops_per_s + w * (hi.flops_per_s - lo.flops_per_s)
        return points[-1].flops_per_s

    def collective_seconds(self, name: str, group: int, nbytes: float, messages: float = 1.0) -> float:
        """Seconds for `messages` calls of collective `name` over `group` ranks moving `nbytes` in all."""
        if group <= 1:
            return 0.0
        fits = self.collectives[name]
        if not fits:
            raise ConfigError(f"this profile ({self.device_name}) has no {name} measurements (calibrated with "
                              f"--world-size 1), so it cannot price a group of {group}; calibrate with --world-size "
                              f"{group} on a machine with {group} devices, or plan without --profile",
                              code="bad_profile")
        measured = min(fits, key=lambda g: (abs(math.log(g / group)), g))
        fit = fits[measured]
        if measured == group or name == "send_recv":
            return fit.seconds_for(nbytes, messages)
        steps = (group - 1) / (measured - 1)
        share = ((group - 1) / group) / ((measured - 1) / measured)
        return messages * fit.latency_s * steps + nbytes * share / (fit.bandwidth_gbps * 1e9)

    def summary(self) -> str:
        gemm = ", ".join(f"m={p.tokens}: {p.flops_per_s / 1e9:.1f}" for p in sorted(self.gemm, key=lambda p: p.tokens))
        lines = [f"{self.device} ({self.device_name}), {self.backend}, torch {self.torch_version}, {self.dtype}, "
                 f"{self.threads} thread(s), {self.date}",
                 f"GEMM GFLOP/s (k={self.gemm[0].k}, n={self.gemm[0].n}): {gemm}",
                 f"memory copy: {self.memory_gbps:.1f} GB/s"]
        for name, fits in self.collectives.items():
            for group, fit in sorted(fits.items()):
                lines.append(f"{name} x{group}: latency {fit.latency_s * 1e6:.0f} us, "
                             f"bandwidth {fit.bandwidth_gbps:.2f} GB/s")
        lines += [describe(m.world, p) for m in self.models for p in m.points]
        return "\n".join(lines)

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["collectives"] = {name: {str(g): asdict(f) for g, f in fits.items()}
                            for name, fits in self.collectives.items()}
        return d

    def save(self, path: str) -> None:
        write_text(path, json.dumps(self.to_dict(), indent=1))


def _field(path: str, d: Any, key: str, kind, where: str = "", positive: bool = False):
    name = f"{where}{key}"
    if not isinstance(d, dict) or key not in d:
        raise ConfigError(f"--profile {path}: field '{name}' is missing; run `tune_parallelism.py calibrate` again",
                          code="bad_profile")
    value = d[key]
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if ok and positive:
        ok = math.isfinite(value) and value > 0
    if not ok:
        want = "a positive number" if positive else kind.__name__ if isinstance(kind, type) else "a number"
        raise ConfigError(f"--profile {path}: field '{name}' is {value!r}, expected {want}", code="bad_profile")
    return value


def load(path: str) -> Profile:
    """The profile in `path`; ConfigError naming the file and the field when it is missing or malformed."""
    try:
        d = read_json(path)
    except UnreadableFile as e:
        raise ConfigError(f"--profile {e}; write one with `tune_parallelism.py calibrate --output {path}`",
                          code="bad_profile") from None
    if not isinstance(d, dict):
        raise ConfigError(f"--profile {path}: expected a JSON object, got {type(d).__name__}", code="bad_profile")
    version = _field(path, d, "version", int)
    if version != FORMAT_VERSION:
        raise ConfigError(f"--profile {path}: field 'version' is {version}, this code reads {FORMAT_VERSION}; "
                          f"run `tune_parallelism.py calibrate` again", code="bad_profile")
    device = _field(path, d, "device", str)
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--profile {path}: field 'device' is {device!r}, expected 'cpu' or 'cuda'", code="bad_profile")
    number = (int, float)
    gemm_rows = _field(path, d, "gemm", list)
    if not gemm_rows:
        raise ConfigError(f"--profile {path}: field 'gemm' is empty, expected measured sizes", code="bad_profile")
    gemm = [GemmPoint(*(_field(path, row, key, int, f"gemm[{i}].", True) for key in ("tokens", "k", "n")),
                      float(_field(path, row, "flops_per_s", number, f"gemm[{i}].", True)))
            for i, row in enumerate(gemm_rows)]
    collectives: Dict[str, Dict[int, LinkFit]] = {}
    table = _field(path, d, "collectives", dict)
    for name in COLLECTIVES:
        # Empty: a compute-only profile (`calibrate --world-size 1`, one GPU); pricing a group then says so.
        fits = _field(path, table, name, dict, "collectives.")
        collectives[name] = {}
        for group, fit in fits.items():
            where = f"collectives.{name}.{group}."
            if not (group.isdigit() and int(group) >= 2):
                raise ConfigError(f"--profile {path}: field 'collectives.{name}' has group size {group!r}, expected "
                                  f"an integer >= 2", code="bad_profile")
            latency = _field(path, fit, "latency_s", number, where)
            if not (math.isfinite(latency) and latency >= 0):
                raise ConfigError(f"--profile {path}: field '{where}latency_s' is {latency!r}, expected >= 0",
                                  code="bad_profile")
            collectives[name][int(group)] = LinkFit(float(latency),
                                                    float(_field(path, fit, "bandwidth_gbps", number, where, True)),
                                                    list(fit.get("sizes_bytes", [])), list(fit.get("seconds", [])))
    if not isinstance(d.get("models", []), list):
        raise ConfigError(f"--profile {path}: field 'models' is {d['models']!r}, expected a list of model times",
                          code="bad_profile")
    models = [_model_times(path, m, i) for i, m in enumerate(d.get("models", []))]
    return Profile(device=device, device_name=_field(path, d, "device_name", str),
                   backend=_field(path, d, "backend", str), torch_version=_field(path, d, "torch_version", str),
                   date=_field(path, d, "date", str), dtype=_field(path, d, "dtype", str),
                   threads=_field(path, d, "threads", int, positive=True), gemm=gemm,
                   memory_gbps=float(_field(path, d, "memory_gbps", number, positive=True)), collectives=collectives,
                   version=version, models=models)


def _model_times(path: str, d: Any, i: int) -> ModelTimes:
    where = f"models[{i}]."
    world = _field(path, d, "world", int, where, True)
    argv = _field(path, d, "model_argv", list, where)
    shape = _field(path, d, "shape", dict, where)
    points = []
    for j, p in enumerate(_field(path, d, "points", list, where)):
        at = f"{where}points[{j}]."
        point = {"tp": _field(path, p, "tp", int, at, True), "micro": _field(path, p, "micro", int, at, True)}
        for name in ("cp", "ep"):  # absent from profiles written before CP and EP were calibrated: 1
            point[name] = _field(path, p, name, int, at, True) if name in p else 1
        for key in MODEL_POINT_FIELDS + VARIANT_FIELDS:
            if key in MODEL_POINT_FIELDS or key in p:
                # A least-squares part may come out a little below 0 on a noisy machine: finite is what is checked.
                value = _field(path, p, key, (int, float), at)
                if not math.isfinite(value):
                    raise ConfigError(f"--profile {path}: field '{at}{key}' is {value!r}, expected a finite number",
                                      code="bad_profile")
                point[key] = float(value)
        point["runs"] = dict(p.get("runs", {}))
        point["measured"] = dict(p.get("measured", {}))
        points.append(point)
    return ModelTimes(world=world, model_argv=[str(a) for a in argv], shape=shape, points=points)


def check_device(profile: Profile, path: str, device: str) -> None:
    """Refuse a profile measured on another device type than the one planned for."""
    if profile.device != device:
        raise ConfigError(f"--profile {path} was measured on {profile.device} ({profile.device_name}), but the plan is "
                          f"for --device {device}; calibrate on {device} (`tune_parallelism.py calibrate --device "
                          f"{device}`) or plan with --device {profile.device}", code="bad_profile")
