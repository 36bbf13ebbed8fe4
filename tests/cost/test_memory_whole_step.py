"""The whole step against the estimate (issue 31): every rank's peak over a training step, and what stays
alive between steps, measured on real DeepSpeed engines (benchmarks/memory_census.py's cells), within 10% of
cost/memory.py's booking, under each optimizer DeepSpeed runs at ZeRO 0, 1 and 3, and with --optimizer muon
(its one moment per matrix between steps; its look-ahead, assembly, TP gather and Newton-Schulz temporaries in
the optimizer step's phase)."""
import pytest

from benchmarks.memory_census import census_cell

MUON = ("--optimizer", "muon")

# (precision, ZeRO, DP, TP, PP, block, more flags): the default bf16 layout (BF16_Optimizer with fp32 gradients) and fp32
# ZeRO 1 (DeepSpeedZeroOptimizer, its step once 1.28x the estimate) and fp32 ZeRO 3 at DP 2 (its whole tensors
# and fp32 master copy once 1.31x the estimate between steps) in the fast tier; the rest in the full suite.
CELLS = [
    ("bf16", 1, 2, 1, 1, "gpt2", ()),
    ("fp32", 1, 2, 1, 1, "gpt2", ()),
    ("fp32", 3, 2, 1, 1, "gpt2", ()),
    pytest.param("bf16", 3, 1, 1, 1, "gpt2", (), marks=pytest.mark.slow),  # once 0.85x between steps
    pytest.param("fp32", 0, 2, 1, 1, "gpt2", (), marks=pytest.mark.slow),
    pytest.param("bf16", 0, 1, 1, 1, "gpt2", (), marks=pytest.mark.slow),
    pytest.param("bf16", 1, 1, 2, 2, "llama", (), marks=pytest.mark.slow),
    pytest.param("fp16", 1, 2, 1, 1, "gpt2", (), marks=pytest.mark.slow),
    # the later stage's pipe buffers under DeepSpeed's partitioned sends (once 0.87x between steps) and its
    # head's weight gradient in backward (1.07x at the peak once the buffers were right)
    pytest.param("fp32", 0, 1, 2, 2, "gpt2", (), marks=pytest.mark.slow),
    # Muon under BF16_Optimizer over DP (the flat partition assembled by all-reduce: step 1.017x the estimate),
    # and at fp32 ZeRO 0 over TP (each matrix gathered whole on both ranks: 1.006x), DeepSpeedZeroOptimizer
    # (its per-group step once measured 0.936x: the step's gradients freed group by group are not booked; not a
    # row, for the suite's time)
    ("bf16", 1, 2, 1, 1, "gpt2", MUON),
    pytest.param("fp32", 0, 1, 2, 1, "gpt2", MUON, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("precision, zero, dp, tp, pp, block, flags", CELLS)
def test_whole_step_peak_and_bytes_between_steps_are_within_10_percent_of_the_estimate(
        precision, zero, dp, tp, pp, block, flags, tmp_path):
    ds_json = tmp_path / "ds.json"
    ds_json.write_text('{"zero_optimization": {"reduce_bucket_size": 2000}}')
    cell = census_cell(precision, zero, dp, tp, pp, block, str(ds_json), flags)
    for r in cell["ranks"]:
        assert 0.90 <= r["peak_ratio"] <= 1.10, (cell["optimizer"], r)
        assert 0.90 <= r["between_ratio"] <= 1.10, (cell["optimizer"], r)
        if flags:  # the optimizer step's phase, where Muon's temporaries are
            step = r["measured_phases"]["OptimizerStep"] / r["estimated_phases"]["step"]
            assert 0.90 <= step <= 1.10, (cell["optimizer"], step, r)
