"""The process exit codes a run ends with, for schedulers and the sbatch scripts: one flat list of named constants.

Megatron-LM's where the meaning is the same (16 and 17, its rerun state machine's). docs/training.md lists them
with what a scheduler should do with each.
"""

EXIT_OK = 0
"""The run completed, or stopped on --exit-interval or an exit signal after saving."""
EXIT_FAILED = 1
"""An error the run could not go on from (a failed save, a timed-out collective, an exception)."""
EXIT_BAD_INPUT = 2
"""Bad flags, inputs or checkpoint, refused before training: fix the command line; do not requeue."""
EXIT_RESUME_TO_DISAMBIGUATE = 16
"""Megatron-LM's EXIT_CODE_RESUME_TO_DISAMBIGUATE: --rerun-mode validate_results replayed a NaN/Inf step in place and
it reproduced; the step's start was saved (its metadata names the host): resume on other hardware."""
EXIT_FAILED_ON_RESULT_VALIDATION = 17
"""Megatron-LM's EXIT_CODE_FAILED_ON_RESULT_VALIDATION: the replay of a NaN/Inf step did not reproduce it (a
transient fault); nothing was saved, the last checkpoint is kept: requeue from it."""
EXIT_NUMERICAL_FAULT = 18
"""--check-for-nan-in-loss-and-grad found NaN/Inf in a rank's loss or gradients with no replay (--rerun-mode
disabled, ZeRO 2/3): that step was applied on no rank, nothing was saved, the last checkpoint is kept; requeue from
it (excluding the named rank's node if it repeats)."""
EXIT_HANG = 42
"""The progress watchdog (training/watchdog.py) found a rank with no progress within its phase's timeout: it put
every local rank's stack in the log, named the rank, node, phase and iteration in one line and ended the node's
ranks. Requeue from the last checkpoint, excluding that node. (A real-time signal's number: the rank is ended by
that signal, whose handler is _exit, so the code survives a rank whose Python is stuck.)"""
EXIT_NO_PROGRESS = 93
"""The sbatch scripts' own code (NVRx's do-not-requeue code): the job was requeued after faults K times in a row
without its checkpoint advancing (MAX_REQUEUES_WITHOUT_PROGRESS); it is not requeued again. Look at the fault log."""
