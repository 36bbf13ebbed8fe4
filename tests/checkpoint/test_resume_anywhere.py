"""A checkpoint and its optimizer state move to any TP, PP and DP, ZeRO 0/1, fp32 and bf16, through --load:
the losses after the resume are the uninterrupted run's (fp32: layout invariance makes them equal)."""
import os

import pytest
import torch

from tests.cost.engine_census import imports_frozen
from tests.harness import run_distributed
from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config

pytestmark = pytest.mark.slow

STEPS, SAVE_AT = 4, 2


def _train(tp, pp, dp, extra, save=None, load=None, steps=STEPS, save_at=SAVE_AT):
    """Train to `steps` (from the checkpoint in `load`, or from scratch), saving at `save_at` into `save`;
    returns ({iteration: loss}, the resume's note) on every rank."""
    with imports_frozen():  # BF16_Optimizer's forced collections skip the worker's modules
        return _train_unfrozen(tp, pp, dp, extra, save, load, steps, save_at)


def _train_unfrozen(tp, pp, dp, extra, save, load, steps, save_at):
    from megatron_lite.parallel import state
    from megatron_lite.training import checkpointing
    from megatron_lite.training.engine import Engine

    flags = list(extra) + (["--save", save] if save else []) + (["--load", load] if load else []) + \
        ["--train-iters", str(steps), "--lr-warmup-iters", "1"]
    config = tiny_config(tp, pp, dp, flags)
    state.initialize(tp, pp)
    engine = Engine(config)
    start, note = 0, None
    if load:
        resumed = checkpointing.load(engine, config)
        start, note = resumed.iteration, resumed.note
    batches = global_batches(config, steps)
    data = micro_batches(config, batches[start:], state.get_data_parallel_rank(), dp)
    losses = {}
    for iteration in range(start + 1, steps + 1):
        losses[iteration] = engine.train_step(data).loss
        if save and iteration == save_at:
            checkpointing.save(engine, config, iteration, iteration * config.batch.global_batch_size,
                               checkpointing.SaveFolder(lock=None, run_id="test"))
    return losses, note


def _uninterrupted_then_resumed(tmp_path, source, target, extra_source, extra_target=None):
    ckpt = str(tmp_path / "ckpt")
    world = source[0] * source[1] * source[2]
    full, _ = run_distributed(_train, world, *source, extra_source, ckpt)[0]
    world = target[0] * target[1] * target[2]
    resumed, note = run_distributed(_train, world, *target, extra_target or extra_source, None, ckpt)[0]
    return full, resumed, note


def _relative(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("source, target", [((1, 1, 2), (1, 1, 1)), ((1, 2, 2), (2, 1, 2)), ((2, 2, 1), (1, 1, 4))],
                         ids=["dp2-to-dp1", "pp2dp2-to-tp2dp2", "tp2pp2-to-dp4"])
def test_fp32_zero1_resumes_under_another_layout_with_the_uninterrupted_losses(tmp_path, source, target):
    full, resumed, note = _uninterrupted_then_resumed(tmp_path, source, target, ["--zero-stage", "1"])
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert _relative(resumed[step], full[step]) <= 1e-5, (step, resumed[step], full[step])
    tp, pp, dp = source
    assert note.startswith(f"resharded TP {tp} x PP {pp} x DP {dp} (ZeRO 1, fp32) -> TP {target[0]} x PP "
                           f"{target[1]} x DP {target[2]} (ZeRO 1, fp32): fp32 weights, Adam moments and step"), note


def test_fp32_zero0_to_zero1_at_one_layout_keeps_the_random_generators_so_dropout_continues(tmp_path):
    """Same TP, PP and DP, another ZeRO stage: the layout-free path, and each rank's generators carried over,
    so with dropout the resumed losses are still the uninterrupted run's."""
    dropout = ["--hidden-dropout", "0.2", "--attention-dropout", "0.2"]
    full, resumed, note = _uninterrupted_then_resumed(tmp_path, (1, 1, 2), (1, 1, 2), ["--zero-stage", "0", *dropout],
                                                      ["--zero-stage", "1", *dropout])
    for step in resumed:
        assert _relative(resumed[step], full[step]) <= 1e-5, (step, resumed[step], full[step])
    assert "random generators kept" in note


# bf16: the same step at two layouts differs by bf16 rounding (other reduction orders, other partitions), and the
# difference wanders as the runs go on; a run resumed under another layout rounds as that layout does, so it can
# be no closer to the uninterrupted run than the two layouts are to each other. Measured on this test's model
# (8 steps, relative loss differences, resumed at step 4): uninterrupted runs at the two layouts differ by at most
# 1.3e-4 / 7.5e-5 (ZeRO 0, to DP 1 / to TP 2) and 4.2e-5 / 4.5e-5 (ZeRO 1); the resumed runs differ from the
# source run by at most 1.2e-4 / 3.1e-5 / 3.0e-5 / 1.8e-5. A resume that drops the Adam moments misses by
# 1.6e-3 to 1.7e-3, one whose step count is off (bias correction) by 1.3e-4 to 2.4e-4. Tolerance: three times the
# largest difference between the uninterrupted runs at the two layouts, measured in the test itself.
BF16_STEPS, BF16_SAVE_AT = 8, 4


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """bf16_run(layout, extra) -> ({iteration: loss}, its checkpoint at BF16_SAVE_AT): an uninterrupted run of
    BF16_STEPS, made once per module for every test that starts from it or compares with it (a save changes
    nothing the run computes; resumes only read the checkpoint)."""
    runs = {}

    def run(layout, extra):
        key = (tuple(layout), tuple(extra))
        if key not in runs:
            ckpt = str(tmp_path_factory.mktemp("bf16_run") / "ckpt")
            losses, _ = run_distributed(_train, layout[0] * layout[1] * layout[2], *layout, extra, ckpt, None,
                                        BF16_STEPS, BF16_SAVE_AT)[0]
            runs[key] = losses, ckpt
        return runs[key]

    return run


@pytest.mark.parametrize("zero", ["0", "1"])
@pytest.mark.parametrize("source, target", [((1, 1, 2), (1, 1, 1)), ((1, 1, 2), (2, 1, 1))],
                         ids=["dp2-to-dp1", "dp2-to-tp2"])
def test_bf16_resumes_under_another_layout_within_the_layouts_own_difference(bf16_run, zero, source, target):
    extra = ["--bf16", "--zero-stage", zero]
    world = target[0] * target[1] * target[2]
    full, ckpt = bf16_run(source, extra)
    resumed, note = run_distributed(_train, world, *target, extra, None, ckpt, BF16_STEPS)[0]
    other_layout, _ = bf16_run(target, extra)
    tolerance = 3 * max(_relative(other_layout[s], full[s]) for s in full)
    assert sorted(resumed) == list(range(BF16_SAVE_AT + 1, BF16_STEPS + 1))
    for step in resumed:
        assert _relative(resumed[step], full[step]) <= tolerance, (step, resumed[step], full[step], tolerance)
    assert f"(ZeRO {zero}, bf16) -> " in note


@pytest.mark.parametrize("saved_with, resumed_with", [
    ([], ["--no-accumulate-allreduce-grads-in-fp32"]),
    (["--no-accumulate-allreduce-grads-in-fp32"], []),  # as a checkpoint from before the flag resumes today
], ids=["bf16-optimizer-to-zero-optimizer", "zero-optimizer-to-bf16-optimizer"])
def test_bf16_zero1_resumes_across_its_two_deepspeed_optimizers_through_the_layout_free_path(bf16_run, saved_with,
                                                                                            resumed_with):
    """bf16 at ZeRO 1 runs BF16_Optimizer (fp32 gradients, the default) or DeepSpeedZeroOptimizer; their partition
    files differ, so a switch at the same layout cannot use DeepSpeed's own loader (it fails on the other's file)."""
    extra = ["--bf16", "--zero-stage", "1"]
    full, ckpt = bf16_run((1, 1, 2), extra + saved_with)
    resumed, note = run_distributed(_train, 2, 1, 1, 2, extra + resumed_with, None, ckpt, BF16_STEPS)[0]
    other, _ = bf16_run((1, 1, 2), extra + resumed_with)
    tolerance = 3 * max(_relative(other[s], full[s]) for s in full)
    assert note and "(ZeRO 1, bf16) -> " in note
    for step in resumed:
        assert _relative(resumed[step], full[step]) <= tolerance, (step, resumed[step], full[step], tolerance)


def test_a_bf16_zero0_run_resumes_at_its_own_layout_with_the_uninterrupted_losses(tmp_path):
    """DeepSpeed 0.19's own loader fails on its BF16_Optimizer's ZeRO 0 checkpoint (KeyError 0:
    deepspeed_compat.optimizer_state.own_loader_reads); the layout-free path reads it, bit for bit."""
    full, resumed, note = _uninterrupted_then_resumed(tmp_path, (1, 2, 1), (1, 2, 1), ["--bf16"])
    assert sorted(resumed) == [3, 4] and "random generators kept" in note
    for step in resumed:
        assert resumed[step] == full[step], (step, resumed[step], full[step])


MUON = ("--optimizer", "muon", "--lr", "1e-2", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
        "--untie-embeddings-and-output-weights")


def test_a_muon_tp2_pp2_zero1_checkpoint_resumes_at_tp1_dp2_with_the_uninterrupted_losses_and_adam_is_refused(
        tmp_path):
    """Muon's momentum is an elementwise buffer kept where Adam's moments are: it moves like them. A run with the
    other optimizer is refused before any process group; --finetune takes the weights and starts it fresh."""
    from megatron_lite.config import ConfigError

    full, resumed, note = _uninterrupted_then_resumed(tmp_path, (2, 2, 1), (1, 1, 2), ["--zero-stage", "1", *MUON])
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert _relative(resumed[step], full[step]) <= 1e-5, (step, resumed[step], full[step])
    assert "Muon momentum and Adam moments and step" in note, note
    ckpt = str(tmp_path / "ckpt")
    adam = ["--zero-stage", "1", *MUON[2:], "--train-iters", str(STEPS), "--load", ckpt]
    with pytest.raises(ConfigError, match="trained with --optimizer muon, this run has --optimizer adam"):
        tiny_config(1, 1, 2, adam)
    assert tiny_config(1, 1, 2, adam + ["--finetune"]).optimizer.optimizer == "adam"


def test_a_muon_zero0_checkpoint_resharded_offline_to_tp1_pp2_continues_the_uninterrupted_losses(tmp_path):
    """convert_checkpoint.py reshard writes Muon's group and momentum into the target's plain optimizer state, which
    DeepSpeed's own loader then reads at the new layout."""
    from megatron_lite.checkpoint.reshard import reshard

    full, _ = run_distributed(_train, 2, 2, 1, 1, MUON, str(tmp_path / "ckpt"))[0]
    reshard(str(tmp_path / "ckpt"), str(tmp_path / "tp1pp2"), 1, 2, log=lambda line: None)
    resumed, note = run_distributed(_train, 2, 1, 2, 1, MUON, None, str(tmp_path / "tp1pp2"))[0]
    assert sorted(resumed) == [3, 4] and note is None  # DeepSpeed's loader: the files are this layout's
    for step in resumed:
        assert _relative(resumed[step], full[step]) <= 1e-5, (step, resumed[step], full[step])


def _save_after_loading(tp, pp, dp, extra, load, save):
    """Load (under this layout), save at once: the optimizer state as this layout's engine holds it."""
    from megatron_lite.parallel import state
    from megatron_lite.training import checkpointing
    from megatron_lite.training.engine import Engine

    config = tiny_config(tp, pp, dp, list(extra) + ["--load", load, "--save", save, "--train-iters", str(STEPS),
                                                    "--lr-warmup-iters", "1"])  # _train's schedule
    state.initialize(tp, pp)
    engine = Engine(config)
    resumed = checkpointing.load(engine, config)
    checkpointing.save(engine, config, resumed.iteration, resumed.consumed_samples,
                       checkpointing.SaveFolder(lock=None, run_id="test"))


def _layout_free(path):
    from megatron_lite.checkpoint.format import read_latest, read_metadata
    from megatron_lite.checkpoint.layout_free import LayoutFreeReader

    tag = read_latest(path)
    reader = LayoutFreeReader(os.path.join(path, tag), read_metadata(path, tag))
    return reader.read()


def test_adam_moments_after_a_to_b_to_a_are_bit_identical(tmp_path):
    a, b, back = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "back")
    run_distributed(_train, 2, 1, 1, 2, ["--zero-stage", "1"], a)
    run_distributed(_save_after_loading, 4, 2, 2, 1, ["--zero-stage", "0"], a, b)
    run_distributed(_save_after_loading, 2, 1, 1, 2, ["--zero-stage", "1"], b, back)
    original, returned = _layout_free(a), _layout_free(back)
    assert original.keys() == returned.keys() and len(original) > 10
    for key, state in original.items():
        for field in ("fp32", "exp_avg", "exp_avg_sq"):
            assert getattr(state, field).equal(getattr(returned[key], field)), (key, field)
        assert state.step == returned[key].step == 2.0


DUALPIPEV = ("--pipeline-schedule", "dualpipev")


@pytest.mark.parametrize("source, target", [(DUALPIPEV, DUALPIPEV), (DUALPIPEV, ()), ((), DUALPIPEV)],
                         ids=["dualpipev-to-dualpipev", "dualpipev-to-1f1b", "1f1b-to-dualpipev"])
def test_a_checkpoint_moves_between_the_1f1b_and_dualpipev_schedules_with_the_uninterrupted_losses(tmp_path, source,
                                                                                                    target):
    """Under dualpipev pipeline rank r's files hold stages r and 2 PP - 1 - r: the same schedule resumes through
    DeepSpeed's own loader, the other through the layout-free form; reshard and the reader take its files apart."""
    from megatron_lite.checkpoint.reader import CheckpointReader
    from megatron_lite.checkpoint.reshard import reshard

    extra = ["--zero-stage", "1"]
    full, resumed, note = _uninterrupted_then_resumed(tmp_path, (1, 2, 1), (1, 2, 1), extra + list(source),
                                                      extra + list(target))
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert _relative(resumed[step], full[step]) <= 1e-5, (step, resumed[step], full[step])
    if source == target:
        assert note is None  # DeepSpeed's own loader
    else:
        assert note.startswith(f"resharded TP 1 x PP 2{' (dualpipev)' if source else ''} x DP 1 (ZeRO 1, fp32) -> "
                               f"TP 1 x PP 2{' (dualpipev)' if target else ''} x DP 1"), note
    if source and not target:  # offline: a dualpipev checkpoint resharded to one stage holds the same weights
        ckpt, one = str(tmp_path / "ckpt"), str(tmp_path / "pp1")
        reshard(ckpt, one, 1, 1, log=lambda line: None)
        saved, moved = CheckpointReader(ckpt).full_weights(), CheckpointReader(one).full_weights()
        assert saved.keys() == moved.keys() and all(torch.equal(saved[k], moved[k]) for k in saved)
