"""The numerical guard (training/numerical_guard.py): a NaN/Inf in one rank's loss or gradients stops the run
before any rank's update, naming the rank; a spike's update is left out as if that step's data had only been
read; faults corrupt real numbers (--inject-fault); bad values are refused before any process group."""
import json
import os
import re

import pytest
import torch

from megatron_lite import arguments
from megatron_lite.config import ConfigError
from megatron_lite.config.numerical_guard import NumericalGuardConfig, parse_faults
from megatron_lite.exit_codes import EXIT_NUMERICAL_FAULT
from megatron_lite.training.numerical_guard import FIRST_VALUES, Rules
from tests.harness import run_distributed
from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config
from tests.tool_calls import refusal


def test_skip_update_sigma_leaves_out_a_loss_far_above_a_full_window_and_keeps_it_out_of_the_window():
    rules = Rules(NumericalGuardConfig(skip_update_sigma=3.0, skip_update_window=4))
    for loss in (5.0, 4.9, 5.1, 100.0):  # the window is not full yet: nothing is judged
        assert rules.reason_to_skip(loss, None) is None
    rules = Rules(NumericalGuardConfig(skip_update_sigma=3.0, skip_update_window=4))
    for loss in (5.0, 4.9, 5.1, 5.0):
        assert rules.reason_to_skip(loss, None) is None
    reason = rules.reason_to_skip(50.0, None)
    assert reason and reason.startswith("loss 50 is") and "--skip-update-sigma 3" in reason
    assert list(rules.window["loss"]) == [5.0, 4.9, 5.1, 5.0]
    assert rules.reason_to_skip(4.8, None) is None  # below the mean: never a spike
    assert rules.reason_to_skip(5.0, 1e6) is None  # the rule is off without a full gradient-norm window
    assert rules.reason_to_skip(5.1, 1.0) is None


def test_spiky_loss_and_large_grads_reject_over_ten_times_the_largest_of_the_first_hundred():
    rules = Rules(NumericalGuardConfig(check_for_spiky_loss=True, check_for_large_grads=True))
    for i in range(FIRST_VALUES):
        assert rules.reason_to_skip(3.0 + (i == 7), 2.0) is None  # 10x a spike inside the first 100 still passes
    assert rules.reason_to_skip(39.0, 2.0) is None
    assert "loss 41 is over 10x the largest of the first 100 (4)" in rules.reason_to_skip(41.0, 2.0)
    assert "grad_norm 21" in rules.reason_to_skip(3.0, 21.0)


def test_rules_state_survives_the_checkpoints_json_and_judges_the_same_after_it():
    g = NumericalGuardConfig(skip_update_sigma=2.0, skip_update_window=3, check_for_spiky_loss=True)
    straight = Rules(g)
    for loss, norm in ((5.0, 1.0), (4.0, 1.5), (4.5, 1.2)):
        straight.reason_to_skip(loss, norm)
    resumed = Rules(g)
    resumed.load_state_dict(json.loads(json.dumps(straight.state_dict())))
    for loss, norm in ((4.4, 1.1), (9.0, 1.0), (4.3, 9.0), (4.2, 1.0)):
        assert resumed.reason_to_skip(loss, norm) == straight.reason_to_skip(loss, norm)
    assert resumed.state_dict() == straight.state_dict()


def test_inject_fault_syntax_takes_kind_rank_iteration_lists():
    assert parse_faults("nan_grad:1:3, spike_loss:0:5:persistent") == (("nan_grad", 1, 3, False),
                                                                       ("spike_loss", 0, 5, True))
    for bad in ("nan:1:3", "nan_grad:1", "nan_grad:-1:3", "nan_grad:1:0", "inf_loss:a:2", "nan_grad:1:3:always"):
        with pytest.raises(ConfigError, match="KIND:RANK:ITERATION"):
            parse_faults(bad)


@pytest.mark.parametrize("argv, env, expected", [
    (["--inject-fault", "nan_grad:0"], {}, "--inject-fault 'nan_grad:0' must be KIND:RANK:ITERATION"),
    (["--inject-fault", "nan_grad:1:2"], {}, "--inject-fault nan_grad:1:2: rank 1 does not exist in a world of 1"),
    (["--inject-fault", "spike_loss:0:11"], {}, "iteration 11 is after --train-iters 10; use 1 to 10"),
    ([], {"MEGATRON_LITE_INJECT_FAULT": "inf_loss:0:99"}, "MEGATRON_LITE_INJECT_FAULT inf_loss:0:99: iteration 99"),
    ([], {"MEGATRON_LITE_INJECT_FAULT": "grad:0:1"}, "MEGATRON_LITE_INJECT_FAULT 'grad:0:1' must be"),
    (["--zero-stage", "2", "--skip-update-sigma", "6"], {}, "--skip-update-sigma at --zero-stage 2: ZeRO 2/3"),
    (["--skip-update-window=1"], {}, "argument --skip-update-window: must be at least 2, got 1"),
], ids=["syntax", "rank", "iteration", "environment", "environment-syntax", "zero2", "window"])
def test_bad_guard_flags_exit_2_with_one_line_before_any_process_group(argv, env, expected, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    line = refusal(arguments.parse_args_or_exit, ["--num-layers", "2", "--hidden-size", "32",
                                                  "--num-attention-heads", "2", "--train-iters", "10", *argv])
    assert expected in line, line


def test_the_guard_is_on_by_default_and_its_flags_round_trip():
    config = arguments.parse_args(["--train-iters", "5"], world_size=2)[0]
    assert config.numerical_guard.check_for_nan_in_loss_and_grad
    off = arguments.parse_args(["--no-check-for-nan-in-loss-and-grad", "--inject-fault", "nan_grad:1:2",
                                "--skip-update-sigma", "6"], world_size=2)[0]
    assert not off.numerical_guard.check_for_nan_in_loss_and_grad
    argv = arguments.config_to_argv(off, sections=["numerical_guard"])
    assert arguments.config_from_argv(argv).numerical_guard == off.numerical_guard


def _optimizer_tensors(engine):
    from megatron_lite.deepspeed_compat import optimizer_state

    state = optimizer_state.inner_optimizer(engine.optimizer).state_dict()["state"]
    return [t.detach().clone() for s in state.values() for t in s.values() if torch.is_tensor(t)]


def _fault_at_step_two(tp, pp, kind, bad_rank):
    """Step 1 clean, step 2 with the fault: (the NumericalFault's line or None, parameters changed by step 2,
    optimizer tensors changed by step 2, parameters changed by step 1)."""
    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine
    from megatron_lite.training.numerical_guard import NumericalFault

    dp = 4 // (tp * pp)
    # Without the replay (tests/training/test_rerun.py replays it): the guard's own stop.
    config = tiny_config(tp, pp, dp, ("--inject-fault", f"{kind}:{bad_rank}:2", "--rerun-mode", "disabled"))
    state.initialize(tp, pp)
    try:
        engine = Engine(config, with_scheduler=False)
        data = micro_batches(config, global_batches(config, 2), state.get_data_parallel_rank(), dp)
        initial = [p.detach().clone() for p in engine.module.parameters()]
        engine.train_step(data)
        after_one = [p.detach().clone() for p in engine.module.parameters()]
        moments = _optimizer_tensors(engine)
        line = None
        try:
            engine.train_step(data)
        except NumericalFault as e:
            line = str(e)
        changed = sum(not torch.equal(p, q) for p, q in zip(engine.module.parameters(), after_one))
        moved = sum(not torch.equal(a, b) for a, b in zip(_optimizer_tensors(engine), moments))
        stepped = sum(not torch.equal(p, q) for p, q in zip(initial, after_one))
        return line, changed, moved, stepped
    finally:
        state.destroy()


@pytest.mark.parametrize("tp, pp, kind, bad_rank, what", [
    (2, 1, "nan_grad", 3, "gradient of rank 3 (tp 1, pp 0, dp 1,"),
    (1, 2, "nan_grad", 2, "gradient of rank 2 (tp 0, pp 1, dp 0,"),
    (1, 2, "inf_loss", 3, "loss of rank 3 (tp 0, pp 1, dp 1,"),
], ids=["tp2-dp2-grad", "pp2-dp2-grad", "pp2-dp2-loss"])
def test_a_nan_in_one_ranks_step_stops_every_rank_before_the_reduction_with_no_weight_or_moment_changed(
        tp, pp, kind, bad_rank, what):
    results = run_distributed(_fault_at_step_two, 4, tp, pp, kind, bad_rank)
    lines = {line for line, *_ in results}
    assert len(lines) == 1 and None not in lines, lines  # every rank stopped, with the same line
    line = lines.pop()
    assert line.startswith(f"NaN/Inf in the {what}") and "at iteration 2" in line, line
    assert len(re.findall(r"rank \d", line)) == 1, line  # only the faulty rank: checked before any reduction
    for rank, (_, changed, moved, stepped) in enumerate(results):
        assert stepped > 0, f"rank {rank}: step 1 changed nothing, so 'unchanged' would prove nothing"
        assert (changed, moved) == (0, 0), f"rank {rank}: {changed} parameters, {moved} optimizer tensors moved"


def _measured_then_reduced(bad_rank: int):
    """Two ranks: the guard measures each rank's gradients (a NaN in bad_rank's), the data-parallel reduction
    then sums them (every rank's holds the NaN), and the guard decides: (what measure raised, decide's line,
    the grad norm the rules judged when no rank has a NaN)."""
    import torch.distributed as dist

    from megatron_lite.training.numerical_guard import Coordinates, NumericalFault, NumericalGuard

    rank = dist.get_rank()
    guard = NumericalGuard(NumericalGuardConfig(rerun_mode="disabled", skip_update_sigma=3.0), True,
                           Coordinates(rank, 0, 0, rank, "host"), torch.device("cpu"))
    grads = [torch.full((4,), 3.0 * (rank + 1)), torch.ones(2)]
    if bad_rank == rank:
        grads[1][0] = float("nan")
    guard.measure(torch.tensor(2.0), 1, grads)  # returns: the all-reduce of its numbers is left in flight
    for grad in grads:
        dist.all_reduce(grad)  # what DeepSpeed does between: afterwards, no gradient says whose the NaN was
    try:
        guard.decide()
    except NumericalFault as e:
        return str(e), None
    return None, guard.rules.window["grad_norm"][-1]


def test_the_guard_judges_each_ranks_numbers_from_before_the_reduction_though_it_decides_after_it():
    lines = {line for line, _ in run_distributed(_measured_then_reduced, 2, 1)}
    assert len(lines) == 1, lines
    line = lines.pop()
    assert line.startswith("NaN/Inf in the gradient of rank 1 (tp 0, pp 0, dp 1, host host)"), line
    assert "rank 0" not in line, line
    norms = [norm for _, norm in run_distributed(_measured_then_reduced, 2, None)]
    # Each rank's own squared norm, summed (4 * 3^2 + 2 and 4 * 6^2 + 2); judged after the sums it would be
    # sqrt(4 * 9^2 + 4 + 4 * 9^2 + 4) = 18.2.
    assert norms == [pytest.approx((4 * 9 + 2 + 4 * 36 + 2) ** 0.5)] * 2, norms


K = 5  # the step whose update the spike makes the guard leave out
STEPS = 8


def _agreed_each_step(extra, exit_on_rank1_at):
    """PP 2, three steps: what the guard's all-reduce agreed after each (take_agreed), then whether it forgets;
    rank 1 asks to exit from step exit_on_rank1_at."""
    import torch.distributed as dist

    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine

    config = tiny_config(1, 2, 1, ["--global-batch-size", "4", *extra])
    state.initialize(1, 2)
    try:
        engine = Engine(config, with_scheduler=False)
        agreed = []
        for iteration in range(1, 4):
            asks = dist.get_rank() == 1 and iteration >= exit_on_rank1_at
            engine.guard.exit_requested = lambda asks=asks: asks
            engine.train_step(micro_batches(config, global_batches(config, 1), 0, 1), iteration)
            agreed.append(engine.guard.take_agreed())
        return agreed, engine.guard.take_agreed()
    finally:
        state.destroy()


@pytest.mark.parametrize("extra, exit_at, expected", [
    ((), 2, [(False, False), (True, False), (True, False)]),
    (("--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss", "--rerun-mode", "disabled",
      "--inject-fault", "inf_loss:1:2"), 9, [(False, False), (False, True), (False, False)]),
    (("--no-check-for-nan-in-loss-and-grad", "--rerun-mode", "disabled"), 1, [None, None, None]),
], ids=["exit-on-one-rank", "unchecked-inf-loss", "guard-off"])
def test_every_rank_agrees_on_an_exit_and_a_non_finite_loss_from_the_guards_all_reduce_alone(extra, exit_at, expected):
    # The training loop reads these instead of all-reducing its own flags; with the guard off it still does.
    for agreed, again in run_distributed(_agreed_each_step, 2, list(extra), exit_at):
        assert agreed == expected and again is None


def _spiky_run(spike: bool):
    """DP 2: each step's (loss, skipped) and the final weights; with spike, rank 1's loss x 1000 at step K,
    otherwise step K's data read and not trained on (the uninterrupted run that skipped that update)."""
    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine

    rules = ("--skip-update-sigma", "4", "--skip-update-window", "3")
    config = tiny_config(1, 1, 2, rules + (("--inject-fault", f"spike_loss:1:{K}") if spike else ()))
    state.initialize(1, 1)
    try:
        engine = Engine(config)
        data = micro_batches(config, global_batches(config, STEPS), state.get_data_parallel_rank(), 2)
        steps = {}
        for iteration in range(1, STEPS + 1):
            if iteration == K and not spike:
                for _ in range(config.batch.gradient_accumulation_steps):
                    next(data)
                continue
            stats = engine.train_step(data, iteration)
            steps[iteration] = (stats.loss, stats.skipped, engine.optimizer.param_groups[0]["lr"])
        return steps, [p.detach().clone() for p in engine.module.parameters()]
    finally:
        state.destroy()


def test_a_spike_at_step_k_is_left_out_and_the_run_equals_one_that_never_applied_step_k():
    (spiked, weights), _ = run_distributed(_spiky_run, 2, True)
    (reference, reference_weights), _ = run_distributed(_spiky_run, 2, False)
    assert spiked[K][1] and spiked[K][0] > 100, spiked[K]  # the spike was real, and left out
    assert [i for i, s in spiked.items() if s[1]] == [K] + [i for i, s in reference.items() if s[1]]
    for iteration, (loss, skipped, lr) in reference.items():
        assert abs(spiked[iteration][0] - loss) <= 1e-5, (iteration, spiked[iteration][0], loss)
        assert spiked[iteration][2] == lr, (iteration, "the schedule moved on for a skipped step")
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(weights, reference_weights))


@pytest.mark.slow
def test_pretrain_gpt_without_rerun_stops_on_an_injected_nan_with_one_line_and_exit_18_keeping_the_last_checkpoint(
        corpus, tmp_path):
    from tests.entry_points import run_entry
    from tests.training.test_pretrain_e2e import MODEL, data_args, layout, losses_by_iteration

    result = run_entry(["pretrain_gpt.py", *MODEL, *data_args(corpus), *layout(1, 2), "--train-iters", "4",
                        "--save", str(tmp_path / "ckpt"), "--save-interval", "1", "--rerun-mode", "disabled"], 2,
                       env={"MEGATRON_LITE_INJECT_FAULT": "nan_grad:0:3"})
    assert result.returncode == EXIT_NUMERICAL_FAULT, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert errors[0].startswith("pretrain_gpt.py: error: NaN/Inf in the gradient of rank 0 (tp 0, pp 0, dp 0, "
                                "host ") and "at iteration 3" in errors[0], errors[0]
    assert sorted(losses_by_iteration(result.stdout)) == [1, 2]
    assert open(tmp_path / "ckpt" / "latest").read() == "iter_0000002"
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000002")


def _skipped_iterations(save):
    """The iterations whose logged interval skipped an update, from the run's metrics.jsonl (log interval 1)."""
    from megatron_lite.line_records import read_json_lines

    records = read_json_lines(os.path.join(save, "metrics", "metrics.jsonl"))
    return sorted({r["iteration"] for r in records if r.get("kind") == "interval" and r.get("skipped_steps")})


@pytest.mark.slow
def test_the_rolling_window_survives_a_resume_so_the_resumed_run_skips_the_spike_the_uninterrupted_run_skips(
        corpus, tmp_path):
    """Issue 59: the guard's state is in the checkpoint and restored. Resumed at step 4 with a window of 3, a run
    that started its window afresh would hold only step 5's loss at step 6, judge nothing and train on the spike;
    restored, it holds steps 2-5 and leaves the spike out, as the uninterrupted run does, and the losses after it
    are the uninterrupted run's."""
    from tests.entry_points import run_entry
    from tests.training.test_pretrain_e2e import MODEL, data_args, layout, losses_by_iteration

    rules = ["--skip-update-sigma", "4", "--skip-update-window", "3", "--train-iters", "8"]
    spike = {"MEGATRON_LITE_INJECT_FAULT": "spike_loss:0:6"}

    def run(save, *extra):
        result = run_entry(["pretrain_gpt.py", *MODEL, *data_args(corpus), *layout(1, 1), *rules, "--save", save,
                            *extra], 1, env=spike)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return losses_by_iteration(result.stdout)

    whole = run(str(tmp_path / "whole"))
    first = run(str(tmp_path / "resumed"), "--save-interval", "4", "--exit-interval", "4")
    resumed = run(str(tmp_path / "resumed"), "--load", str(tmp_path / "resumed"))
    assert sorted(first) == [1, 2, 3, 4] and sorted(resumed) == [5, 6, 7, 8], (first, resumed)
    assert _skipped_iterations(str(tmp_path / "whole")) == [6]
    assert _skipped_iterations(str(tmp_path / "resumed")) == [6], "the resumed run trained on the spike"
    for iteration in (1, 2, 3, 4, 5, 7, 8):
        loss = {**first, **resumed}[iteration]
        assert abs(loss - whole[iteration]) <= 1e-5 * abs(whole[iteration]), (iteration, loss, whole[iteration])
