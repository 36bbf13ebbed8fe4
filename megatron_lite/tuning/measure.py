"""Measure this machine for the throughput model: GEMM FLOP/s, copy bandwidth, collective latency and bandwidth.

`measure(...)` returns a calibration.Profile. GEMMs and the copy run in this process; each collective
group size runs on that many spawned processes (gloo on loopback for CPU, NCCL for CUDA), every rank
timing 3 rounds of `iters` calls per message size after a barrier; the best round's mean per call,
the slowest rank's, is kept. The fit
time = latency + bytes / bandwidth is least squares over the sizes, clipped to latency >= 0.
"""
from __future__ import annotations

import datetime
import os
import platform
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_lite.tuning.calibration import COLLECTIVES, GemmPoint, LinkFit, Profile


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _seconds_per_call(fn: Callable[[], None], device: str, min_seconds: float) -> float:
    """The best of 3 rounds, each calling fn until min_seconds / 3 have passed (the machine may be shared)."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(3):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds / 3:
                break
        best = min(best, elapsed / calls)
    return best


def measure_gemm(device: str, dtype: torch.dtype, tokens: Sequence[int], hidden: int,
                 min_seconds: float) -> List[GemmPoint]:
    """[m, h] x [h, 4h], the MLP's first matmul, at each m in tokens."""
    points = []
    for m in tokens:
        a = torch.randn(m, hidden, device=device, dtype=dtype)
        b = torch.randn(hidden, 4 * hidden, device=device, dtype=dtype)
        seconds = _seconds_per_call(lambda: torch.matmul(a, b), device, min_seconds)
        points.append(GemmPoint(m, hidden, 4 * hidden, 2.0 * m * hidden * 4 * hidden / seconds))
    return points


def measure_copy_gbps(device: str, megabytes: int, min_seconds: float) -> float:
    """Bytes read plus bytes written per second of a large copy, / 1e9."""
    src = torch.ones(megabytes * 2 ** 20 // 4, device=device)
    dst = torch.empty_like(src)
    seconds = _seconds_per_call(lambda: dst.copy_(src), device, min_seconds)
    return 2 * src.numel() * 4 / seconds / 1e9


def fit_latency_bandwidth(sizes: Sequence[int], seconds: Sequence[float]) -> Tuple[float, float]:
    """(latency s, bandwidth GB/s) of time = latency + bytes / bandwidth, least squares of the relative error
    (weights 1 / time^2: the small messages, microseconds, fix the latency, the large ones the bandwidth),
    latency >= 0."""
    w = [1.0 / y ** 2 for y in seconds]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, sizes)) / sw
    my = sum(wi * y for wi, y in zip(w, seconds)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, sizes))
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, seconds)) / sxx if sxx else 0.0
    if slope <= 0:  # flat: the largest message's rate is the best bound there is
        slope = max(seconds) / max(sizes)
    latency = my - slope * mx
    if latency < 0:  # through the origin instead
        latency = 0.0
        slope = sum(wi * x * y for wi, x, y in zip(w, sizes, seconds)) / sum(wi * x * x for wi, x in zip(w, sizes))
    return latency, 1.0 / slope / 1e9


def _collective(name: str, nbytes: int, rank: int, world: int, device: str) -> Callable[[], None]:
    """One call of the collective on `nbytes` (the convention in calibration.py), as a closure."""
    import torch.distributed as dist

    elements = max(nbytes // 4 // world * world, world)  # divisible into world parts
    if name == "all_reduce":
        x = torch.ones(elements, device=device)
        return lambda: dist.all_reduce(x)
    if name == "all_gather":
        part, out = torch.ones(elements // world, device=device), torch.empty(elements, device=device)
        return lambda: (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, part)
    if name == "reduce_scatter":
        full, out = torch.ones(elements, device=device), torch.empty(elements // world, device=device)
        return lambda: (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, full)
    if name == "all_to_all":
        x, out = torch.ones(elements, device=device), torch.empty(elements, device=device)
        return lambda: dist.all_to_all_single(out, x)
    # send_recv: pairs (0, 1), (2, 3), ... ping-pong; one call is one message each way, timed as two.
    x = torch.ones(elements, device=device)
    peer = rank ^ 1

    def ping_pong():
        if rank % 2 == 0:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)
    return ping_pong


def _collective_worker(rank: int, port: int, world: int, device: str, sizes: Sequence[int], iters: int,
                       results) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    times: Dict[str, List[float]] = {}
    try:
        for name in COLLECTIVES:
            times[name] = []
            for nbytes in sizes:
                call = _collective(name, nbytes, rank, world, device)
                call()
                _sync(device)
                seconds = float("inf")
                for _ in range(3):  # the best of 3 rounds: the machine may be shared
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(iters):
                        call()
                    _sync(device)
                    seconds = min(seconds, (time.perf_counter() - start) / iters)
                if name == "send_recv":
                    seconds /= 2
                slowest = torch.tensor([seconds], device=device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                times[name].append(slowest.item())
        results.put((rank, times, None))
    except Exception as e:  # reported by the parent, which would otherwise wait for the queue
        results.put((rank, None, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def spawn_ranks(target: Callable, world: int, args: tuple, timeout: float, what: str) -> List[Any]:
    """Run target(rank, port, world, *args, results) on `world` spawned processes (one gloo/NCCL world on a free
    port); each puts (rank, value, error or None) on results. The values in rank order; RuntimeError naming
    `what` and every failing rank's error."""
    from megatron_lite.training.distributed import free_port

    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, world, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        out = sorted((results.get(timeout=timeout) for _ in procs), key=lambda r: r[0])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [f"rank {rank}: {error}" for rank, _, error in out if error]
    if errors:
        raise RuntimeError(f"{what} failed: " + "; ".join(errors))
    return [value for _, value, _ in out]


def measure_collectives(device: str, group: int, sizes: Sequence[int], iters: int,
                        timeout: float = 600.0) -> Dict[str, LinkFit]:
    """Each collective's fit at one group size, from `group` spawned processes."""
    times = spawn_ranks(_collective_worker, group, (device, list(sizes), iters), timeout,
                        f"collectives at group size {group}")[0]
    fits = {}
    for name in COLLECTIVES:
        latency, gbps = fit_latency_bandwidth(sizes, times[name])
        fits[name] = LinkFit(latency, gbps, list(sizes), times[name])
    return fits


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def measure(device: str = "cpu", world_size: int = 2, gemm_tokens: Sequence[int] = (128, 512, 2048),
            gemm_hidden: int = 1024, copy_megabytes: int = 256, message_bytes: Sequence[int] = (
                2 ** 12, 2 ** 16, 2 ** 20, 2 ** 22), iters: int = 10, min_seconds: float = 0.3,
            threads: Optional[int] = None, progress: Callable[[str], None] = lambda line: None) -> Profile:
    """The profile of this machine. world_size: collectives at group sizes 2, 4, ... up to it (1: none,
    the compute-only profile of a one-GPU machine);
    threads: per process for the GEMMs and the copy (default 1 on CPU: a gloo rank's one thread)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device here")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        # NCCL refuses two ranks on one GPU.
        raise RuntimeError(f"--world-size {world_size} needs {world_size} GPUs (one NCCL rank each), torch sees "
                           f"{torch.cuda.device_count()}; use --world-size {max(torch.cuda.device_count(), 2)} "
                           f"on a machine with that many")
    threads = threads or (1 if device == "cpu" else torch.get_num_threads())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    try:
        gemm = measure_gemm(device, dtype, gemm_tokens, gemm_hidden, min_seconds)
        progress("GEMM GFLOP/s: " + ", ".join(f"m={p.tokens} {p.flops_per_s / 1e9:.1f}" for p in gemm))
        memory_gbps = measure_copy_gbps(device, copy_megabytes, min_seconds)
        progress(f"copy: {memory_gbps:.1f} GB/s")
    finally:
        torch.set_num_threads(before)
    collectives: Dict[str, Dict[int, LinkFit]] = {name: {} for name in COLLECTIVES}
    group = 2
    while group <= world_size:
        for name, fit in measure_collectives(device, group, message_bytes, iters).items():
            collectives[name][group] = fit
        progress(f"collectives x{group}: " + ", ".join(
            f"{name} {collectives[name][group].latency_s * 1e6:.0f} us + {collectives[name][group].bandwidth_gbps:.2f}"
            f" GB/s" for name in COLLECTIVES))
        group *= 2
    return Profile(device=device, device_name=_device_name(device), backend="nccl" if device == "cuda" else "gloo",
                   torch_version=torch.__version__,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   dtype=str(dtype).replace("torch.", ""), threads=threads, gemm=gemm, memory_gbps=memory_gbps,
                   collectives=collectives)
