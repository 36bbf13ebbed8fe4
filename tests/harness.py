"""Run test code on N gloo processes, or launch scripts through torch.distributed.run.

`run_distributed(fn, world_size, *args)` runs a module-level function on every
rank and returns the per-rank results in rank order. Worker pools are kept per
world size and reused across the tests of a module, replaced when their workers
have gathered too many threads, and thrown away after any failure or timeout so
that a hang fails one test instead of stalling CI. Their workers are forked from
a fork server that has imported torch, DeepSpeed and the training loop once per
pytest process (spawned, each worker imported them itself: 2-5 s of CPU apiece).
tests/entry_points.py runs a script's main on them as torchrun runs the script.
"""
from __future__ import annotations

import gc
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


def _join_world(rank: int, world_size: int, port: int, generation: int) -> None:
    """The world group of this pool's `generation`. The pool's parent holds the store, so the group can be
    made again after a task destroyed it (pretrain_gpt.py's main does, as it exits)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    # gloo on every device: on one GPU the ranks share it, which NCCL refuses (tests/device.py).
    dist.init_process_group("gloo", store=dist.PrefixStore(f"world{generation}", store), rank=rank,
                            world_size=world_size)


def _worker(rank: int, world_size: int, port: int, tasks, results, environ: Dict[str, str]) -> None:
    from tests.device import enter_test_device, local_rank_for

    os.environ.clear()  # the test process's environment now, not the fork server's when it started
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank_for(rank)),
                      LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # The heap inherited from the fork server (torch's, DeepSpeed's modules) out of every collection: a task's
    # collections (ours after it, DeepSpeed's forced ones while it builds an engine) walked and touched all of
    # it, copying its pages from the server. Frozen before the world group exists: a frozen object is never
    # collected, and a destroyed group must be, to close its connections. gc.get_objects skips frozen objects:
    # the census unfreezes to count (tests/cost/engine_census.py).
    gc.freeze()
    generation = 0
    _join_world(rank, world_size, port, generation)
    enter_test_device()
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs, world_generation = task
        if world_generation != generation:  # every rank's world was destroyed by the last task
            generation = world_generation
            _join_world(rank, world_size, port, generation)
        try:
            outcome = (True, fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - any failure is reported to the parent
            outcome = (False, traceback.format_exc())
        finally:
            from megatron_lite.parallel import state

            state.destroy()
            if dist.is_initialized():
                _release_process_groups()
        results.put((rank, *outcome, len(os.listdir(f"/proc/{os.getpid()}/task")), dist.is_initialized()))
    if dist.is_initialized():
        dist.destroy_process_group()
    import multiprocessing

    for child in multiprocessing.active_children():  # a task's leftovers: multiprocessing would wait for them
        child.kill()


# What the fork server imports once, so that a worker forked from it starts in milliseconds: spawning one
# that imports torch and DeepSpeed itself took 2-3 s of CPU, on a machine with 2 cores, for each worker of
# each pool of each test module.
# The first engine a process builds imports torch._dynamo (torch.optim's constructors) and inductor (DeepSpeed's
# ZeRO checks import its Muon optimizer, whose module compiles): 3.1 s of the first engine's 3.4 s, measured
# with cProfile in a forked worker.
FORK_SERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "deepspeed",
                       "deepspeed.runtime.zero.muon.muon_optimizer", "megatron_lite.training.loop",
                       "tests.device", "tests.harness", "tests.entry_points"]


def _start_context():
    """forkserver on the CPU: the server only imports FORK_SERVER_PRELOAD, and a worker forked from it starts
    with one thread (the forking one; counted in /proc). spawn when the tests run on a GPU: the server's
    imports would ask the CUDA driver about devices, and a process forked after that cannot use CUDA."""
    from tests.device import test_device

    if (test_device() or "").startswith("cuda"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)
    return ctx


class _Pool:
    def __init__(self, world_size: int):
        ctx = _start_context()
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.threads = 0  # the most threads any worker has had after a task
        import torch.distributed as dist

        # The rendezvous store lives here, not on rank 0: a task may destroy the world group and the workers
        # make it again (port 0: the kernel picks one, bound at once, so no other test can take it meanwhile).
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.generation = 0
        self.healthy = True
        environ = dict(os.environ)
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, self.store.port, self.tasks[r], self.results,
                                                        environ), daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()
        from tests import process_log

        process_log.record("pool", world_size, argv=[ctx.get_start_method()])

    def collect(self, fn: Callable, args, kwargs, timeout: float, failed: Callable[[Any], bool] = lambda v: False,
                grace: float = 5.0):
        """(results by rank, tracebacks by rank, ranks that never answered). Once a rank fails (raises, or
        returns a value `failed` says is a failure), the others get `grace` seconds: they may be stuck in a
        collective with it."""
        for q in self.tasks:
            q.put((fn, args, kwargs, self.generation))
        deadline = time.monotonic() + timeout
        got: Dict[int, Any] = {}
        errors: Dict[int, str] = {}
        kept_world = []
        failure = False
        while len(got) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            if failure:
                remaining = min(remaining, grace)
            if remaining <= 0:
                break
            try:
                # a second at a time, so that a worker that died is seen at once, not at the deadline
                rank, ok, value, threads, world_alive = self.results.get(timeout=min(remaining, 1.0))
                self.threads = max(self.threads, threads)
                kept_world.append(world_alive)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in got and r not in errors]
                if dead:
                    errors.update({r: f"rank {r} process died (exit code {self.procs[r].exitcode})" for r in dead})
                    failure = True
                continue
            (got if ok else errors)[rank] = value
            failure = failure or not ok or failed(value)
        missing = [r for r in range(self.world_size) if r not in got and r not in errors]
        if missing or errors or (any(kept_world) and not all(kept_world)):
            self.healthy = False  # ranks stuck, or some ranks' world gone and others' not: not reusable
        elif not any(kept_world):
            self.generation += 1  # every rank destroyed its world group: the next task makes a new one
        return got, errors, missing

    def run(self, fn: Callable, args, kwargs, timeout: float) -> List[Any]:
        got, errors, missing = self.collect(fn, args, kwargs, timeout)
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
    pool = warm_pool(world_size)
    try:
        results = pool.run(fn, args, kwargs, timeout)
    except BaseException:
        _POOLS.pop(world_size, None)
        pool.close(graceful=False)
        raise
    retire_if_spent(pool)
    return results


def warm_pool(world_size: int) -> "_Pool":
    """This module's pool of `world_size` workers, started if there is none (or it lost a worker)."""
    pool = _POOLS.get(world_size)
    if pool is None or not pool.healthy or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close(graceful=False)
        pool = _POOLS[world_size] = _Pool(world_size)
    return pool


def retire_if_spent(pool: "_Pool") -> None:
    """Close a pool that cannot be reused, or whose workers have gathered too many threads."""
    if not pool.healthy or pool.threads > MAX_WORKER_THREADS:
        _POOLS.pop(pool.world_size, None)
        pool.close(graceful=pool.healthy)


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


def write_null_corpus(prefix: str, documents: int, vocab_size: int) -> str:
    """A NullTokenizer dataset at `prefix`: `documents` documents of 20-79 random ids below vocab_size - 1, each
    ended by the id vocab_size - 1 (the end of document); seeded, so every call writes the same."""
    import numpy as np

    from megatron_lite.data.indexed_dataset import IndexedDatasetWriter

    rng = np.random.RandomState(0)
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for _ in range(documents):
            writer.add_document(np.append(rng.randint(0, vocab_size - 1, size=rng.randint(20, 80)), vocab_size - 1))
    return prefix
