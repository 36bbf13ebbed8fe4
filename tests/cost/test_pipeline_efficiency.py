import pytest

from megatron_lite.cost.pipeline_efficiency import balance, bubble_efficiency, predicted_pipeline_efficiency


@pytest.mark.parametrize("stages, gas, expected", [(1, 1, 1.0), (2, 16, 16 / 17), (4, 16, 16 / 19), (8, 32, 32 / 39)])
def test_balanced_stages_reach_the_bubble_bound(stages, gas, expected):
    assert predicted_pipeline_efficiency([2.5] * stages, gas) == pytest.approx(expected, rel=1e-12)
    assert bubble_efficiency(stages, gas) == pytest.approx(expected, rel=1e-12)


def test_unbalanced_stages_lose_mean_over_max():
    # stages of 3 and 1 units: the slow one sets the pace, the mean is 2, so balance 2/3
    assert balance([3.0, 1.0]) == pytest.approx(2 / 3)
    assert predicted_pipeline_efficiency([3.0, 1.0], 8) == pytest.approx(8 / 9 * 2 / 3)
    assert predicted_pipeline_efficiency([435.0, 365.0], 16) == pytest.approx(16 / 17 * 400 / 435)
    assert predicted_pipeline_efficiency([1.0, 2.0, 3.0, 6.0], 12) == pytest.approx(12 / 15 * 3 / 6)


@pytest.mark.parametrize("costs, gas", [([], 4), ([0.0, 0.0], 4), ([1.0, -1.0], 4), ([1.0], 0)])
def test_meaningless_inputs_are_refused(costs, gas):
    with pytest.raises(ValueError):
        predicted_pipeline_efficiency(costs, gas)


# --pipeline-schedule dualpipev: the closed forms are what a replay of DeepSpeed's own instruction streams gives.

def _replayed_end(pp, gas, schedule, forward, backward):
    from megatron_lite.cost.schedule_replay import replay
    from megatron_lite.deepspeed_compat.dualpipev import instruction_streams, timed_streams

    streams = timed_streams(instruction_streams(pp, gas, schedule), lambda kind, stage: forward
                            if kind == "forward" else backward)
    return max(replay(streams))


@pytest.mark.parametrize("forward, backward", [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0), (0.3, 1.7), (1.0, 3.0)])
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_dualpipev_bubble_is_a_replay_of_the_schedule_deepspeed_generates(pp, forward, backward):
    from megatron_lite.cost.pipeline_efficiency import dualpipev_bubble

    for gas in (2 * pp, 2 * pp + 1, 4 * pp):
        work = 2 * gas * (forward + backward)  # a rank's two stages
        assert _replayed_end(pp, gas, "dualpipev", forward, backward) == pytest.approx(
            work + dualpipev_bubble(pp, forward, backward), rel=1e-12)


@pytest.mark.parametrize("pp, gas", [(2, 4), (2, 16), (4, 8), (4, 16), (8, 32)])
def test_the_same_replay_of_deepspeeds_1f1b_schedule_gives_the_1f1b_bubble(pp, gas):
    # a 1F1B stage holds two DualPipeV stages' layers: forward 2, backward 4
    assert _replayed_end(pp, gas, "1f1b", 2.0, 4.0) == pytest.approx(6.0 * gas / bubble_efficiency(pp, gas))


def test_dualpipev_idles_5pp_minus_6_forwards_where_1f1b_idles_6pp_minus_6():
    from megatron_lite.cost.pipeline_efficiency import bubble_periods, dualpipev_bubble, dualpipev_bubble_efficiency

    for pp in (2, 4, 8):
        assert dualpipev_bubble(pp, 1.0, 2.0) == 5 * pp - 6
        assert bubble_periods("dualpipev", pp) == pytest.approx((5 * pp - 6) / 6)
        assert bubble_periods("1f1b", pp) == pp - 1
    assert dualpipev_bubble_efficiency(2, 4) == pytest.approx(24 / 28)
    assert dualpipev_bubble_efficiency(4, 8) == pytest.approx(48 / 62)
    with pytest.raises(ValueError, match="at least 2 x 2 micro-batches"):
        dualpipev_bubble_efficiency(2, 3)
    with pytest.raises(ValueError, match="at least 2 pipeline ranks"):
        dualpipev_bubble(1, 1.0, 2.0)


def test_a_dualpipev_rank_sets_the_pace_with_its_two_stages_together():
    from megatron_lite.cost.pipeline_efficiency import dualpipev_bubble_efficiency, rank_costs

    # four stages: rank 0 holds the first and the last (3 + 2), rank 1 the middle two (1 + 2)
    assert rank_costs([3.0, 1.0, 2.0, 2.0], "dualpipev") == [5.0, 3.0]
    assert predicted_pipeline_efficiency([3.0, 1.0, 2.0, 2.0], 8, "dualpipev") == pytest.approx(
        dualpipev_bubble_efficiency(2, 8) * 4 / 5)
    with pytest.raises(ValueError, match="even number of stages"):
        rank_costs([1.0, 2.0, 3.0], "dualpipev")


def test_replay_refuses_streams_that_deadlock():
    from megatron_lite.cost.schedule_replay import replay

    with pytest.raises(ValueError, match="deadlock"):
        replay([[("exchange", [(1, "recv")])], [("exchange", [(0, "recv")])]])
