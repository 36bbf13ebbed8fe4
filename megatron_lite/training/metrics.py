"""Throughput, FLOPs, memory and the per-interval log line (console + TensorBoard).

FLOPs follow Megatron-LM's accounting but for the router, norms and recompute (cost/arithmetic.py
`training_flops_per_token`; the comparison: docs/training.md, tests/cost/test_megatron_flops.py):
per token, each layer does 8h^2 + 4hf (QKV, projection, MLP) plus 2sh (attention scores and
weighted values over the causal half of the keys, as Megatron-LM counts them), the head 2hV;
training costs 3x the forward, plus what activation recompute runs again (the recomputed layers,
or every layer's attention scores under selective recompute, their attention halved alike;
arithmetic.py says exactly what).
"""
from __future__ import annotations

import math
import os
import resource
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from megatron_lite.config import ModelConfig
from megatron_lite.cost.arithmetic import training_flops_per_token

# Dense bf16/fp16 tensor-core peak per GPU (TFLOP/s), by a substring of the device name.
PEAK_TFLOPS_BF16 = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "A10G": 125.0, "L40S": 362.0, "V100": 125.0}


def device_peak_tflops() -> Optional[float]:
    """The GPU's bf16 peak if we know it; None on CPU or an unknown device (then no MFU)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS_BF16.items() if key in name), None)


def memory_stats() -> Dict[str, float]:
    """GPU allocated and peak (GiB), or the process's resident and peak RSS on CPU (GiB)."""
    gib = 1024 ** 3
    if torch.cuda.is_available():
        return {"mem_allocated_gib": torch.cuda.memory_allocated() / gib,
                "mem_peak_gib": torch.cuda.max_memory_allocated() / gib}
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    rss = resident_pages * os.sysconf("SC_PAGE_SIZE")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"mem_rss_gib": rss / gib, "mem_peak_rss_gib": peak / gib}


def peak_memory_bytes():
    """(peak bytes, what was measured): the GPU allocator's peak, or on CPU the process's peak RSS,
    which also holds the interpreter and libraries, not only tensors."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(), "torch.cuda.max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"


@dataclass
class IntervalStats:
    iteration: int
    consumed_samples: int
    loss: float
    lr: float
    grad_norm: Optional[float]
    loss_scale: Optional[float]
    skipped_steps: int
    """Steps of the interval the optimizer skipped (fp16 overflow)."""
    seconds: float
    """Wall time of the interval."""
    iterations: int
    """Steps in the interval."""
    samples: int
    """Samples trained in the interval (all DP ranks)."""
    global_batch_size: int
    """Global batch of the interval's last step (grows during ramp-up)."""


def interval_scalars(stats: IntervalStats, model: ModelConfig, world_size: int,
                     layers_per_stage: Optional[Sequence[int]] = None, attention_share: float = 1.0) -> Dict[str, float]:
    """layers_per_stage: transformer layers on each pipeline stage (for --recompute-method block);
    attention_share: the share of full attention this rank computed in the interval (documents attended
    one by one compute less: model/attention_mask.py AttentionWork)."""
    per_iter = stats.seconds / max(stats.iterations, 1)
    samples_per_s = stats.samples / stats.seconds
    tokens_per_s = samples_per_s * model.seq_length
    tflops_per_rank = (tokens_per_s * training_flops_per_token(model, layers_per_stage, attention_share)
                       / world_size / 1e12)
    scalars = {
        "loss": stats.loss, "lr": stats.lr, "ms_per_iteration": per_iter * 1e3, "samples_per_s": samples_per_s,
        "tokens_per_s": tokens_per_s, "tflops_per_rank": tflops_per_rank, "skipped_steps": stats.skipped_steps,
        "consumed_samples": stats.consumed_samples, "global_batch_size": stats.global_batch_size,
    }
    if stats.grad_norm is not None and math.isfinite(stats.grad_norm):
        scalars["grad_norm"] = stats.grad_norm
    if stats.loss_scale is not None:
        scalars["loss_scale"] = stats.loss_scale
    peak = device_peak_tflops()
    if peak:
        scalars["mfu"] = tflops_per_rank / peak
    scalars.update(memory_stats())
    return scalars


def format_line(iteration: int, train_iters: int, scalars: Dict[str, float]) -> str:
    parts = [f"iteration {iteration:>7}/{train_iters}", f"consumed samples {int(scalars['consumed_samples']):>9}",
             f"global batch {int(scalars['global_batch_size']):>5}", f"loss {scalars['loss']:.4f}",
             f"lr {scalars['lr']:.3e}"]
    if "grad_norm" in scalars:
        parts.append(f"grad norm {scalars['grad_norm']:.3f}")
    if "loss_scale" in scalars:
        parts.append(f"loss scale {scalars['loss_scale']:.0f}")
    parts += [f"{scalars['ms_per_iteration']:.1f} ms/it", f"{scalars['samples_per_s']:.1f} samples/s",
              f"{scalars['tokens_per_s']:.0f} tokens/s", f"{scalars['tflops_per_rank']:.3f} TFLOP/s/rank"]
    if "mfu" in scalars:
        parts.append(f"MFU {100 * scalars['mfu']:.1f}%")
    if "mem_peak_gib" in scalars:
        parts.append(f"mem {scalars['mem_allocated_gib']:.2f}/{scalars['mem_peak_gib']:.2f} GiB")
    else:
        parts.append(f"rss {scalars['mem_rss_gib']:.2f} GiB (peak {scalars['mem_peak_rss_gib']:.2f})")
    if scalars.get("skipped_steps"):
        parts.append(f"skipped {int(scalars['skipped_steps'])}")
    return " | ".join(parts)


def format_moe_line(scalars: Dict[str, float]) -> str:
    """The MoE layers' last step, one line: per layer its max/mean expert load, then the router losses and the
    dropped fraction averaged over the layers (the per-layer values: TensorBoard and metrics.jsonl)."""
    layers = sorted({name.split("/")[1].split("_")[0] for name in scalars if name.startswith("moe/")})
    if not layers:
        return "moe: no MoE layer"

    def mean(what):
        values = [scalars[f"moe/{layer}_{what}"] for layer in layers]
        return sum(values) / len(values)

    loads = " ".join(f"{layer.removeprefix('layer')}:{scalars[f'moe/{layer}_load_max_over_mean']:.2f}"
                     for layer in layers)
    return (f"moe | load max/mean per layer {loads} | aux loss {mean('aux_loss'):.4g} | z loss {mean('z_loss'):.4g}"
            f" | dropped {100 * mean('dropped_fraction'):.1f}%")


class TensorBoardWriter:
    """Every scalar under train/ or valid/, x-axis = iteration. A no-op without --tensorboard-dir."""

    def __init__(self, log_dir: Optional[str]):
        self.writer = None
        if log_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, prefix: str, scalars: Dict[str, float], iteration: int) -> None:
        if self.writer is None:
            return
        for name, value in scalars.items():
            self.writer.add_scalar(f"{prefix}/{name}", value, iteration)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def format_mtp_line(scalars: Dict[str, float]) -> str:
    """The Multi-Token Prediction depths' losses over the interval, one line (the logged loss is the language
    model's alone)."""
    depths = sorted((int(name[len("mtp/depth"):-len("_loss")]), value) for name, value in scalars.items()
                    if name.startswith("mtp/depth"))
    return "mtp | " + " | ".join(f"depth {k} loss {value:.4f}" for k, value in depths)
