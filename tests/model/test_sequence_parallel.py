"""--sequence-parallel against the dense single-process GPT, and its dropout streams."""
import pytest
import torch

from tests.harness import run_distributed
from tests.model.gpt_layouts import dense_losses, global_batches, tiny_config
from tests.model.test_gpt_parallel import BOTH_DROPOUTS, STEPS, run_layout, run_layout_once

SP = ("--sequence-parallel",)
MICRO_2 = ("--micro-batch-size", "2")  # b > 1: the sequence collectives copy instead of viewing
FULL = ("--recompute-granularity", "full", "--recompute-method")
RECOMPUTE = {"selective": ("--recompute-granularity", "selective"),
             "uniform2": FULL + ("uniform", "--recompute-num-layers", "2"),
             "block1": FULL + ("block", "--recompute-num-layers", "1")}


@pytest.fixture(scope="module")
def reference():
    config = tiny_config()
    return dense_losses(config, global_batches(config, STEPS))


def assert_close(results, expected, rel):
    for r in results:
        worst = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], expected))
        assert worst <= rel, f"rank {r['rank']} {r['coord']}: {r['losses']} vs {expected} (rel {worst:.2e})"


@pytest.mark.parametrize("tp, pp, dp, extra", [(2, 1, 1, MICRO_2), (2, 2, 1, ()),
                                               pytest.param(4, 1, 2, (), marks=pytest.mark.slow)])
def test_sequence_parallel_layouts_give_the_dense_fp32_losses(tp, pp, dp, extra, reference):
    assert_close(run_layout(tp, pp, dp, extra=SP + extra), reference, rel=1e-5)


def _replicated_gradients(extra):
    """The sequence-parallel parameters' gradients as the optimizer gets them in the first step (TP 2)."""
    import torch.distributed as dist

    from megatron_lite.parallel import state
    from megatron_lite.parallel.layers import is_sequence_parallel_parameter
    from megatron_lite.training.engine import Engine
    from tests.cost.engine_census import _innermost_optimizer
    from tests.model.gpt_layouts import micro_batches

    config = tiny_config(2, 1, 1, SP + MICRO_2 + tuple(extra))
    state.initialize(2, 1)
    engine = Engine(config, with_scheduler=False)
    names = {p: name for name, p in engine.module.named_parameters() if is_sequence_parallel_parameter(p)}
    inner = _innermost_optimizer(engine.optimizer)
    taken, real_step = {}, inner.step

    def step(*args, **kwargs):
        taken.update({name: p.grad.clone() for p, name in names.items()})
        return real_step(*args, **kwargs)

    inner.step = step
    stats = engine.train_step(micro_batches(config, global_batches(config, 1), 0, 1))
    return {"rank": dist.get_rank(), "grads": taken, "grad_norm": stats.grad_norm}


def _dense_gradients():
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    config = tiny_config()
    model = GPTModel(config)
    model_parallel_seed(config.training.seed, config.model.num_layers)
    batch = global_batches(config, 1)[0]
    positions = torch.arange(config.model.seq_length).expand(len(batch), -1)
    model(batch[:, :-1], positions, batch[:, 1:], torch.ones(len(batch), config.model.seq_length)).backward()
    # GPTModel names its layers layers.<spec index>.; the pipeline module <spec index>.
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    return {name[len("layers."):]: p.grad for name, p in model.named_parameters()}, norm.item()


def test_replicated_parameters_get_the_dense_gradient_on_every_tp_rank():
    """LayerNorms, row-parallel biases and the final LayerNorm see one sequence shard per rank; summed over TP
    once per step, every rank holds the same gradient, the dense model's; the clipped norm counts each once."""
    first, second = run_distributed(_replicated_gradients, 2, ())
    dense, dense_norm = _dense_gradients()
    assert first["grad_norm"] == second["grad_norm"] == pytest.approx(dense_norm, rel=1e-5)
    assert len(first["grads"]) == 4 * 6 + 2  # 2 LayerNorms + 2 biases (6 tensors) per layer, the final LayerNorm
    for name, grad in first["grads"].items():
        assert torch.equal(grad, second["grads"][name]), f"{name} differs across TP ranks"
        torch.testing.assert_close(grad, dense[name], rtol=1e-4, atol=1e-6, msg=f"{name} is not the dense gradient")


def test_sequence_parallel_leaves_the_attention_dropout_masks_as_they_are():
    """Attention probabilities are split by heads, not by sequence: their streams do not change."""
    attention = ("--attention-dropout", "0.1")
    without = run_layout_once(2, 1, 1, attention)[0]["losses"]
    assert_close(run_layout(2, 1, 1, extra=SP + attention), without, rel=1e-5)


def test_with_dropout_a_sequence_parallel_pipeline_draws_the_masks_of_one_stage():
    """The residual-stream streams are per (layer, TP rank), never per stage: PP 2 = PP 1."""
    one_stage = run_layout_once(2, 1, 1, SP + BOTH_DROPOUTS)[0]["losses"]
    no_sp = run_layout_once(2, 1, 1, BOTH_DROPOUTS)[0]["losses"]
    assert max(abs(a - b) for a, b in zip(one_stage, no_sp)) > 1e-4, "other residual masks than without SP"
    assert_close(run_layout(2, 2, 1, extra=SP + BOTH_DROPOUTS), one_stage, rel=1e-5)


@pytest.mark.parametrize("recompute", ["selective"] + [pytest.param(r, marks=pytest.mark.slow)
                                                      for r in ("uniform2", "block1")])
def test_recompute_under_sequence_parallelism_replays_the_dropout_masks(recompute):
    plain = run_layout_once(2, 2, 1, SP + BOTH_DROPOUTS)[0]["losses"]
    assert_close(run_layout(2, 2, 1, extra=SP + BOTH_DROPOUTS + RECOMPUTE[recompute]), plain, rel=1e-6)


def _residual_masks(sequence_parallel):
    """What layer 1's residual dropout does to ones on this TP rank's part of the sequence (or the whole)."""
    import dataclasses

    from megatron_lite.config import ModelConfig
    from megatron_lite.model.transformer import TransformerLayer
    from megatron_lite.parallel import state
    from megatron_lite.parallel.random import model_parallel_seed

    state.initialize(2, 1)
    config = dataclasses.replace(ModelConfig(), hidden_dropout=0.5, ffn_hidden_size=256, padded_vocab_size=128)
    layer = TransformerLayer(config, 1, sequence_parallel=sequence_parallel)
    model_parallel_seed(1234, config.num_layers)
    ones = torch.ones(2, 16, config.hidden_size)
    return layer._residual(torch.zeros_like(ones), ones)


def test_each_sequence_shard_draws_its_own_residual_dropout_mask():
    shards = run_distributed(_residual_masks, 2, True)
    assert not torch.equal(shards[0], shards[1]), "both shards drew one mask pattern"
    replicated = run_distributed(_residual_masks, 2, False)
    assert torch.equal(replicated[0], replicated[1]), "a replicated residual stream needs one mask on every rank"
    assert {0.0, 2.0} == set(shards[0].unique().tolist())
