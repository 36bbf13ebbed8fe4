"""A Mixture-of-Experts checkpoint stores every expert by its global index, so it resumes under another
expert-parallel size (and TP, DP) with its optimizer state, continuing the uninterrupted losses."""
import pytest

from tests.harness import run_distributed
from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config
from tests.model.test_moe_parallel import MOE

STEPS, SAVE_AT = 4, 2


def _train(tp, dp, ep, extra, save=None, load=None):
    from megatron_lite.parallel import state
    from megatron_lite.training import checkpointing
    from megatron_lite.training.engine import Engine

    flags = list(MOE) + list(extra) + ["--expert-model-parallel-size", str(ep), "--train-iters", str(STEPS),
                                       "--lr-warmup-iters", "1"]
    flags += (["--save", save] if save else []) + (["--load", load] if load else [])
    config = tiny_config(tp, 1, dp, flags)
    state.initialize(tp, 1, expert_model_parallel_size=ep)
    engine = Engine(config)
    start, note = 0, None
    if load:
        resumed = checkpointing.load(engine, config)
        start, note = resumed.iteration, resumed.note
    data = micro_batches(config, global_batches(config, STEPS)[start:], state.get_data_parallel_rank(), dp)
    losses = {}
    for iteration in range(start + 1, STEPS + 1):
        losses[iteration] = engine.train_step(data).loss
        if save and iteration == SAVE_AT:
            checkpointing.save(engine, config, iteration, iteration * config.batch.global_batch_size,
                               checkpointing.SaveFolder(lock=None, run_id="test"))
    return losses, note


@pytest.fixture(scope="module")
def saved_at_dp4_ep2(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("moe") / "ckpt")
    full, _ = run_distributed(_train, 4, 1, 4, 2, ("--zero-stage", "1"), ckpt)[0]
    return ckpt, full


@pytest.mark.parametrize("tp, dp, ep", [(1, 4, 2), (1, 4, 1), (1, 4, 4), (2, 2, 2)],
                         ids=["same-layout", "ep1", "ep4", "tp2-dp2-ep2"])
def test_moe_checkpoint_resumes_at_another_expert_parallel_size_with_the_uninterrupted_losses(saved_at_dp4_ep2, tp,
                                                                                            dp, ep):
    ckpt, full = saved_at_dp4_ep2
    resumed, note = run_distributed(_train, tp * dp, tp, dp, ep, ("--zero-stage", "1"), None, ckpt)[0]
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert abs(resumed[step] - full[step]) / abs(full[step]) <= 1e-5, (step, resumed[step], full[step], note)
    if (tp, dp, ep) != (1, 4, 2):
        assert note.startswith("resharded TP 1 x PP 1 x DP 4 (EP 2) (ZeRO 1, fp32)"), note
