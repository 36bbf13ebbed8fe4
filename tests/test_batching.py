import pytest

from megatron_lite.batching import global_batch_size_at, gradient_accumulation_steps_at, resolve_batch
from megatron_lite.config import ConfigError


@pytest.mark.parametrize(
    "dp, micro, glob, gas, expected",
    [
        (1, 4, None, None, (4, 4, 1)),  # micro only: Megatron's default global = micro x DP
        (8, 4, None, None, (4, 32, 1)),
        (8, 4, 128, None, (4, 128, 4)),  # derive gas
        (8, 4, None, 3, (4, 96, 3)),  # derive global
        (8, None, 96, 3, (4, 96, 3)),  # derive micro
        (2, 2, 32, 8, (2, 32, 8)),  # all three agree
        (4, None, 16, None, (1, 16, 4)),  # global only: micro defaults to 1
        (1, None, None, None, (1, 1, 1)),
    ],
)
def test_resolve_batch_derives_the_missing_size(dp, micro, glob, gas, expected):
    b = resolve_batch(dp, micro, glob, gas)
    assert (b.micro_batch_size, b.global_batch_size, b.gradient_accumulation_steps) == expected
    assert b.global_batch_size == b.micro_batch_size * b.gradient_accumulation_steps * dp


def test_global_batch_not_divisible_suggests_neighbours():
    with pytest.raises(ConfigError) as e:
        resolve_batch(8, micro_batch_size=4, global_batch_size=100)
    assert str(e.value) == (
        "--global-batch-size 100 is not divisible by --micro-batch-size 4 x data-parallel size 8 = 32; "
        "use --global-batch-size 96 or 128"
    )


def test_global_batch_smaller_than_one_micro_round_suggests_the_unit():
    with pytest.raises(ConfigError, match=r"use --global-batch-size 32$"):
        resolve_batch(8, micro_batch_size=4, global_batch_size=8)


def test_micro_cannot_be_derived_from_indivisible_global_and_gas():
    with pytest.raises(ConfigError, match=r"--global-batch-size 50 is not divisible by --gradient-accumulation-steps 3 "
                                          r"x data-parallel size 4 = 12.*use --global-batch-size 48 or 60"):
        resolve_batch(4, global_batch_size=50, gradient_accumulation_steps=3)


def test_disagreeing_gas_is_refused_with_the_consistent_global():
    with pytest.raises(ConfigError, match=r"--gradient-accumulation-steps 3 disagrees .* = 4; .*--global-batch-size 24"):
        resolve_batch(2, micro_batch_size=4, global_batch_size=32, gradient_accumulation_steps=3)


@pytest.mark.parametrize("kwargs, flag", [({"micro_batch_size": 0}, "--micro-batch-size"),
                                          ({"global_batch_size": -1}, "--global-batch-size"),
                                          ({"gradient_accumulation_steps": 0}, "--gradient-accumulation-steps")])
def test_sizes_below_one_are_refused_before_deepspeed_sees_them(kwargs, flag):
    with pytest.raises(ConfigError, match=f"{flag} must be at least 1"):
        resolve_batch(2, **kwargs)


def test_rampup_schedule_follows_megatron_semantics():
    # start 8, +8 per step of the ramp, 32 at the end; 3 increments over 300 samples -> one per 100 samples
    b = resolve_batch(2, micro_batch_size=2, global_batch_size=32, rampup_batch_size=(8, 8, 300))
    table = [(0, 8), (99, 8), (100, 16), (199, 16), (200, 24), (299, 24), (300, 32), (10_000, 32)]
    assert [(c, global_batch_size_at(b, c)) for c, _ in table] == table
    assert [gradient_accumulation_steps_at(b, 2, c) for c, _ in table] == [2, 2, 4, 4, 6, 6, 8, 8]


def test_rampup_every_step_is_a_whole_number_of_micro_batches():
    b = resolve_batch(4, micro_batch_size=2, global_batch_size=64, rampup_batch_size=(16, 8, 1000))
    consumed = 0
    while consumed < 2000:
        g = global_batch_size_at(b, consumed)
        assert g % (2 * 4) == 0 and 16 <= g <= 64
        consumed += g
    assert global_batch_size_at(b, consumed) == 64


def test_no_rampup_is_constant():
    b = resolve_batch(1, micro_batch_size=2, global_batch_size=8)
    assert global_batch_size_at(b, 0) == global_batch_size_at(b, 10**9) == 8


@pytest.mark.parametrize(
    "rampup, message",
    [
        ((6, 8, 100), r"--rampup-batch-size start 6 is not divisible by --micro-batch-size 2 x data-parallel size 2 = 4, .*; use 4 or 8"),
        ((8, 6, 100), r"--rampup-batch-size increment 6 is not divisible .* = 4, .*; use 4 or 8"),
        ((64, 8, 100), r"--rampup-batch-size start 64 is larger than --global-batch-size 32"),
        ((8, 16, 100), r"32 - start 8 = 24 is not divisible by increment 16"),
        ((8, 8, 0), r"all three values must be at least 1"),
    ],
)
def test_bad_rampup_is_refused(rampup, message):
    with pytest.raises(ConfigError, match=message):
        resolve_batch(2, micro_batch_size=2, global_batch_size=32, rampup_batch_size=rampup)
