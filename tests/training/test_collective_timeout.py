"""--distributed-timeout-minutes: a rank held back makes the others' collective fail in time, with one clear line.

The ranks start as srun starts them (no launcher that would tear the job down on the first exit), so the test
sees what each rank does on its own.
"""
import re
import signal
import time

import psutil
import pytest

from tests.data.test_data_worker_signals import still_running
from tests.harness import read_until
from tests.training.test_exit_signal_to_job_step import _end_ranks, _start_ranks
from tests.training.test_pretrain_e2e import MODEL, data_args, layout

pytestmark = pytest.mark.slow

TIMEOUT_MINUTES = 0.25  # long enough for the ranks' start-up to stay in step on a loaded 2-core machine
SLACK_SECONDS = 45  # the exception's way out: data workers stopped, TensorBoard and gloo closed


@pytest.mark.parametrize("pp, dp", [(2, 1), (1, 2)], ids=["pipeline_send_recv", "data_parallel_all_reduce"])
def test_a_rank_held_back_ends_the_others_within_the_timeout_with_one_line_naming_it(corpus, tmp_path, pp, dp):  # noqa: F811
    argv = [*MODEL, *data_args(corpus), *layout(1, pp), "--train-iters", "1000", "--num-workers", "1",
            "--distributed-timeout-minutes", str(TIMEOUT_MINUTES),
            # The node's watchdog would rightly watch the stopped rank until its own timeout, holding rank 0's
            # output open; this test is the collective timeout's (the watchdog's: test_watchdog.py).
            "--no-watchdog"]
    procs = _start_ranks(argv, 2, tmp_path)
    family = []
    try:
        lines = read_until(procs[0].stdout, r"iteration\s+1/1000")
        family = [psutil.Process(p.pid) for p in procs]
        family += [c for p in family for c in p.children(recursive=True)]
        procs[1].send_signal(signal.SIGSTOP)  # stuck: alive, holding its sockets, answering nothing
        stopped = time.monotonic()
        out, _ = procs[0].communicate(timeout=TIMEOUT_MINUTES * 60 + SLACK_SECONDS)
        waited = time.monotonic() - stopped
    finally:
        _end_ranks(procs)
    out = "".join(lines) + out
    assert procs[0].returncode == 1, out
    errors = [line for line in out.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1 and "Traceback" not in out, out
    assert re.match(rf"pretrain_gpt.py: error: a collective did not complete within --distributed-timeout-minutes "
                    rf"{TIMEOUT_MINUTES:g} \(\w+ in \S+:\d+ \w+, rank 0 of 2: .*\): another rank is stuck or died",
                    errors[0]), errors[0]
    assert TIMEOUT_MINUTES * 60 * 0.5 <= waited, f"ended after {waited:.1f}s, before the timeout could have passed"
    assert not still_running(family, timeout=30), "a rank or data worker outlived the test"
