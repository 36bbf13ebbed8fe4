"""--pipeline-partition-method profile: every rank takes rank 0's measurements, so all cut the pipeline alike."""
from tests.harness import run_distributed
from tests.model.gpt_layouts import tiny_config

PROFILE = ("--pipeline-partition-method", "profile", "--num-layers", "4", "--vocab-size", "2048")


def _parts_with_noisy_timings_on(noisy_rank):
    import deepspeed
    import torch.distributed as dist

    from megatron_lite.parallel import state
    from megatron_lite.training import model_setup

    honest = model_setup.measure_spec_seconds
    if dist.get_rank() == noisy_rank:  # a rank whose clock lies wildly: cheap layers dear and the reverse
        model_setup.measure_spec_seconds = lambda *a, **k: [t * (1000.0 if i % 2 else 0.001)
                                                             for i, t in enumerate(honest(*a, **k))]
    try:
        config = tiny_config(1, 2, 1, PROFILE)
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # PipelineModule asks DeepSpeed for ranks
        state.initialize(1, 2)
        return model_setup.build_pipeline(config).parts
    finally:
        model_setup.measure_spec_seconds = honest


def test_every_rank_takes_rank0s_measurements_so_all_cut_the_pipeline_alike():
    parts_noisy_1 = run_distributed(_parts_with_noisy_timings_on, 2, 1)
    assert parts_noisy_1[0] == parts_noisy_1[1]
    parts_noisy_0 = run_distributed(_parts_with_noisy_timings_on, 2, 0)
    assert parts_noisy_0[0] == parts_noisy_0[1]
