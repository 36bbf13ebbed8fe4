"""The fault log: one JSON line per fault a run ended on, for the scheduler's side (examples/slurm/lib.sh).

Why a file: a job step's exit status cannot carry it. Under torchrun a rank ended by the watchdog (exit 42) makes
the agent exit 1, and srun reports one code for all its tasks; neither names the node to leave out. So whoever ends
a run on a fault (the watchdog's monitor, the numerical guard, the rerun state machine) appends a record to the file
MEGATRON_LITE_FAULT_LOG names, when it names one (the sbatch scripts set it per job attempt, on the shared
filesystem), and the batch script reads the last record with `python -m megatron_lite.fault_log`.

A record: {"time", "exit_code" (megatron_lite/exit_codes.py), "kind" (hang, numerical, rerun_reproducible,
rerun_transient), "host" (the node the fault was seen on), "rank", "iteration", "detail"}. Appended with one
write of one line, which O_APPEND keeps whole between the nodes' writers on a local or NFS filesystem of this size.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from megatron_lite.drills import host_name
from megatron_lite.line_records import read_json_lines

FAULT_LOG_ENV = "MEGATRON_LITE_FAULT_LOG"


def record(exit_code: int, kind: str, host: Optional[str] = None, rank: Optional[int] = None,
           iteration: Optional[int] = None, detail: str = "") -> None:
    """Append one record to the fault log, when MEGATRON_LITE_FAULT_LOG names one; a log that cannot be written
    is said on stderr and does not stop the way out (the exit code still says what happened)."""
    path = os.environ.get(FAULT_LOG_ENV)
    if not path:
        return
    line = json.dumps({"time": time.time(), "exit_code": exit_code, "kind": kind, "host": host or host_name(),
                       "rank": rank, "iteration": iteration, "detail": detail}) + "\n"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as e:
        print(f"megatron_lite: could not append to the fault log {path} ({FAULT_LOG_ENV}): {e}", file=sys.stderr)


def read(path: str) -> List[Dict[str, Any]]:
    """Every whole record of a fault log (none when it does not exist); a line cut short is skipped."""
    return [item for item in read_json_lines(path) if isinstance(item.get("exit_code"), int)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_lite.fault_log",
                                     description="What a job attempt's fault log says, for a batch script: the "
                                                 "exit code of its first fault, or the hosts it names.")
    parser.add_argument("what", choices=("code", "hosts"),
                        help="code: the first record's exit code (nothing when none); hosts: the hosts of the "
                             "records with that code, comma-separated")
    parser.add_argument("path")
    a = parser.parse_args(argv)
    records = read(a.path)
    if not records:
        return 0
    first = records[0]["exit_code"]  # the fault that ended the attempt; later ones are its consequences
    if a.what == "code":
        print(first)
    else:
        hosts = dict.fromkeys(str(r["host"]) for r in records if r["exit_code"] == first and r.get("host"))
        print(",".join(hosts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
