import pytest

from megatron_lite.model.pipeline_efficiency import predicted_pipeline_efficiency


@pytest.mark.parametrize("stages, gas, expected", [(1, 1, 1.0), (2, 16, 16 / 17), (4, 16, 16 / 19), (8, 32, 32 / 39),
                                                   (4, 1, 1 / 4)])
def test_balanced_stages_give_the_bubble_fraction(stages, gas, expected):
    assert predicted_pipeline_efficiency([3.0] * stages, gas) == pytest.approx(expected, rel=1e-12)


def test_an_unbalanced_stage_scales_by_mean_over_max():
    # mean 2.5, max 4: balance 0.625; bubble 8 / 11
    assert predicted_pipeline_efficiency([1.0, 2.0, 3.0, 4.0], 8) == pytest.approx(8 / 11 * 0.625, rel=1e-12)
    assert predicted_pipeline_efficiency([2.0, 1.0], 1) == pytest.approx(0.5 * 0.75, rel=1e-12)


@pytest.mark.parametrize("costs, gas", [([], 4), ([1.0], 0), ([0.0, 0.0], 4), ([-1.0, 2.0], 4)])
def test_bad_inputs_are_refused(costs, gas):
    with pytest.raises(ValueError):
        predicted_pipeline_efficiency(costs, gas)
