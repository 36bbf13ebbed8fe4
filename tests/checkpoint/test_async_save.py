"""--async-save: a snapshot taken between steps, written by a background thread, committed once every rank's
files are on disk. The files are the synchronous save's, byte for byte, even when training changes the
weights while they are written; saves commit in order; losses after resuming are the uninterrupted run's."""
import filecmp
import os

import pytest

from tests.harness import run_distributed
from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config

pytestmark = pytest.mark.slow


def _save_sync_then_async_then_step(tp, pp, dp, extra, root):
    """Train 2 steps; save synchronously into root/sync and asynchronously into root/async at step 2, then
    train a third step at once (the background writer is still writing) before the async save is waited for.
    A fourth-step async save then waits for the one before it: both commit, in order."""
    from megatron_lite.parallel import state
    from megatron_lite.training import checkpointing
    from megatron_lite.training.async_save import AsyncWriter
    from megatron_lite.training.engine import Engine

    config = tiny_config(tp, pp, dp, list(extra) + ["--train-iters", "4", "--lr-warmup-iters", "1"])
    state.initialize(tp, pp)
    engine = Engine(config)
    batches = global_batches(config, 4)
    data = micro_batches(config, batches, state.get_data_parallel_rank(), dp)
    for _ in range(2):
        engine.train_step(data)
    sync = checkpointing.SaveFolder(lock=None, run_id="sync")
    checkpointing.save(engine, config.replace(training__save=os.path.join(root, "sync")), 2, 16, sync)
    background = checkpointing.SaveFolder(lock=None, run_id="async", writer=AsyncWriter())
    async_config = config.replace(training__save=os.path.join(root, "async"), training__async_save=True)
    checkpointing.save(engine, async_config, 2, 16, background)
    engine.train_step(data)  # changes every weight and moment while the writer may still be writing
    engine.train_step(data)
    checkpointing.save(engine, async_config, 4, 32, background)
    waited_for_the_first = background.waited is not None
    background.wait()
    return waited_for_the_first


def _same_bytes(left, right):
    names = sorted(os.listdir(left))
    assert names == sorted(os.listdir(right))
    different = [n for n in names if n != "megatron_lite.json" and not filecmp.cmp(os.path.join(left, n),
                                                                                   os.path.join(right, n),
                                                                                   shallow=False)]
    assert not different, different


@pytest.mark.parametrize("extra", [["--zero-stage", "0"], ["--zero-stage", "1"], ["--zero-stage", "0", "--bf16"],
                                   ["--zero-stage", "1", "--bf16"]], ids=["fp32-zero0", "fp32-zero1", "bf16-zero0",
                                                                          "bf16-zero1"])
def test_an_async_save_at_pp2_writes_the_sync_saves_bytes_while_training_goes_on(tmp_path, extra):
    results = run_distributed(_save_sync_then_async_then_step, 2, 1, 2, 1, extra, str(tmp_path))
    assert all(results), "the second save did not wait for the first"
    _same_bytes(tmp_path / "sync" / "iter_0000002", tmp_path / "async" / "iter_0000002")
    assert (tmp_path / "async" / "latest").read_text() == "iter_0000004"
    left = sorted(n for n in os.listdir(tmp_path / "async") if not n.endswith(".py"))  # DeepSpeed's scripts
    assert left == ["iter_0000002", "iter_0000004", "latest"]


def _snapshot_measured_and_estimated(tp, pp, dp, extra, root):
    from megatron_lite.checkpoint.snapshot import snapshot_bytes
    from megatron_lite.cost.memory import estimate
    from megatron_lite.parallel import state
    from megatron_lite.deepspeed_config import deepspeed_config
    from megatron_lite.training.engine import Engine

    config = tiny_config(tp, pp, dp, list(extra) + ["--train-iters", "1", "--save", root, "--async-save"])
    state.initialize(tp, pp)
    engine = Engine(config)
    engine.train_step(micro_batches(config, global_batches(config, 1), state.get_data_parallel_rank(), dp))
    engine.io.start_save(deferred=True)
    engine.save(root, "tmp-snapshot")
    measured = sum(snapshot_bytes(obj) for obj, _ in engine.io.deferred)
    estimated = estimate(config, deepspeed_config(config), "cpu")[state.get_pipeline_model_parallel_rank()].snapshot
    return state.get_pipeline_model_parallel_rank(), measured, estimated


@pytest.mark.parametrize("tp, pp, dp, extra", [(1, 2, 1, ["--zero-stage", "0"]), (1, 1, 2, ["--zero-stage", "1", "--bf16"]),
                                               (2, 1, 1, ["--zero-stage", "0", "--bf16"])])
def test_the_memory_estimate_counts_each_ranks_async_snapshot(tmp_path, tp, pp, dp, extra):
    """The estimate is the largest rank's of a stage (DP rank 0, which also writes the layer files)."""
    results = run_distributed(_snapshot_measured_and_estimated, tp * pp * dp, tp, pp, dp, extra, str(tmp_path))
    for stage in range(pp):
        measured = [m for s, m, _ in results if s == stage]
        estimated = {e for s, _, e in results if s == stage}
        assert len(estimated) == 1 and estimated.pop() == pytest.approx(max(measured), rel=0.1), results
