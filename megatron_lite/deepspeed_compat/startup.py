"""DeepSpeed at start-up: its print()ed lines, its logger's level, and the time-out of the process groups it
creates."""
from __future__ import annotations

import contextlib
import datetime
import io
from typing import Iterator, Tuple

import torch


# (function, text): start-up lines DeepSpeed writes with print(), not its logger, that quiet_prints hides.
STARTUP_PRINTS: Tuple[Tuple[str, str], ...] = (
    ("deepspeed.comm.torch.build_shm_op", "built successfully"),
    ("deepspeed.runtime.pipe.module.PipelineModule.__init__", "SEED_LAYERS="),
    ("deepspeed.runtime.pipe.topology.PipelineParallelGrid.__init__", "Using topology:"),
)
VERBOSE_LEVELS = ("debug", "info")


@contextlib.contextmanager
def quiet_prints(log_level: str) -> Iterator[None]:
    """Hide what DeepSpeed print()s inside the block (STARTUP_PRINTS: the shared-memory op's
    "built successfully" on every rank, SEED_LAYERS and the topology dict on rank 0) unless
    `log_level` is info or debug.

    Why: these are print() calls, so DeepSpeed's log level does not reach them. Only this
    process's sys.stdout is swapped, for the block: DeepSpeed's logger keeps the stream it was
    created with, so its warnings and errors still show; exceptions pass through."""
    if log_level in VERBOSE_LEVELS:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def set_log_level(log_level: str) -> None:
    """DeepSpeed's logger (and its handler, which has a level of its own) at `log_level`."""
    from deepspeed.utils.logging import logger, set_log_level_from_string

    set_log_level_from_string(log_level, custom_logger=logger)


def new_groups_time_out_after(timeout: datetime.timedelta) -> None:
    """Every process group DeepSpeed creates from here on (the pipeline grid's, ZeRO's) gives up on a
    collective after `timeout`, as the world group does.

    Why: DeepSpeed's comm backend calls torch.distributed.new_group(ranks) with no timeout, and torch 2.13
    then gives the group its backend's default (30 minutes for gloo; `_new_group_with_tag`), not the world
    group's: a pipeline send to a dead rank would wait 30 minutes whatever --distributed-timeout-minutes
    says. DeepSpeed's own groups are made through its backend object (`deepspeed.comm.new_group` ->
    `cdb.new_group`); this sets that object's new_group."""
    from deepspeed.comm import comm

    def new_group(ranks):
        return torch.distributed.new_group(ranks, timeout=timeout)

    comm.cdb.new_group = new_group
