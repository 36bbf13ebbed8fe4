"""--pipeline-partition-method profile: measured per-spec costs (the ranks' agreement: tests/training/test_model_setup.py)."""
from tests.model.gpt_layouts import tiny_config

PROFILE = ("--pipeline-partition-method", "profile", "--num-layers", "4", "--vocab-size", "2048")


def test_measured_seconds_are_positive_and_shared_by_specs_of_one_kind():
    import torch

    from megatron_lite.model.gpt import layer_specs, loss_fn
    from megatron_lite.cost.spec_profile import measure_spec_seconds
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
