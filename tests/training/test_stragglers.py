"""--log-straggler: a rank slowed by MEGATRON_LITE_INJECT_SLOW is named (rank, place, host) as the slowest on the
console, in metrics.jsonl and in TensorBoard; the ranking and the line, from made-up times; the drill's checks."""
import json
import re
import socket

import pytest

from megatron_lite.config import ConfigError
from megatron_lite.training.stragglers import PHASES, RankTimes, format_line, select
from megatron_lite.validation.stragglers import INJECT_SLOW, parse_inject_slow
from tests.entry_points import run_entry
from tests.training.test_pretrain_e2e import MODEL, data_args, layout

LINE = re.compile(r"stragglers at iteration (\d+) \| .*?: slowest rank (\d+) \((tp\d+ pp\d+ dp\d+) on (\S+)\) ")


def _times(rank, work_phase_ms, wait_ms, place=None):
    phases = {p: 0.0 for p in PHASES}
    phases["forward_backward"], phases["reduce"] = work_phase_ms, wait_ms
    return RankTimes(rank, "node0" if rank < 2 else "node1", place or {"tp": 0, "pp": 0, "dp": rank},
                     work_phase_ms + wait_ms, phases)


def test_the_rank_that_works_longest_is_slowest_though_every_rank_takes_as_long_per_step():
    # Rank 2 computes 90 ms; the others compute 10-12 ms and wait for it in the reduction: equal step times.
    ranks = [_times(0, 10.0, 80.0), _times(1, 12.0, 78.0), _times(2, 90.0, 0.0), _times(3, 11.0, 79.0)]
    chosen = select(ranks, 2)
    assert [r.rank for r in chosen.slowest] == [2, 1]
    assert [r.rank for r in chosen.fastest] == [0, 3]
    assert chosen.phase in ("forward_backward", "reduce") and chosen.phase_high.rank in (2, 0)
    assert chosen.step_range == (90.0, 90.0)


def test_the_count_is_capped_at_the_world_and_ties_go_to_the_lower_rank():
    chosen = select([_times(1, 5.0, 0.0), _times(0, 5.0, 0.0)], 3)
    assert [r.rank for r in chosen.slowest] == [0, 1] and [r.rank for r in chosen.fastest] == [0, 1]


def test_the_line_names_rank_place_host_and_milliseconds():
    ranks = [_times(0, 10.0, 80.0), _times(3, 90.0, 0.0, {"tp": 1, "pp": 1, "dp": 0})]
    line = format_line(8, select(ranks, 1))
    assert line.startswith("stragglers at iteration 8 | ")
    assert "slowest rank 3 (tp1 pp1 dp0 on node1) 90.0 | fastest rank 0 (tp0 pp0 dp0 on node0) 10.0" in line
    assert "widest phase forward_backward: rank 3 (tp1 pp1 dp0 on node1) 90.0, rank 0 (tp0 pp0 dp0 on node0) 10.0" \
        in line
    assert not re.match(r"iteration\s+\d+/\d+", line)  # scripts grep the log lines by that


@pytest.mark.parametrize("text", ["", None])
def test_no_drill_without_the_variable(text):
    assert parse_inject_slow(text, 2) is None


@pytest.mark.parametrize("text", ["2:0.5", "-1:0.5", "1", "1:", "x:1", "1:-0.1", "1:nan", "1:inf", "0.5:1"])
def test_a_drill_that_does_not_parse_or_names_a_missing_rank_is_refused_with_the_form(text):
    with pytest.raises(ConfigError, match=rf"{INJECT_SLOW}=.* must be RANK:SECONDS with a rank from 0 to 1"):
        parse_inject_slow(text, 2)
    assert parse_inject_slow("1:0.25", 2) == (1, 0.25)


def test_a_bad_drill_exits_2_with_one_line_before_any_process_group(corpus, capsys, monkeypatch):
    from megatron_lite.arguments import parse_args_or_exit

    monkeypatch.setenv(INJECT_SLOW, "2:0.5")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_:
        parse_args_or_exit([*MODEL, *data_args(corpus), "--train-iters", "2"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"pretrain_gpt.py: error: {INJECT_SLOW}='2:0.5' must be RANK:SECONDS with a rank from 0 to 1 and a "
        f"non-negative number of seconds slept per step, e.g. 1:0.5"]


def test_log_straggler_needs_the_pipeline_engine():
    from megatron_lite.config import Config
    from megatron_lite.validation.stragglers import straggler_rules

    config = Config().replace(logging__log_straggler=True, parallel__zero_stage=2)
    with pytest.raises(ConfigError, match="--log-straggler .* --zero-stage 2 .* use --zero-stage 0 or 1"):
        straggler_rules(config, [])


RUN = ["--train-iters", "4", "--log-interval", "2"]


def pretrain(corpus, nproc, args, env):
    return run_entry(["pretrain_gpt.py", *MODEL, *data_args(corpus), *args], nproc, timeout=120, env=env)


@pytest.mark.parametrize("pp, dp, slow", [(1, 2, 1), (2, 2, 1)], ids=["dp2", "pp2-dp2"])
def test_a_rank_slowed_by_the_drill_is_named_slowest_with_its_host_within_two_log_intervals(
        corpus, tmp_path, pp, dp, slow):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    result = pretrain(corpus, pp * dp, layout(1, pp) + RUN + ["--log-straggler", "--tensorboard-dir", str(tb),
                                                              "--eval-interval", "2"],
                      env={INJECT_SLOW: f"{slow}:0.4"})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = LINE.findall(result.stdout)
    assert [int(it) for it, *_ in lines] == [2, 4], result.stdout
    place = f"tp0 pp{slow // dp} dp{slow % dp}"
    assert lines[-1][1:] == (str(slow), place, socket.gethostname()), result.stdout
    records = [json.loads(line) for line in open(tb / "metrics.jsonl")]
    stragglers = [r for r in records if r["kind"] == "straggler"]
    assert [r["iteration"] for r in stragglers] == [2, 4]
    slowest = stragglers[-1]["slowest"][0]
    assert (slowest["rank"], slowest["host"], slowest["pp"], slowest["dp"]) == (slow, socket.gethostname(),
                                                                                 slow // dp, slow % dp)
    assert slowest["forward_backward_ms"] >= 400 * 0.9  # the sleep is in its forward passes
    assert stragglers[-1]["fastest"][0]["rank"] != slow
    for entry in stragglers[-1]["slowest"] + stragglers[-1]["fastest"]:  # the evaluation at 2 is not counted
        timed = sum(entry[f"{p}_ms"] for p in PHASES if p != "other")
        assert timed <= 1.02 * entry["step_ms"] and entry["other_ms"] >= 0, entry
    tags = EventAccumulator(str(tb)).Reload().Tags()["scalars"]
    assert "straggler/slowest_rank" in tags and "straggler/pipeline_wait_ms_max" in tags


def test_without_the_flag_nothing_is_reported_though_a_rank_is_slow(corpus, tmp_path):
    tb = tmp_path / "tb"
    result = pretrain(corpus, 2, layout(1, 1) + RUN + ["--tensorboard-dir", str(tb)], env={INJECT_SLOW: "1:0.2"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stragglers" not in result.stdout and re.search(r"iteration\s+4/4", result.stdout)
    assert not [line for line in open(tb / "metrics.jsonl") if '"straggler"' in line]
