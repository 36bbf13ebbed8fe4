"""Run test code on N gloo processes, or launch scripts through torch.distributed.run.

`run_distributed(fn, world_size, *args)` runs a module-level function on every
rank and returns the per-rank results in rank order. Worker pools are kept per
world size and reused across the tests of a module (starting 8 Python processes
that import torch and DeepSpeed costs more than most tests), replaced when their
workers have gathered too many threads, and thrown away after any failure or
timeout so that a hang fails one test instead of stalling CI.
"""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch.multiprocessing as mp

import random
import socket


def free_port() -> int:
    """A free TCP port for a test's rendezvous, below the kernel's ephemeral range and in a band of its own
    per pytest-xdist worker: a port the kernel hands out for port 0 was taken, between the probe and the
    rendezvous, by another worker's connection once (EADDRINUSE), as ephemeral ports are."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = 20000 + 2000 * (index % 6)
    for _ in range(200):
        port = random.randrange(low, low + 2000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}..{low + 2000}")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TIMEOUT = float(os.environ.get("MEGATRON_LITE_TEST_TIMEOUT", "240"))


class DistributedTestError(AssertionError):
    pass


# A worker whose process has gathered more threads than this is replaced after its task. Every
# DeepSpeed engine leaves process groups behind (gloo threads that keep waking up): dozens of
# engines in one long-lived worker made the whole suite run several times slower.
MAX_WORKER_THREADS = 100


def _release_process_groups() -> None:
    """Destroy every group but the default one (the next task builds its own)."""
    import gc

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    for group in list(distributed_c10d._world.pg_map):
        if group is not distributed_c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)
    gc.collect()


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    from tests.device import enter_test_device, local_rank_for

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank_for(rank)),
                      LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # gloo on every device: on one GPU the ranks share it, which NCCL refuses (tests/device.py).
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    enter_test_device()
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            outcome = (True, fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - any failure is reported to the parent
            outcome = (False, traceback.format_exc())
        finally:
            from megatron_lite.parallel import state

            state.destroy()
            _release_process_groups()
        results.put((rank, *outcome, len(os.listdir(f"/proc/{os.getpid()}/task"))))
    dist.destroy_process_group()


class _Pool:
    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.threads = 0  # the most threads any worker has had after a task
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results), daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, args, kwargs, timeout: float) -> List[Any]:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        deadline = time.monotonic() + timeout
        got: Dict[int, Any] = {}
        errors: Dict[int, str] = {}
        while len(got) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            if errors:
                # other ranks may be stuck in a collective with the failed one: give them a moment
                remaining = min(remaining, 5.0)
            if remaining <= 0:
                break
            try:
                rank, ok, value, threads = self.results.get(timeout=remaining)
                self.threads = max(self.threads, threads)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead and not errors:
                    errors.update({r: f"rank {r} process died (exit code {self.procs[r].exitcode})" for r in dead})
                break
            (got if ok else errors)[rank] = value
        missing = [r for r in range(self.world_size) if r not in got and r not in errors]
        if errors or missing:
            parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
            if missing:
                parts.append(f"ranks {missing} did not finish within {timeout:.0f}s (hang or deadlock)")
            raise DistributedTestError(f"{getattr(fn, '__name__', fn)} failed on {self.world_size} processes:\n"
                                       + "\n".join(parts))
        return [got[r] for r in range(self.world_size)]

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_POOLS: Dict[int, _Pool] = {}


def run_distributed(fn: Callable, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> List[Any]:
    """Run fn(*args, **kwargs) on every rank of a gloo group; results in rank order.

    fn must be importable by the workers (a module-level function). Raises
    DistributedTestError with every failing rank's traceback, or on timeout.
    """
    pool = _POOLS.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close(graceful=False)
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        results = pool.run(fn, args, kwargs, timeout)
    except BaseException:
        _POOLS.pop(world_size, None)
        pool.close(graceful=False)
        raise
    if pool.threads > MAX_WORKER_THREADS:
        _POOLS.pop(world_size, None)
        pool.close()
    return results


def shutdown_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def read_until(stream, pattern: str) -> List[str]:
    """The lines of a process's output up to the first that matches `pattern` (all of them if none does)."""
    lines = []
    for line in stream:
        lines.append(line)
        if re.search(pattern, line):
            break
    return lines


def signal_process_tree(pid: int, sig: int) -> None:
    """Signal a launcher and every process under it, workers first. torchrun starts its workers
    in sessions of their own, so a process-group signal would miss them."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in reversed(procs):
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def start_launcher(
    script_args: Sequence[str],
    nproc: int,
    env: Optional[Dict[str, str]] = None,
    cwd: Optional[str] = None,
    launcher: str = "torchrun",
    stderr=subprocess.PIPE,
) -> subprocess.Popen:
    """Start `script_args` (script path first) on nproc local processes; output captured as text.

    launcher: "torchrun" (python -m torch.distributed.run) or "deepspeed" (the deepspeed launcher).
    The launcher gets a session of its own, so `signal_process_tree` can stop everything it started.
    """
    port = str(free_port())
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", port, *script_args]
    elif launcher == "deepspeed":
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", port, *script_args]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    full_env = dict(os.environ)
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    full_env["PYTHONPATH"] = REPO_ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return subprocess.Popen(cmd, cwd=cwd or REPO_ROOT, env=full_env, stdout=subprocess.PIPE, stderr=stderr,
                            text=True, start_new_session=True)


def run_launcher(
    script_args: Sequence[str],
    nproc: int,
    timeout: float = DEFAULT_TIMEOUT,
    env: Optional[Dict[str, str]] = None,
    cwd: Optional[str] = None,
    launcher: str = "torchrun",
) -> subprocess.CompletedProcess:
    """`start_launcher` and wait: the completed process, or DistributedTestError after `timeout`."""
    proc = start_launcher(script_args, nproc, env=env, cwd=cwd, launcher=launcher)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        signal_process_tree(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise DistributedTestError(
            f"{' '.join(proc.args)} did not finish within {timeout:.0f}s\nstdout:\n{out}\nstderr:\n{err}"
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
