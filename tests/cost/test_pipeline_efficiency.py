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
