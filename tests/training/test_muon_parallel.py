"""--optimizer muon gives the dense single-process losses under TP (with query groups shared by TP ranks), PP,
DP, ZeRO 1 and 2, SP and EP: each matrix is orthogonalised whole wherever its shards and partition fragments
lie. Orthogonalising each TP shard on its own (--muon-tp-mode blockwise) or the fused QKV as one matrix does
not, which shows the comparison can fail."""
import pytest

from tests.model.gpt_layouts import dense_losses, global_batches, tiny_config
from tests.model.test_gpt_parallel import run_layout
from tests.model.test_moe_parallel import MOE
from tests.model.test_moe_parallel import run_layout as run_moe_layout

STEPS = 5
MUON = ("--optimizer", "muon", "--lr", "1e-2")
LLAMA_MUON = ("--swiglu", "--normalization", "RMSNorm", "--group-query-attention", "--num-query-groups", "2",
              "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
              "--ffn-hidden-size", "96") + MUON
"""Llama's block with 2 key/value groups: at TP 4 two ranks share each group's K and V rows."""


def dense_reference(extra):
    config = tiny_config(extra=extra)
    return dense_losses(config, global_batches(config, STEPS), micro_batch_size=config.batch.micro_batch_size)


@pytest.fixture(scope="module")
def reference():
    return dense_reference(LLAMA_MUON)


def relative_difference(results, reference):
    return max(abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], reference))


@pytest.mark.parametrize("tp, pp, dp, zero, extra", [
    (2, 1, 1, 0, ()),
    (1, 2, 2, 1, ()),
    (2, 2, 2, 1, ()),
    (4, 1, 2, 1, ("--sequence-parallel",)),
    (1, 1, 2, 2, ()),
])
def test_muon_layouts_give_the_dense_fp32_losses(tp, pp, dp, zero, extra, reference):
    results = run_layout(tp, pp, dp, LLAMA_MUON + ("--zero-stage", str(zero)) + extra, steps=STEPS)
    assert relative_difference(results, reference) <= 1e-5, [r["losses"] for r in results] + [reference]


@pytest.mark.parametrize("wrong", [("--muon-tp-mode", "blockwise"), ("--muon-no-split-qkv",)])
def test_orthogonalising_shards_or_the_fused_qkv_whole_misses_the_dense_losses(wrong, reference):
    results = run_layout(2, 1, 1, LLAMA_MUON + wrong, steps=STEPS)
    assert relative_difference(results, reference) > 1e-4


def test_muon_on_experts_at_ep2_with_tp2_cp2_and_zero1_gives_the_dense_losses():
    """ZeRO 1 partitions the experts' group over expert-DP, the rest over DP x CP; ZeRO steps one group at a
    time (deepspeed_compat.optimizer_state.optimizer_partitions): keyed by group index, the expert group took the
    dense group's partition view and this missed by 1.7e-4."""
    reference = dense_reference(MOE + MUON)
    results = run_moe_layout(2, 1, 1, 2, 2, MUON + ("--zero-stage", "1"), steps=STEPS)
    assert relative_difference(results, reference) <= 1e-5, [r["losses"] for r in results] + [reference]


def _train_low_precision(tp, pp, dp, extra):
    """Losses, and the dtypes of Muon's momentum buffers, of a run whose precision flag is in `extra`."""
    from megatron_lite.deepspeed_compat import optimizer_state
    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine
    from tests.model.gpt_layouts import micro_batches
    from tests.model.test_moe_parallel import _fp16_on_cpu

    if "--fp16" in extra:
        _fp16_on_cpu()
    config = tiny_config(tp, pp, dp, extra)
    state.initialize(tp, pp)
    engine = Engine(config, with_scheduler=False)
    data = micro_batches(config, global_batches(config, STEPS), state.get_data_parallel_rank(), dp)
    losses = [engine.train_step(data).loss for _ in range(STEPS)]
    inner = optimizer_state.inner_optimizer(engine.optimizer)
    dtypes = {str(inner.state[t]["exp_avg"].dtype) for g in inner.param_groups if g.get("muon") for t in g["params"]}
    return {"losses": losses, "momentum": dtypes, "wrapper": type(engine.optimizer).__name__}


@pytest.mark.parametrize("tp, pp, dp, extra, wrapper", [
    (1, 2, 1, ("--bf16",), "BF16_Optimizer"),
    (1, 1, 2, ("--fp16", "--zero-stage", "1", "--initial-loss-scale", "1024"), "DeepSpeedZeroOptimizer"),
])
def test_muon_in_bf16_and_fp16_keeps_an_fp32_momentum_and_trains_near_the_fp32_dense_run(tp, pp, dp, extra, wrapper,
                                                                                         reference):
    from tests.harness import run_distributed

    result = run_distributed(_train_low_precision, tp * pp * dp, tp, pp, dp, LLAMA_MUON + extra)[0]
    assert result["wrapper"] == wrapper and result["momentum"] == {"torch.float32"}
    assert max(abs(a - b) / b for a, b in zip(result["losses"], reference)) <= 2e-2, (result["losses"], reference)


def test_muon_on_multi_latent_attention_at_tp2_with_sp_and_zero1_gives_the_dense_losses():
    """Kimi K2 trains MLA with Muon: the down projections, whole on every TP rank (their gradients summed over TP
    under SP), are orthogonalised as they are; the up projections, split by head, whole after the gather."""
    from tests.model.test_mla_parallel import MLA

    reference = dense_reference(MLA + MUON)
    results = run_layout(2, 1, 2, MLA + MUON + ("--zero-stage", "1", "--sequence-parallel"), steps=STEPS)
    assert relative_difference(results, reference) <= 1e-5, [r["losses"] for r in results] + [reference]
