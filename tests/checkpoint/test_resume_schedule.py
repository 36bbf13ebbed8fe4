"""A resume whose learning-rate schedule flags differ from the checkpoint's: refused unless told which schedule to
follow (Megatron-LM's --override-opt-param-scheduler / --use-checkpoint-opt-param-scheduler); issue 61,
reproduction 3: --lr on a resume was silently mixed with the checkpoint's."""
import pytest

from megatron_lite.config import OptimizerConfig
from megatron_lite.training.optimizer import lr_at
from tests.training.test_iterations_to_skip import lrs_by_iteration
from tests.training.test_pretrain_e2e import layout, losses_by_iteration, pretrain

pytestmark = pytest.mark.slow

COMMON = layout(1, 1) + ["--train-iters", "4", "--lr-decay-iters", "4", "--hidden-dropout", "0",
                         "--attention-dropout", "0"]  # --lr 3e-3, --lr-warmup-iters 2 (tests' MODEL)


@pytest.fixture(scope="module")
def first_half(corpus, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("schedule") / "ckpt"
    run = pretrain(corpus, 1, COMMON + ["--save", str(ckpt), "--exit-interval", "2"])
    assert run.returncode == 0, run.stderr[-2000:]
    return ckpt


def resume(corpus, ckpt, tmp_path, *flags):
    return pretrain(corpus, 1, COMMON + ["--load", str(ckpt), "--save", str(tmp_path / "again"), *flags])


def test_a_resume_with_another_lr_is_refused_naming_each_flag_both_values_and_the_two_ways(corpus, first_half,
                                                                                       tmp_path):
    run = resume(corpus, first_half, tmp_path, "--lr", "1e-3", "--lr-warmup-iters", "1")
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    line = next(l for l in run.stderr.splitlines() if "error:" in l)
    assert "--lr: checkpoint 0.003, this run 0.001" in line and "--lr-warmup-iters: checkpoint 2, this run 1" in line
    assert "--override-opt-param-scheduler" in line and "--use-checkpoint-opt-param-scheduler" in line
    assert "Traceback" not in run.stderr and not (tmp_path / "again").exists()
    both = resume(corpus, first_half, tmp_path, "--lr", "1e-3", "--override-opt-param-scheduler",
                  "--use-checkpoint-opt_param-scheduler")  # Megatron-LM's spelling too
    assert both.returncode == 2 and "give one of them" in both.stderr


def test_override_runs_this_runs_schedule_from_the_checkpoints_step(corpus, first_half, tmp_path):
    run = resume(corpus, first_half, tmp_path, "--lr", "1e-3", "--min-lr", "1e-4", "--override-opt-param-scheduler")
    assert run.returncode == 0, run.stderr[-2000:]
    new = OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_iters=2, lr_decay_iters=4)
    logged = lrs_by_iteration(run.stdout)
    assert sorted(logged) == [3, 4]
    for iteration, lr in logged.items():  # the log's lr is the one the step ran at: step k runs lr_at(k - 1)
        assert lr == pytest.approx(lr_at(iteration - 1, new), rel=1e-3), (iteration, lr)


def test_use_checkpoint_keeps_the_checkpoints_schedule_and_the_uninterrupted_losses(corpus, first_half, tmp_path):
    straight = pretrain(corpus, 1, COMMON)
    run = resume(corpus, first_half, tmp_path, "--lr", "1e-3", "--use-checkpoint-opt-param-scheduler")
    assert run.returncode == 0, run.stderr[-2000:]
    expected, got = lrs_by_iteration(straight.stdout), lrs_by_iteration(run.stdout)
    assert got == {k: expected[k] for k in (3, 4)}
    assert losses_by_iteration(run.stdout) == {k: v for k, v in losses_by_iteration(straight.stdout).items()
                                               if k > 2}
