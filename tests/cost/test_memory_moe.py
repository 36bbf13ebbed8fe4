"""The memory estimate of Mixture-of-Experts layers against what is measured: one layer's activations under
balanced routing at every layout (byte for byte), the bound on unbalanced routing, a pipeline's stages, and
the model states of real engines whose experts are split over expert parallelism."""
import json

import pytest

from megatron_lite.cost import activations, memory
from megatron_lite.cost import moe_activations
from megatron_lite.deepspeed_config import deepspeed_config
from tests.harness import run_distributed, shutdown_pools
from tests.model.gpt_layouts import tiny_config
from tests.model.test_llama_parallel import LLAMA

MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
       "--micro-batch-size", "2", "--global-batch-size", "8")
SHARED = ("--moe-shared-expert-intermediate-size", "32")
ROUTERS = {
    "gpt2": (),
    "top1": ("--moe-router-topk", "1"),
    "shared": SHARED,
    "gated_shared": SHARED + ("--moe-shared-expert-gate",),
    "pre_softmax": ("--moe-router-pre-softmax", "--moe-z-loss-coeff", "0.001"),
    "sigmoid_scaled": ("--moe-router-score-function", "sigmoid", "--moe-router-topk-scaling-factor", "2.5",
                       "--moe-aux-loss-coeff", "0.01"),
    "aux_and_z": ("--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"),
    "seq_aux": ("--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type", "seq_aux_loss"),
    "capacity": ("--moe-expert-capacity-factor", "0.5"),
    "groups": ("--num-experts", "8", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2"),
    "bf16": ("--bf16",),
    "llama_bf16": ("--bf16",) + LLAMA,
    "llama_bf16_shared_gated": ("--bf16",) + LLAMA + SHARED + ("--moe-shared-expert-gate", "--moe-aux-loss-coeff",
                                                              "0.01", "--moe-z-loss-coeff", "0.001"),
    "dropout": ("--hidden-dropout", "0.1", "--attention-dropout", "0.1"),
    "selective": ("--recompute-granularity", "selective"),
    "full": ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"),
    "gpt_oss": SHARED + ("--quick-geglu", "--glu-linear-offset", "1", "--activation-func-clamp-value", "7"),
}
"""Router scoring, losses, capacity, shared experts, precision and recompute; gpt-oss's clamped quick-GeGLU (routed
and shared experts keeping their inputs alone, model/activation.py) with the router's bias; every layer MoE."""


def _config(tp, dp, cp, ep, extra=()):
    return tiny_config(tp, 1, dp, MOE + ("--expert-model-parallel-size", str(ep)) + tuple(extra), cp=cp)


def _layer_census(tp, dp, cp, ep, rows, balanced=True):
    from megatron_lite.parallel import state
    from tests.cost.activation_census import forced_routing, saved_bytes_per_layer

    state.initialize(tp, 1, context_parallel_size=cp, expert_model_parallel_size=ep)
    with forced_routing(balanced):
        return [saved_bytes_per_layer(_config(tp, dp, cp, ep, extra)) for extra in rows]


LAYOUTS = {  # (TP, DP, CP, EP, router variants)
    "tp1": (1, 1, 1, 1, list(ROUTERS)),
    "tp2": (2, 1, 1, 1, ["gpt2", "gated_shared", "capacity", "gpt_oss"]),
    "tp2_sequence_parallel": (2, 1, 1, 1, ["gpt2", "sigmoid_scaled", "seq_aux", "llama_bf16_shared_gated"]),
    "ep2": (1, 2, 1, 2, ["gpt2", "capacity", "llama_bf16", "shared"]),
    "cp2_ep2": (1, 1, 2, 2, ["gpt2", "aux_and_z"]),
    "tp2_sequence_parallel_ep2": (2, 2, 1, 2, ["gpt2", "llama_bf16_shared_gated"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_moe_layers_activations_under_balanced_routing_match_the_estimate(layout):
    """What autograd keeps of one MoE layer, each expert getting T k / E copies from every rank: the router's
    fp32 scores, the dispatched rows and their order, the experts' inner activations, the combination and the
    shared expert, on every TP / SP / EP / CP rank."""
    tp, dp, cp, ep, names = LAYOUTS[layout]
    rows = [ROUTERS[name] for name in names]
    extra = ("--sequence-parallel",) if "sequence_parallel" in layout else ()
    rows = [extra + row for row in rows]
    measured = run_distributed(_layer_census, tp * dp * cp, tp, dp, cp, ep, rows)
    for name, row, *per_rank in zip(names, rows, *measured):
        want = activations.stage_layer_bytes(_config(tp, dp, cp, ep, row), 1, "cpu")[0]
        assert per_rank == [want] * len(per_rank), f"{layout} {name}: measured {per_rank}, estimate {want}"


def _moe_layer_with(config, received):
    """The layer's estimate with `received` routed copies on this rank's experts instead of the balanced count."""
    return (activations.stage_layer_bytes(config, 1, "cpu")[0] - moe_activations.moe_mlp_bytes(config, "cpu")
            + moe_activations.moe_mlp_bytes(config, "cpu", received=received))


def test_every_copy_on_one_ranks_experts_is_the_worst_case_the_estimate_bounds():
    """Every token routed to experts 0 and 1, both on EP rank 0: it receives T k x EP copies, the bound
    routed_copies gives, and keeps exactly the estimate with it; rank 1 receives none. At EP 1 the same
    routing keeps what balanced routing keeps (T k rows on the rank either way). With a capacity the
    bound holds (fewer copies are kept than balanced routing would send)."""
    rows = [(), ROUTERS["capacity"]]
    ep2 = run_distributed(_layer_census, 2, 1, 2, 1, 2, rows, False)
    dropless, capped = _config(1, 2, 1, 2), _config(1, 2, 1, 2, ROUTERS["capacity"])
    worst = moe_activations.routed_copies(dropless, worst_case=True)[1]
    assert worst == 2 * moe_activations.routed_copies(dropless)[1] == 2 * 2 * 64
    assert [rank[0] for rank in ep2] == [_moe_layer_with(dropless, worst), _moe_layer_with(dropless, 0)]
    assert ep2[0][1] <= _moe_layer_with(capped, moe_activations.routed_copies(capped, worst_case=True)[1])
    ep1 = run_distributed(_layer_census, 1, 1, 1, 1, 1, [()], False)[0]
    assert ep1 == [activations.stage_layer_bytes(_config(1, 1, 1, 1), 1, "cpu")[0]]


def _stage_census(extra):
    from tests.cost.activation_census import forced_routing, saved_bytes_per_stage

    with forced_routing():
        return saved_bytes_per_stage(tiny_config(1, 2, 1, MOE + tuple(extra)))


PIPELINE = ("--moe-layer-freq", "([0]*1+[1]*2+[0]*1)") + SHARED


@pytest.mark.parametrize("recompute", [(), ROUTERS["selective"],
                                       ("--recompute-granularity", "full", "--recompute-method", "block",
                                        "--recompute-num-layers", "1")])
def test_each_pipeline_stages_activations_count_its_own_moe_layers(recompute):
    """Layers 2 and 3 MoE, 1 and 4 dense, over two stages: each stage keeps its dense and MoE layers' own
    bytes (embedding, head and send included), as the estimate books them per micro-batch."""
    extra = PIPELINE + tuple(recompute)
    measured = run_distributed(_stage_census, 1, extra)[0]
    config = tiny_config(1, 2, 1, MOE + extra)
    stages = memory.estimate(config, deepspeed_config(config), device="cpu")
    assert measured == [st.activations_per_micro_batch for st in stages]


ENGINE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "256",
          "--moe-layer-freq", "([0]*1+[1]*3)", "--moe-shared-expert-intermediate-size", "128",
          "--global-batch-size", "4")
"""Hidden 128 (engine_census): experts of 256, three MoE layers, a shared expert; 1.3 M parameters, 0.8 M of
them the experts'."""


@pytest.mark.parametrize("ep, extra", [(2, ("--zero-stage", "1")), (1, ("--zero-stage", "1")),
                                       (2, ("--zero-stage", "1", "--bf16")), (2, ("--bf16",)),
                                       (2, ("--zero-stage", "1", "--bf16", "--optimizer", "muon"))],
                         ids=["ep2_zero1", "ep1_zero1", "ep2_zero1_bf16", "ep2_zero0_bf16", "ep2_zero1_bf16_muon"])
def test_model_states_of_an_engine_with_experts_over_ep_match_the_estimate(ep, extra, tmp_path):
    """DP 2: the dense parameters' optimizer states are split over 2 ranks, the experts' over DP / EP (ZeRO 1's
    and the bf16 optimizer's expert groups); each rank holds E / EP experts. Between steps the engine holds
    the model states (and the communication buffers, a few kB here); at fp32 ZeRO 1, stepping the expert group
    last, it also holds that group's fp32 gradient partition, the step's transient. Under --optimizer muon the
    matrices, the experts' included, keep one fp32 moment, not two."""
    from tests.cost.engine_census import engine_census

    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 2000}}))
    argv = ENGINE + ("--expert-model-parallel-size", str(ep)) + extra
    shutdown_pools()  # a fresh pool: no engine of an earlier test still holds memory
    results = run_distributed(engine_census, 2, 1, 1, 2, list(argv), str(ds_json))
    shutdown_pools()
    config = results[0]["config"]
    st = memory.estimate(config, {"zero_optimization": {"stage": config.parallel.zero_stage,
                                                        "reduce_bucket_size": 2000}}, device="cpu")[0]
    for r in results:
        assert r["between"] == pytest.approx(st.between_steps, rel=0.01), (r["rank"], r["between"], st)
        if config.precision.dtype_name == "fp32":
            assert r["bytes"] - r["between"] == pytest.approx(st.step_transient, rel=0.01), (r["rank"], st)
