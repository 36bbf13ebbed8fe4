"""A dropless Mixture-of-Experts GPT (8 experts, top-2, a shared expert, aux and z-losses, the first layer
dense) computes the dense single-process losses and gradient norms under expert parallelism combined with
every other layout, and its experts see the same tokens per step."""
import pytest
import torch

from tests.harness import run_distributed
from tests.model.gpt_layouts import dense_losses, global_batches, micro_batches, tiny_config

STEPS = 3
MOE = ("--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
       "--moe-shared-expert-intermediate-size", "64", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
       "--moe-layer-freq", "([0]*1+[1]*3)", "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
       "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights")


def _train(tp, pp, dp, cp, ep, extra, steps):
    import torch.distributed as dist

    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine

    config = tiny_config(tp, pp, dp, ("--expert-model-parallel-size", str(ep)) + tuple(extra), cp=cp)
    state.initialize(tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep)
    engine = Engine(config, with_scheduler=False)
    batches = global_batches(config, steps)
    data = micro_batches(config, batches, state.get_data_parallel_rank(), dp,
                         cp=(state.get_context_parallel_rank(), cp))
    stats = [engine.train_step(data) for _ in range(steps)]
    biases = {name: b.clone() for name, b in engine.module.named_buffers() if name.endswith("expert_bias")}
    return {"rank": dist.get_rank(), "losses": [s.loss for s in stats], "norms": [s.grad_norm for s in stats],
            "biases": biases, "coord": state.describe()}


def run_layout(tp, pp, dp, cp, ep, extra=(), steps=STEPS):
    return run_distributed(_train, tp * pp * dp * cp, tp, pp, dp, cp, ep, tuple(MOE) + tuple(extra), steps)


def dense_reference(extra=()):
    config = tiny_config(extra=MOE + tuple(extra))
    norms = []
    losses = dense_losses(config, global_batches(config, STEPS), micro_batch_size=config.batch.micro_batch_size,
                          norms=norms)
    return losses, norms


@pytest.fixture(scope="module")
def reference():
    return dense_reference()


def assert_matches(results, reference, tolerance=1e-5):
    losses, norms = reference
    for r in results:
        rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], losses))
        assert rel <= tolerance, f"rank {r['rank']} {r['coord']}: {r['losses']} vs dense {losses} (rel {rel:.2e})"
        if r["norms"][0] is not None:
            rel = max(abs(a - b) / abs(b) for a, b in zip(r["norms"], norms))
            assert rel <= 1e-4, f"rank {r['rank']} {r['coord']}: norms {r['norms']} vs dense {norms}"


@pytest.mark.parametrize("tp, pp, dp, cp, ep, extra", [
    (1, 1, 2, 1, 2, ()),
    (2, 1, 2, 1, 2, ("--sequence-parallel",)),
    (1, 2, 2, 1, 2, ("--zero-stage", "1")),
    (1, 1, 1, 2, 2, ()),
    (2, 2, 2, 1, 2, ()),
])
def test_moe_under_expert_parallelism_matches_the_dense_losses(tp, pp, dp, cp, ep, extra, reference):
    assert_matches(run_layout(tp, pp, dp, cp, ep, extra), reference)
