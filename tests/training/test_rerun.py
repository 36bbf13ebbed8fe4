"""--rerun-mode (training/rerun.py): a rejected step is replayed in place from its RNG states and micro-batches, and
real corrupted numbers tell a transient fault (exit 17, nothing saved) from a reproducible one (exit 16, the step's
start saved, the host named); a spike stays skipped; report_stats runs each step twice and says how different the
two were; --result-rejected-tracker-filename records each rejection and skips an iteration reproduced twice."""
import json
import os

import pytest
import torch

from megatron_lite import arguments
from megatron_lite.exit_codes import EXIT_FAILED_ON_RESULT_VALIDATION, EXIT_RESUME_TO_DISAMBIGUATE
from megatron_lite.training.rerun import ReplayableIterator, relative_difference
from megatron_lite.validation.numerical_guard import iterations_reproduced_twice
from tests.harness import run_distributed
from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config
from tests.tool_calls import refusal


def test_relative_difference_is_megatrons_nan_equals_nan_and_one_nonfinite_is_infinitely_far():
    assert relative_difference(float("nan"), float("nan")) == 0.0
    assert relative_difference(2.0, 2.0) == 0.0
    assert relative_difference(float("inf"), 1.0) == float("inf")
    assert relative_difference(1.0, float("nan")) == float("inf")
    assert abs(relative_difference(1.0, 1.001) - 0.001 / 1.0005) < 1e-12


def test_a_replayable_iterator_gives_the_step_its_micro_batches_again_and_no_more():
    data = ReplayableIterator(iter(range(10)))
    assert [next(data), next(data)] == [0, 1]
    data.rewind()
    assert [next(data), next(data)] == [0, 1]
    with pytest.raises(RuntimeError, match="more than the step's 2 micro-batches"):
        next(data)


def test_rerun_mode_takes_megatrons_three_values_and_refuses_others_with_one_line():
    assert arguments.parse_args([], world_size=1)[0].numerical_guard.rerun_mode == "validate_results"
    for mode in ("validate_results", "report_stats", "disabled"):
        assert arguments.parse_args(["--rerun-mode", mode], world_size=1)[0].numerical_guard.rerun_mode == mode
    line = refusal(arguments.parse_args_or_exit, ["--rerun-mode", "report_determinism_stats"])
    assert "--rerun-mode" in line and "report_stats" in line, line
    line = refusal(arguments.parse_args_or_exit, ["--rerun-mode", "report_stats", "--zero-stage", "2"])
    assert "--rerun-mode report_stats at --zero-stage 2: ZeRO 2/3" in line, line


def _record(rank, iteration, status="FIRST_RERUN_REPRODUCIBLE", node="n1"):
    return json.dumps({"ts": "t", "node": node, "rank": rank, "iteration": iteration, "status": status,
                       "result": "nan", "message": "m"})


def test_the_tracker_skips_an_iteration_reproduced_twice_on_one_rank_and_reads_megatrons_lines(tmp_path):
    tracker = tmp_path / "tracker"
    assert iterations_reproduced_twice(str(tracker)) == {}  # no file yet: a first start
    tracker.write_text("\n".join([
        _record(1, 3), _record(1, 3, node="n2"),  # twice on rank 1: skipped
        _record(0, 4), _record(1, 4),  # once on each of two ranks: not
        _record(0, 5, "FIRST_RERUN_NOT_REPRODUCIBLE"), _record(0, 5, "FIRST_RERUN_NOT_REPRODUCIBLE"),  # transient
        "ts=now node=n device=0 jobID=j rank=2 iteration=7 status=RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE "
        "result=nan message='loss'",
        "ts=now node=n device=0 jobID=k rank=2 iteration=7 status=RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE "
        "result=nan message='loss'",
        "a line cut sho"]) + "\n")
    assert iterations_reproduced_twice(str(tracker)) == {3: (1, ["n1", "n2"]), 7: (2, ["n", "n"])}
    config, notes = arguments.parse_args(["--train-iters", "10", "--iterations-to-skip", "9",
                                          "--result-rejected-tracker-filename", str(tracker)], world_size=4)
    assert config.training.iterations_to_skip == (3, 7, 9)
    assert any("iteration 3 reproduced twice on rank 1" in n and "--iterations-to-skip" in n for n in notes), notes


def _parameters(engine):
    return [p.detach().clone() for p in engine.module.parameters()]


def _fault_at(fault, k=2, extra=(), tp=1, pp=1):
    """DP 2, steps before k clean, step k with the fault: (the RerunStop's exit code and line, or ("went on",
    skipped, loss); whether any parameter changed in step k; whether the steps before changed any; the engine's
    step counters before step k and at the end; whether the generators are back at step k's start; the guard's
    suspicious note)."""
    import contextlib
    import io

    from megatron_lite.deepspeed_compat import step_guard
    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine
    from megatron_lite.training.rerun import RerunStop
    from megatron_lite.training.rng_state import rng_state

    import torch.distributed as dist

    dp = dist.get_world_size() // (tp * pp)
    config = tiny_config(tp, pp, dp, ("--inject-fault", fault, *extra))
    state.initialize(tp, pp)
    try:
        engine = Engine(config, with_scheduler=False)
        data = micro_batches(config, global_batches(config, k), state.get_data_parallel_rank(), dp)
        initial = _parameters(engine)
        for iteration in range(1, k):
            engine.train_step(data, iteration)
        after_one, counters = _parameters(engine), step_guard.step_counters(engine.engine)
        start = rng_state()["torch"]
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                stats = engine.train_step(data, k)
        except RerunStop as e:
            stop = (e.exit_code, str(e))
        else:
            stop = ("went on", stats.skipped, stats.loss, printed.getvalue())
        changed = any(not torch.equal(p, q) for p, q in zip(engine.module.parameters(), after_one))
        stepped = any(not torch.equal(p, q) for p, q in zip(initial, after_one))
        return (stop, changed, stepped, counters, step_guard.step_counters(engine.engine),
                torch.equal(rng_state()["torch"], start), engine.guard.suspicious)
    finally:
        state.destroy()


def test_a_transient_nan_at_dp2_is_replayed_clean_and_stops_every_rank_with_exit_17_and_no_weight_changed():
    results = run_distributed(_fault_at, 2, "nan_grad:1:2")
    stops = {r[0] for r in results}
    assert len(stops) == 1, stops  # every rank took the same branch
    code, line = stops.pop()
    assert code == EXIT_FAILED_ON_RESULT_VALIDATION, line
    assert "NaN/Inf in the gradient of rank 1" in line and "did not reproduce" in line, line
    assert "a transient fault at iteration 2 on rank 1" in line, line
    for rank, (_, changed, stepped, _, _, _, suspicious) in enumerate(results):
        assert stepped, f"rank {rank}: step 1 changed nothing, so 'unchanged' would prove nothing"
        assert not changed, f"rank {rank}: a weight moved in the rejected step or its replay"
        assert suspicious is None


@pytest.mark.parametrize("tp, pp, fault, what", [
    (2, 1, "nan_grad:3:2", "gradient of rank 3 (tp 1, pp 0, dp 1,"),
    (1, 2, "inf_loss:3:2", "loss of rank 3 (tp 0, pp 1, dp 1,"),
], ids=["tp2-dp2-grad", "pp2-dp2-loss"])
def test_the_replay_at_tp2_and_pp2_tells_a_transient_fault_from_a_persistent_one(tp, pp, fault, what):
    for suffix, code in (("", EXIT_FAILED_ON_RESULT_VALIDATION), (":persistent", EXIT_RESUME_TO_DISAMBIGUATE)):
        results = run_distributed(_fault_at, 4, fault + suffix, 2, ("--hidden-dropout", "0.1"), tp, pp)
        stops = {r[0] for r in results}
        assert len(stops) == 1, stops
        got, line = stops.pop()
        assert got == code and line.startswith(f"NaN/Inf in the {what}"), (suffix, line)
        assert not any(changed for _, changed, *_ in results), suffix


def test_a_persistent_nan_reproduces_and_exits_16_naming_the_host_with_the_step_start_state():
    results = run_distributed(_fault_at, 2, "nan_grad:1:2:persistent")
    stops = {r[0] for r in results}
    assert len(stops) == 1, stops
    code, line = stops.pop()
    assert code == EXIT_RESUME_TO_DISAMBIGUATE, line
    host = os.uname()[1]
    assert "it reproduced" in line and f"resume on other hardware than host {host}" in line, line
    for rank, (_, changed, _, before, after, rng_back, suspicious) in enumerate(results):
        assert not changed, rank
        assert after == before, (rank, "the counters a save records are not the step's start", before, after)
        assert rng_back, (rank, "the generators a save records are not the step's start")
        assert suspicious == {"iteration": 2, "rank": 1, "host": host, "message": suspicious["message"]}


@pytest.mark.parametrize("suffix, verdict", [("", "it did not reproduce (transient"),
                                             (":persistent", "it reproduced (reproducible")],
                         ids=["transient", "persistent"])
def test_a_spike_is_replayed_with_the_same_dropout_masks_then_skipped_and_the_run_goes_on(suffix, verdict):
    # Dropout on: the persistent spike's replay reproduces its loss exactly only from the step's RNG states.
    extra = ("--skip-update-sigma", "3", "--skip-update-window", "2", "--hidden-dropout", "0.1",
             "--attention-dropout", "0.1")
    results = run_distributed(_fault_at, 2, f"spike_loss:1:3{suffix}", 3, extra)
    for rank, (stop, changed, _, before, after, *_) in enumerate(results):
        assert stop[:2] == ("went on", True) and stop[2] > 100, stop
        assert not changed and after[2] == before[2] + 1, (rank, "the replayed skip counted once", before, after)
    printed = results[0][0][3]
    assert "iteration 3: update skipped: loss" in printed and verdict in printed and "rank 1 (host " in printed, \
        printed


def _losses(mode, steps=4):
    """PP 2: each step's loss, the final weights and what rank 0 printed."""
    import contextlib
    import io

    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine

    config = tiny_config(1, 2, 1, ("--rerun-mode", mode, "--log-interval", "2", "--train-iters", str(steps)))
    state.initialize(1, 2)
    printed = io.StringIO()
    try:
        engine = Engine(config)
        data = micro_batches(config, global_batches(config, steps), 0, 1)
        with contextlib.redirect_stdout(printed):
            losses = [engine.train_step(data, i).loss for i in range(1, steps + 1)]
        return losses, _parameters(engine), printed.getvalue()
    finally:
        state.destroy()


def test_report_stats_runs_each_step_twice_reports_the_difference_and_trains_as_a_single_run():
    twice, once = run_distributed(_losses, 2, "report_stats"), run_distributed(_losses, 2, "disabled")
    for rank, ((stats_losses, stats_weights, _), (losses, weights, _)) in enumerate(zip(twice, once)):
        assert stats_losses == losses, rank  # the first runs were left out and changed nothing the second ones see
        assert all(torch.equal(a, b) for a, b in zip(stats_weights, weights)), rank
    out = twice[0][2]
    lines = [line for line in out.splitlines() if line.startswith("rerun report_stats at iteration")]
    assert [line.split(":")[0] for line in lines] == ["rerun report_stats at iteration 2",
                                                       "rerun report_stats at iteration 4"], out
    assert "loss relative difference max 0.000e+00" in lines[0] and "2 of 2 identical" in lines[0], lines


def _pretrain(corpus, args, env=None):
    from tests.entry_points import run_entry
    from tests.training.test_pretrain_e2e import MODEL, data_args, layout

    return run_entry(["pretrain_gpt.py", *MODEL, *data_args(corpus), *layout(1, 1), "--train-iters", "4", *args],
                     2, env=env)


def _error_lines(result):
    assert "Traceback" not in result.stderr, result.stderr
    return [line for line in result.stderr.splitlines() if "error:" in line]


def _tracker(path):
    return [json.loads(line) for line in open(path)]


def test_pretrain_gpt_exits_17_on_a_transient_nan_saving_nothing_and_tracking_it(corpus, tmp_path):
    from tests.training.test_pretrain_e2e import losses_by_iteration

    ckpt, tracker = tmp_path / "ckpt", tmp_path / "tracker.jsonl"
    result = _pretrain(corpus, ["--save", str(ckpt), "--save-interval", "1",
                                "--result-rejected-tracker-filename", str(tracker)],
                       env={"MEGATRON_LITE_INJECT_FAULT": "nan_grad:1:3"})
    assert result.returncode == EXIT_FAILED_ON_RESULT_VALIDATION, result.stdout[-3000:] + result.stderr[-3000:]
    errors = _error_lines(result)
    assert len(errors) == 1, result.stderr
    assert "a transient fault at iteration 3 on rank 1" in errors[0], errors[0]
    assert errors[0].endswith("the last checkpoint (iter_0000002) is kept"), errors[0]
    assert sorted(losses_by_iteration(result.stdout)) == [1, 2]
    assert sorted(name for name in os.listdir(ckpt) if name.startswith("iter_")) == ["iter_0000001", "iter_0000002"]
    assert open(ckpt / "latest").read() == "iter_0000002"
    [record] = _tracker(tracker)
    assert (record["rank"], record["iteration"], record["status"], record["diagnosis"], record["fatal"]) == \
        (1, 3, "FIRST_RERUN_NOT_REPRODUCIBLE", "transient", True), record
    assert record["node"] == os.uname()[1] and record["result"] == "nan", record


def test_pretrain_gpt_exits_16_on_a_persistent_nan_saving_the_weights_of_the_steps_start(corpus, tmp_path):
    from megatron_lite.checkpoint.format import read_metadata
    from tests.training.test_pretrain_e2e import _final_weights

    faulty = _pretrain(corpus, ["--save", str(tmp_path / "a")], env={"MEGATRON_LITE_INJECT_FAULT":
                                                                      "nan_grad:1:3:persistent"})
    reference = _pretrain(corpus, ["--save", str(tmp_path / "b"), "--exit-interval", "2"])
    assert faulty.returncode == EXIT_RESUME_TO_DISAMBIGUATE, faulty.stdout[-3000:] + faulty.stderr[-3000:]
    assert reference.returncode == 0, reference.stderr[-3000:]
    [error] = _error_lines(faulty)
    host = os.uname()[1]
    assert f"resume on other hardware than host {host}" in error and "saved checkpoint iter_0000002" in error, error
    assert open(tmp_path / "a" / "latest").read() == "iter_0000002"
    a, b = _final_weights(tmp_path / "a"), _final_weights(tmp_path / "b")
    assert a and sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    saved = read_metadata(str(tmp_path / "a"), "iter_0000002")
    assert saved["iteration"] == 2 and saved["numerical_guard"]["suspicious"]["host"] == host, saved


def test_a_fault_reproduced_on_two_starts_is_skipped_on_the_third_instead_of_looping_on_exit_16(corpus, tmp_path):
    """Megatron-LM #5281: a fault that follows the job (its data, a corrupt replica) exits 16 on every start. The
    tracker file's two reproducible records of the same rank and iteration make the third start skip it."""
    ckpt, tracker = str(tmp_path / "ckpt"), str(tmp_path / "tracker.jsonl")
    args = ["--save", ckpt, "--load", ckpt, "--save-interval", "1", "--result-rejected-tracker-filename", tracker]
    env = {"MEGATRON_LITE_INJECT_FAULT": "inf_loss:1:3:persistent"}
    codes = [_pretrain(corpus, args, env=env) for _ in range(2)]
    assert [c.returncode for c in codes] == [EXIT_RESUME_TO_DISAMBIGUATE] * 2, codes[-1].stderr[-3000:]
    assert "resumed from" in codes[1].stdout and "at iteration 2" in codes[1].stdout, codes[1].stdout[-3000:]
    records = _tracker(tracker)
    assert [(r["rank"], r["iteration"], r["status"]) for r in records] == [(1, 3, "FIRST_RERUN_REPRODUCIBLE")] * 2
    third = _pretrain(corpus, args, env=env)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    out = third.stdout + third.stderr
    assert "iteration 3 reproduced twice on rank 1" in out, out[-3000:]
    assert "resuming on the same host will likely exit 16 again" in codes[1].stdout, codes[1].stdout[-3000:]
    assert "iteration 3: skipped (--iterations-to-skip)" in third.stdout, third.stdout[-3000:]
    assert open(os.path.join(ckpt, "latest")).read() == "iter_0000004"
