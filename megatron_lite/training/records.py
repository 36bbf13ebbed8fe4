"""metrics.jsonl: what a training run measured, as data for tools (the sweep reads it, not the console).

One JSON object per line, appended and flushed as it happens, written by rank 0 into
--tensorboard-dir (next to the TensorBoard events), else into --save's `metrics/` folder (a
folder, so that a --save holding no checkpoint yet still reads as empty to --load), else nowhere.
Every record has "kind" and "time" (Unix seconds):

  start         a run (re)starts: "iteration" it starts from, "train_iters", "layout" (the
                summary line), "config" (the whole validated config)
  interval      every log interval: "iteration", "iterations" and "seconds" of the interval, and
                the console line's numbers under their TensorBoard names (loss, lr, grad_norm,
                ms_per_iteration, samples_per_s, tokens_per_s, tflops_per_rank, mfu,
                mem_allocated_gib / mem_peak_gib on GPU or mem_rss_gib / mem_peak_rss_gib on CPU, ...)
  stage_memory  once, at the first log line: "stages", each {"stage", "estimated_bytes",
                "measured_peak_bytes"}, and "measured" (what the peak is: GPU allocator, or process RSS)
  validation    "iteration", "loss", "perplexity"
  stage_timing  with --timing-breakdown: "iteration" and the per-stage milliseconds
  compile       with --compile, once, at the first log line: "backend" and per stage "stage", "graphs",
                "graph_breaks", "compile_seconds" and "break_reasons" (reason -> count) (model/compile.py)
  straggler     with --log-straggler, every log interval: "iteration", "iterations", the "slowest" and
                "fastest" --straggler-minmax-count ranks by work, each {"rank", "host", "tp", "pp", "dp",
                "work_ms", "step_ms", "<phase>_ms"...} per iteration, and "widest_phase" with its
                "widest_phase_high" / "widest_phase_low" ranks (training/stragglers.py)
  summary       the run ends: "status" (completed, stopped: a signal or --exit-interval,
                nonfinite_loss), "iteration", "consumed_samples", "seconds", "first_loss",
                "last_loss", "validation_loss", "tokens_per_s"

Resumed runs append to the same file; `read_records` returns the records of the last run.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional

from megatron_lite.line_records import read_json_lines

FILE_NAME = "metrics.jsonl"
KINDS = ("start", "interval", "stage_memory", "validation", "stage_timing", "compile", "straggler", "skipped_iteration",
         "summary")


def records_directory(tensorboard_dir: Optional[str], save_dir: Optional[str]) -> Optional[str]:
    """Where a run writes metrics.jsonl: next to its TensorBoard events, else in a folder beside its
    checkpoints."""
    if tensorboard_dir:
        return tensorboard_dir
    return os.path.join(save_dir, "metrics") if save_dir else None


class RecordWriter:
    """Appends records to DIR/metrics.jsonl; a no-op without a directory (and on ranks other than 0)."""

    def __init__(self, directory: Optional[str]):
        self.path = os.path.join(directory, FILE_NAME) if directory else None
        self._file = None
        if self.path:
            os.makedirs(directory, exist_ok=True)
            self._file = open(self.path, "a")

    def write(self, kind: str, **fields: Any) -> None:
        if self._file is None:
            return
        assert kind in KINDS, kind
        self._file.write(json.dumps({"kind": kind, "time": time.time(), **fields}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_records(path: str) -> List[Dict[str, Any]]:
    """The records of the last run in a metrics.jsonl (from its last `start`); a line cut short by a
    killed run is skipped. Missing file: no records."""
    records: List[Dict[str, Any]] = []
    for record in read_json_lines(path):
        if record.get("kind") == "start":
            records = []
        records.append(record)
    return records


def stage_memory_gib(run_records: List[Dict[str, Any]]) -> Optional[Dict[int, Dict[str, float]]]:
    """{stage: {"estimated_gib", "measured_gib"}} from a run's stage_memory record, or None without one."""
    memory = next((r for r in run_records if r["kind"] == "stage_memory"), None)
    if memory is None:
        return None
    return {st["stage"]: {"estimated_gib": st["estimated_bytes"] / 2 ** 30,
                          "measured_gib": st["measured_peak_bytes"] / 2 ** 30} for st in memory["stages"]}
