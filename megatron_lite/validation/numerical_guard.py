"""The numerical guard's flags: what each check needs of the layout, and --inject-fault's ranks and iterations.

  --check-for-large-grads, --skip-update-sigma at --zero-stage 2/3   refused: ZeRO 2/3 reduce and partition the
        gradients inside backward, so no rank holds its own whole gradient before the reduction, and the engine
        steps inside its last micro-batch (training/engine.py), where no update can be left out
  --inject-fault nan_grad at --zero-stage 2/3                         refused: the same (no local gradient to corrupt)
  --rerun-mode report_stats at --zero-stage 2/3                       refused: the same (no step can be run twice);
        validate_results, the default, has no replay there (a NaN/Inf exits 18)
  --inject-fault RANK >= the world size, ITERATION > --train-iters    refused: the fault would never happen
  MEGATRON_LITE_INJECT_FAULT                                          read here, as --inject-fault, when the flag is
                                                                      not given
  --result-rejected-tracker-filename                                  read here, as Megatron-LM reads it at start-up:
        an iteration the file shows reproduced twice on the same rank (a fault that followed the data, or a
        replica, onto other hardware) joins --iterations-to-skip, with a note
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Tuple

from megatron_lite.config import Config, ConfigError
from megatron_lite.config.numerical_guard import INJECT_FAULT_ENV, parse_faults


REPRODUCED = ("FIRST_RERUN_REPRODUCIBLE", "SECOND_RERUN_REPRODUCIBLE", "RERUN_DISABLED")
"""Tracker statuses that count towards a skip, as Megatron-LM's get_skipped_iterations_from_tracker_file counts
them (RERUN_DISABLED: a rejection no replay judged)."""
MEGATRON_LINE = re.compile(r"ts=.+ node=(\S+) device=.+ jobID=.+ rank=(\d+) iteration=(\d+) status=(?:\w+\.)?(\w+) ")


def iterations_reproduced_twice(path: str) -> Dict[int, Tuple[int, List[str]]]:
    """{iteration: (rank, the nodes of its records)} for each iteration the tracker file (training/rerun.py's
    JSON lines, or Megatron-LM's key=value lines) shows reproduced at least twice on the same rank. A missing
    file (a first start) has none; a line that is neither (cut short by a crash) is passed over."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return {}
    seen: Dict[Tuple[int, int], List[str]] = {}
    for line in lines:
        try:
            record = json.loads(line)
            place = (int(record["rank"]), int(record["iteration"]), str(record["status"]), str(record["node"]))
        except (ValueError, KeyError, TypeError):
            match = MEGATRON_LINE.match(line)
            if not match:
                continue
            place = (int(match[2]), int(match[3]), match[4], match[1])
        rank, iteration, status, node = place
        if status in REPRODUCED:
            seen.setdefault((rank, iteration), []).append(node)
    twice: Dict[int, Tuple[int, List[str]]] = {}
    for (rank, iteration), nodes in sorted(seen.items()):
        if len(nodes) >= 2:
            twice.setdefault(iteration, (rank, nodes))
    return twice


def numerical_guard_rules(config: Config, notes: List[str]) -> Config:
    g = config.numerical_guard
    if g.result_rejected_tracker_filename:
        config = _skip_from_tracker(config, g.result_rejected_tracker_filename, notes)
    source = "--inject-fault"
    if not g.inject_fault and os.environ.get(INJECT_FAULT_ENV):
        source = INJECT_FAULT_ENV
        config = config.replace(numerical_guard__inject_fault=parse_faults(os.environ[INJECT_FAULT_ENV], source))
        g = config.numerical_guard
    world, iterations = config.parallel.world_size, config.training.train_iters
    for kind, rank, iteration, _ in g.inject_fault:
        if rank >= world:
            raise ConfigError(f"{source} {kind}:{rank}:{iteration}: rank {rank} does not exist in a world of {world} "
                              f"ranks; use a rank from 0 to {world - 1}", code="inject_fault_rank")
        if iteration > iterations:
            raise ConfigError(f"{source} {kind}:{rank}:{iteration}: iteration {iteration} is after --train-iters "
                              f"{iterations}; use 1 to {iterations}", code="inject_fault_iteration")
    if config.parallel.zero_stage >= 2:
        wanted = [flag for flag, on in (("--check-for-large-grads", g.check_for_large_grads),
                                        ("--skip-update-sigma", g.skip_update_sigma is not None),
                                        ("--check-for-spiky-loss", g.check_for_spiky_loss),
                                        ("--rerun-mode report_stats", g.rerun_mode == "report_stats"),
                                        (f"{source} nan_grad", any(k == "nan_grad" for k, *_ in g.inject_fault)))
                  if on]
        if wanted:
            raise ConfigError(f"{wanted[0]} at --zero-stage {config.parallel.zero_stage}: ZeRO 2/3 reduce and "
                              f"partition the gradients inside backward and step inside the last micro-batch, so no "
                              f"rank has its own gradient to check and no update can be left out; use --zero-stage "
                              f"0 or 1", code="numerical_guard_zero")
    return config


def _skip_from_tracker(config: Config, path: str, notes: List[str]) -> Config:
    try:
        twice = iterations_reproduced_twice(path)
    except OSError as e:
        raise ConfigError(f"--result-rejected-tracker-filename {path}: cannot be read ({e.strerror}); give a file "
                          f"this user can read, or a new path", code="tracker_unreadable")
    given = config.training.iterations_to_skip
    new = [iteration for iteration in twice if iteration not in given]
    for iteration in new:
        rank, nodes = twice[iteration]
        notes.append(f"--result-rejected-tracker-filename {path}: iteration {iteration} reproduced twice on rank "
                     f"{rank} (hosts {', '.join(nodes)}): its data is skipped (added to --iterations-to-skip)")
    if not new:
        return config
    return config.replace(training__iterations_to_skip=tuple(sorted({*given, *new})))
