"""--iterations-to-skip: the named iterations' data is read and not trained on; the schedule waits; a resume that
skips equals a run that skipped from the start."""
import re

import pytest
import torch

from tests.training.test_pretrain_e2e import _final_weights, layout, losses_by_iteration, pretrain

pytestmark = pytest.mark.slow

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def lrs_by_iteration(text):
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"iteration\s+(\d+)/\d+ .*?\| lr (\S+)", text)}


def test_a_skipped_iteration_reads_its_batch_and_the_next_ones_see_the_data_an_uninterrupted_run_sees(corpus):
    """At a learning rate too small to move the weights, each logged loss is the loss of the first weights on that
    iteration's batch: a run that skips iteration 3 logs iterations 4 and 5 with the uninterrupted run's losses (the
    same batches, at DP 2: each rank read its share of the skipped batch), and no loss for 3."""
    common = layout(1, 1) + NO_DROPOUT + ["--train-iters", "5", "--lr", "1e-12", "--lr-warmup-iters", "0"]
    straight = pretrain(corpus, 2, common)
    skipping = pretrain(corpus, 2, common + ["--iterations-to-skip", "3"])
    assert straight.returncode == 0 and skipping.returncode == 0, straight.stderr + skipping.stderr
    expected, got = losses_by_iteration(straight.stdout), losses_by_iteration(skipping.stdout)
    assert sorted(got) == [1, 2, 4, 5], skipping.stdout
    assert "iteration 3: skipped (--iterations-to-skip): its 8 samples read, not trained on" in skipping.stdout
    for i in got:
        assert got[i] == pytest.approx(expected[i], abs=1e-6), i
    assert got[4] != pytest.approx(expected[3], abs=1e-4)  # the batch read at 4 is 4's, not 3's


def test_a_resume_that_skips_equals_a_run_that_skipped_from_the_start_and_the_schedule_waits(corpus, tmp_path):
    common = layout(1, 2) + NO_DROPOUT + ["--train-iters", "6", "--lr-decay-iters", "6"]
    plain = pretrain(corpus, 2, common)
    straight = pretrain(corpus, 2, common + ["--iterations-to-skip", "4", "--save", str(tmp_path / "a")])
    first = pretrain(corpus, 2, common + ["--save", str(tmp_path / "b"), "--exit-interval", "3"])
    second = pretrain(corpus, 2, common + ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b"),
                                           "--iterations-to-skip", "4"])
    for run in (plain, straight, first, second):
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    expected = losses_by_iteration(straight.stdout)
    resumed = {**losses_by_iteration(first.stdout), **losses_by_iteration(second.stdout)}
    assert sorted(expected) == sorted(resumed) == [1, 2, 3, 5, 6]
    assert resumed == expected
    a, b = _final_weights(tmp_path / "a"), _final_weights(tmp_path / "b")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # The optimizer stepped 5 times: iteration 5 runs at the learning rate of an unskipping run's iteration 4.
    assert lrs_by_iteration(straight.stdout)[5] == lrs_by_iteration(plain.stdout)[4]
    assert lrs_by_iteration(straight.stdout)[6] == lrs_by_iteration(plain.stdout)[5]
