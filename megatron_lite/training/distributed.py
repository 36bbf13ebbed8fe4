"""torch.distributed from whichever launcher started us: torchrun, the deepspeed launcher, or plain srun."""
from __future__ import annotations

import datetime
import os
import re
import socket
import subprocess
import traceback
from typing import Optional

from megatron_lite.config import ParallelConfig


def free_port() -> int:
    """A TCP port on this machine that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list: 'gpu[003-010,12],cpu1' -> 'gpu003' (what scontrol would say)."""
    first = nodelist
    depth = 0
    for i, ch in enumerate(nodelist):  # cut at the first comma outside brackets
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            first = nodelist[:i]
            break
    if "[" not in first:
        return first
    prefix, ranges = first.split("[", 1)
    return prefix + ranges.rstrip("]").split(",")[0].split("-")[0]


def _first_slurm_host() -> Optional[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return first_host(nodelist)


def environment_from_launcher() -> None:
    """Fill RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT where the launcher did not.

    torchrun and the deepspeed launcher set them all. Plain `srun python pretrain_gpt.py` sets
    only SLURM_* (DeepSpeed's PipelineModule reads LOCAL_RANK, so it must be mapped). A bare
    `python pretrain_gpt.py` is a world of one.
    """
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env.setdefault("MASTER_ADDR", _first_slurm_host() or "127.0.0.1")
        # One port per job, so two jobs sharing a node do not collide.
        env.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000))
    if "RANK" not in env:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(free_port()))
    env.setdefault("LOCAL_RANK", "0")


def is_rank_zero_from_environment() -> bool:
    """Rank 0 as the launcher says, before any process group exists (torchrun / deepspeed / srun)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0


def init_distributed(backend: Optional[str] = None, log_level: str = "warning",
                     timeout_minutes: float = ParallelConfig.distributed_timeout_minutes) -> None:
    """torch.distributed through DeepSpeed's comm layer; its start-up prints hidden below --log-level info.
    A collective of any group, DeepSpeed's included, fails after timeout_minutes (collective_timeout)."""
    import deepspeed  # here: the CLI imports this module to find rank 0 before torch is needed
    import torch

    from megatron_lite.deepspeed_compat import startup

    environment_from_launcher()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    timeout = datetime.timedelta(minutes=timeout_minutes)
    with startup.quiet_prints(log_level):
        deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timeout)
    startup.new_groups_time_out_after(timeout)


def collective_timeout(error: BaseException, timeout_minutes: float) -> Optional[str]:
    """The error line for a collective that timed out (gloo raises RuntimeError "Timed out waiting Nms for
    recv operation to complete"; NCCL's DistBackendError says "timeout"), naming the operation, where it
    was called, and this rank; None for any other error."""
    if not isinstance(error, RuntimeError) or not re.search(r"timed out|timeout", str(error), re.IGNORECASE):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    operations = [f.name for f in frames if f.filename.endswith(os.path.join("distributed", "distributed_c10d.py"))]
    callers = [f for f in frames if re.search(r"megatron_lite|deepspeed[/\\](?!comm)", f.filename)]
    what = operations[0] if operations else "a collective"
    if callers:
        caller = callers[-1]
        what += f" in {re.split(r'(?=megatron_lite|deepspeed)', caller.filename, 1)[-1]}:{caller.lineno} {caller.name}"
    reason = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0])  # gloo's "[file.cc:78] " prefix
    return (f"a collective did not complete within --distributed-timeout-minutes {timeout_minutes:g} ({what}, "
            f"rank {os.environ.get('RANK', '0')} of {os.environ.get('WORLD_SIZE', '1')}: {reason}): another rank "
            f"is stuck or died; a dead rank's own output says why, `py-spy dump --pid PID` shows where a live one "
            f"waits. If a step legitimately takes longer (a slow save), raise --distributed-timeout-minutes")


def gather_problems(problem, group=None):
    """Collective (over `group`, default the world): every rank's problem (any picklable value, or None
    for none), in rank order, with the Nones left out. Ranks that must stop together call this where the
    others would otherwise go on into a collective that a failed rank never reaches."""
    import torch.distributed as dist

    problems = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    return [p for p in problems if p is not None]


def agree_over_ranks(flags, device) -> list:
    """Element-wise max over all ranks of a few booleans."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]
