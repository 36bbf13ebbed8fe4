import pytest

from megatron_lite.config import ConfigError
from megatron_lite.cost.stages import stage_table
from megatron_lite.model.partition import partition, SpecCost


def gpt_like(num_layers, layer_flops=100.0, embed_flops=5.0, head_flops=150.0):
    specs = [SpecCost("EmbeddingPipe", embed_flops, 1000, False)]
    specs += [SpecCost("TransformerLayer", layer_flops, 500, True) for _ in range(num_layers)]
    specs += [SpecCost("FinalNorm", 1.0, 10, False), SpecCost("LMHeadPipe", head_flops, 1000, False)]
    return specs


def stage_layer_counts(specs, bounds):
    return [sum(s.is_transformer for s in specs[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def stage_costs(specs, bounds):
    return [sum(s.flops for s in specs[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("layers, stages, expected_counts", [
    (4, 2, [3, 1]),  # head (1.5 layers) on the last stage: 305 vs 251 beats 205 vs 351
    (8, 2, [5, 3]),
    (6, 3, [2, 3, 1]),
    (7, 3, [3, 3, 1]),
    (2, 2, [1, 1]),
    (10, 2, [6, 4]),
])
def test_cost_partition_counts_the_head_and_balances_the_largest_stage(layers, stages, expected_counts):
    specs = gpt_like(layers)
    bounds = partition(specs, stages, "cost")
    assert bounds[0] == 0 and bounds[-1] == len(specs)
    assert stage_layer_counts(specs, bounds) == expected_counts


@pytest.mark.parametrize("layers, stages", [(4, 2), (5, 2), (7, 3), (9, 4), (12, 8), (3, 3)])
def test_cost_partition_is_optimal_against_brute_force(layers, stages):
    import itertools

    specs = gpt_like(layers)
    bounds = partition(specs, stages, "cost")
    best = min(
        max(stage_costs(specs, [0, *cuts, len(specs)]))
        for cuts in itertools.combinations(range(1, len(specs)), stages - 1)
        if min(stage_layer_counts(specs, [0, *cuts, len(specs)])) >= 1
    )
    assert max(stage_costs(specs, bounds)) == best
    assert min(stage_layer_counts(specs, bounds)) >= 1


def test_cost_beats_uniform_when_the_head_is_expensive():
    specs = gpt_like(8, head_flops=400.0)
    cost = max(stage_costs(specs, partition(specs, 2, "cost")))
    uniform = max(stage_costs(specs, partition(specs, 2, "uniform")))
    assert cost < uniform
    assert stage_layer_counts(specs, partition(specs, 2, "uniform")) == [4, 4]


def test_uniform_with_layers_not_divisible_gives_extra_layers_to_early_stages():
    specs = gpt_like(7)
    bounds = partition(specs, 3, "uniform")
    assert stage_layer_counts(specs, bounds) == [3, 2, 2]
    assert specs[bounds[0]].name == "EmbeddingPipe" and specs[bounds[-1] - 1].name == "LMHeadPipe"


def test_explicit_layer_counts():
    specs = gpt_like(6)
    assert stage_layer_counts(specs, partition(specs, 3, "1,2,3")) == [1, 2, 3]
    with pytest.raises(ConfigError, match="must list 3 stage layer counts"):
        partition(specs, 3, "1,2,2")


def test_type_regex_balances_matching_layers_and_keeps_one_layer_per_stage():
    specs = gpt_like(6)
    assert stage_layer_counts(specs, partition(specs, 2, "type:transformer")) == [3, 3]
    with pytest.raises(ConfigError, match="matches no layer; layer names: EmbeddingPipe, FinalNorm"):
        partition(specs, 2, "type:Attention")


def test_parameters_method_uses_parameter_counts():
    specs = gpt_like(4)  # embedding and head hold 1000 each, layers 500
    assert stage_layer_counts(specs, partition(specs, 2, "parameters")) == [2, 2]


def test_every_stage_needs_a_transformer_layer():
    with pytest.raises(ConfigError, match="smaller than --pipeline-model-parallel-size 4"):
        partition(gpt_like(3), 4, "cost")
    # even when one huge layer would otherwise deserve a stage of its own
    specs = gpt_like(2, head_flops=10_000.0)
    assert stage_layer_counts(specs, partition(specs, 2, "cost")) == [1, 1]


def test_stage_table_lists_every_stage_and_the_predicted_efficiency():
    specs = gpt_like(4)
    table = stage_table(specs, partition(specs, 2, "cost"), num_micro_batches=8)
    lines = table.splitlines()
    assert len(lines) == 4 and "rel. cost" in lines[0] and "fwd+bwd ms" not in lines[0]
    assert lines[1].split()[:3] == ["0", "0-3", "3"] and "EmbeddingPipe, TransformerLayer" in lines[1]
    # stages cost 305 and 251: bubble 8/9 x balance 278/305
    assert lines[3].startswith(f"predicted pipeline efficiency at 8 micro-batches per step: {8 / 9 * 278 / 305:.3f}")


def measured(specs, seconds):
    import dataclasses

    return [dataclasses.replace(s, seconds=t) for s, t in zip(specs, seconds)]


@pytest.mark.parametrize("layers, stages", [(4, 2), (7, 3), (9, 4)])
def test_profile_partition_is_optimal_for_measured_seconds_against_brute_force(layers, stages):
    import itertools
    import random

    rng = random.Random(layers * 10 + stages)
    specs = measured(gpt_like(layers), [rng.uniform(0.5, 3.0) for _ in range(layers + 3)])
    bounds = partition(specs, stages, "profile")

    def seconds(b):
        return [sum(s.seconds for s in specs[x:y]) for x, y in zip(b[:-1], b[1:])]

    best = min(max(seconds([0, *cuts, len(specs)]))
               for cuts in itertools.combinations(range(1, len(specs)), stages - 1)
               if min(stage_layer_counts(specs, [0, *cuts, len(specs)])) >= 1)
    assert max(seconds(bounds)) == pytest.approx(best)


def test_profile_follows_measured_seconds_where_flops_mislead():
    # FLOPs price the head at 1.5 layers; measured, it costs 4 of them: profile moves a layer off its stage
    # (6.1 s | 6.05 s instead of 5.1 s | 7.05 s).
    specs = measured(gpt_like(8), [0.1] + [1.0] * 8 + [0.05, 4.0])
    assert stage_layer_counts(specs, partition(specs, 2, "cost")) == [5, 3]
    assert stage_layer_counts(specs, partition(specs, 2, "profile")) == [6, 2]
    table = stage_table(specs, partition(specs, 2, "profile"), num_micro_batches=4)
    assert "fwd+bwd ms" in table and "from measured stage costs" in table


def test_profile_without_measurements_is_refused():
    with pytest.raises(ValueError, match="needs measured seconds"):
        partition(gpt_like(4), 2, "profile")
