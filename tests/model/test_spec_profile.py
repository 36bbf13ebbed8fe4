"""--pipeline-partition-method profile: measured per-spec costs, one partition for every rank."""
from tests.harness import run_distributed
from tests.model.gpt_layouts import tiny_config

PROFILE = ("--pipeline-partition-method", "profile", "--num-layers", "4", "--vocab-size", "2048")


def _parts_with_noisy_timings_on(noisy_rank):
    import deepspeed
    import torch.distributed as dist

    from megatron_lite.model import gpt
    from megatron_lite.parallel import state

    honest = gpt.measure_spec_seconds
    if dist.get_rank() == noisy_rank:  # a rank whose clock lies wildly: cheap layers dear and the reverse
        gpt.measure_spec_seconds = lambda *a, **k: [t * (1000.0 if i % 2 else 0.001) for i, t in enumerate(honest(*a, **k))]
    try:
        config = tiny_config(1, 2, 1, PROFILE)
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # PipelineModule asks DeepSpeed for ranks
        state.initialize(1, 2)
        return gpt.build(config, state.get_topology()).parts
    finally:
        gpt.measure_spec_seconds = honest


def test_every_rank_takes_rank0s_measurements_so_all_cut_the_pipeline_alike():
    parts_noisy_1 = run_distributed(_parts_with_noisy_timings_on, 2, 1)
    assert parts_noisy_1[0] == parts_noisy_1[1]
    parts_noisy_0 = run_distributed(_parts_with_noisy_timings_on, 2, 0)
    assert parts_noisy_0[0] == parts_noisy_0[1]


def test_measured_seconds_are_positive_and_shared_by_specs_of_one_kind():
    import torch

    from megatron_lite.model.gpt import layer_specs, loss_fn
    from megatron_lite.model.spec_profile import measure_spec_seconds
    from megatron_lite.parallel.random import get_rng_tracker

    config = tiny_config(extra=PROFILE)
    m = config.model
    before, tracked = torch.get_rng_state(), get_rng_tracker().get_states()
    seconds = measure_spec_seconds(layer_specs(config), loss_fn, 1, m.seq_length, m.hidden_size, m.vocab_size,
                                   config.training.seed, m.num_layers, torch.device("cpu"), repeats=3)
    assert torch.equal(before, torch.get_rng_state()) and get_rng_tracker().get_states().keys() == tracked.keys()
    assert len(seconds) == m.num_layers + 3 and min(seconds) > 0
    assert len(set(seconds[1:1 + m.num_layers])) == 1  # one transformer layer measured, shared by all
    assert seconds[-1] > seconds[-2]  # a 2048-word head with its cross entropy costs more than a LayerNorm
