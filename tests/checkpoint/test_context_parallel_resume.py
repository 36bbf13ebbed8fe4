"""A checkpoint saved under context parallelism resumes, with its optimizer state, at CP 1 and at TP 2
(the layout-free path: its ZeRO partitions are DeepSpeed's DP x CP ones) and at its own layout (DeepSpeed's
loader, each CP rank's random generators kept): the losses after the resume are the uninterrupted run's."""
import pytest

from tests.harness import run_distributed
from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config

pytestmark = pytest.mark.slow

STEPS, SAVE_AT = 4, 2
ROPE = ["--position-embedding-type", "rope", "--zero-stage", "1"]


def _train(tp, cp, dp, extra, save=None, load=None):
    from megatron_lite.parallel import state
    from megatron_lite.training import checkpointing
    from megatron_lite.training.engine import Engine

    flags = list(extra) + (["--save", save] if save else []) + (["--load", load] if load else []) + \
        ["--train-iters", str(STEPS), "--lr-warmup-iters", "1"]
    config = tiny_config(tp, 1, dp, flags, cp=cp)
    state.initialize(tp, 1, context_parallel_size=cp)
    engine = Engine(config)
    start, note = 0, None
    if load:
        resumed = checkpointing.load(engine, config)
        start, note = resumed.iteration, resumed.note
    batches = global_batches(config, STEPS)
    data = micro_batches(config, batches[start:], state.get_data_parallel_rank(), dp,
                         cp=(state.get_context_parallel_rank(), cp))
    losses = {}
    for iteration in range(start + 1, STEPS + 1):
        losses[iteration] = engine.train_step(data).loss
        if save and iteration == SAVE_AT:
            checkpointing.save(engine, config, iteration, iteration * config.batch.global_batch_size,
                               checkpointing.SaveFolder(lock=None, run_id="test"))
    return losses, note


@pytest.mark.parametrize("target", [(1, 1, 1), (2, 1, 1), (1, 2, 1)], ids=["cp1", "tp2", "same-layout"])
def test_a_cp2_checkpoint_resumes_with_the_uninterrupted_losses(tmp_path, target):
    ckpt = str(tmp_path / "ckpt")
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"] if target == (1, 2, 1) else []
    full, _ = run_distributed(_train, 2, 1, 2, 1, ROPE + dropout, ckpt)[0]
    tp, cp, dp = target
    resumed, note = run_distributed(_train, tp * cp * dp, tp, cp, dp, ROPE + dropout, None, ckpt)[0]
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert abs(resumed[step] - full[step]) <= 1e-5 * abs(full[step]), (step, resumed[step], full[step])
    if target == (1, 2, 1):
        assert note is None or "random generators kept" in note, note
    else:
        assert note.startswith(f"resharded TP 1 x CP 2 x PP 1 x DP 1 (ZeRO 1, fp32) -> TP {tp} x PP 1 x DP 1"), note
