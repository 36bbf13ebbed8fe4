"""The planner for Mixture-of-Experts models: expert parallelism (EP, out of DP x CP) among the layouts, the memory
estimate per EP, and the price of the expert all-to-alls in the predicted step, from the constants or a profile."""
import pytest

from megatron_lite.arguments import parse_args
from megatron_lite.cost import memory
from megatron_lite.deepspeed_config import deepspeed_config
from megatron_lite.tuning import calibration, plan_output, pricing, recipe
from megatron_lite.tuning.throughput import Experts, Hardware, predict_step_seconds

MIXTRAL_DENSE = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
                 "--group-query-attention", "--num-query-groups", "8", "--swiglu", "--ffn-hidden-size", "14336",
                 "--normalization", "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                 "--position-embedding-type", "rope", "--seq-length", "4096", "--vocab-size", "32000", "--bf16",
                 "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "256"]
MIXTRAL_8X7B = MIXTRAL_DENSE + ["--num-experts", "8", "--moe-router-topk", "2"]


def _plan(argv, tmp_path, **kw):
    # Micro batch 1 and no CP: the layouts EP is about, in 2-3 s of the 2-core VM rather than 20.
    kw = dict(dict(nodes=4, gpus_per_node=8, gpu_memory_gb=80, max_micro_batch=1, max_context_parallel=1), **kw)
    return recipe.plan(argv, workdir=str(tmp_path), **kw)


def _world(c):
    return (c.tensor_model_parallel_size * c.context_parallel_size * c.pipeline_model_parallel_size
            * c.data_parallel_size)


def _peak_gib(argv, tp, pp, ep, world=32):
    config, _ = parse_args(argv + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                                   "--expert-model-parallel-size", str(ep), "--micro-batch-size", "1"],
                           world_size=world)
    return max(st.peak for st in memory.estimate(config, deepspeed_config(config))) / 2 ** 30


def test_mixtral_8x7b_on_four_nodes_gets_an_expert_parallel_layout_and_the_dense_model_of_its_shape_none(tmp_path):
    p = _plan(MIXTRAL_8X7B, tmp_path)
    first = p.candidates[0]
    ep, tp = first.expert_model_parallel_size, first.tensor_model_parallel_size
    # TP x EP fills a node (both groups on NVLink), EP before TP: TP 4 x EP 2 is the one that fits on one stage.
    assert (tp, ep, first.pipeline_model_parallel_size) == (4, 2, 1), first.layout
    assert first.layout == "tp4_cp1_pp1_dp8_ep2_mb1"
    assert "tp4_cp1_pp1_dp8_mb1" in {r["layout"] for r in p.rejected if r["reason_code"] == "does_not_fit_memory"}
    assert "TP 4 x EP 2 = GPUs per node" in plan_output.first_choice_reason(p)
    # Every EP divides DP x CP and the 8 experts; every degree that does is tried.
    assert all(c.data_parallel_size * c.context_parallel_size % c.expert_model_parallel_size == 0
               and 8 % c.expert_model_parallel_size == 0 for c in p.candidates)
    assert {c.expert_model_parallel_size for c in p.candidates} == {1, 2, 4, 8}
    # Its command line carries the EP and validates; its memory is the MoE estimate at that EP.
    flag = first.argv.index("--expert-model-parallel-size")
    assert first.argv[flag + 1] == "2"
    config, _ = parse_args(first.pretrain_argv, world_size=_world(first))
    assert config.parallel.expert_model_parallel_size == 2 and config.model.num_experts == 8
    assert first.peak_bytes_per_stage == [st.peak for st in memory.estimate(config, deepspeed_config(config))]
    # The all-to-alls are priced where experts are split, and nowhere else.
    assert all((c.predicted_ep_comm_seconds > 0) == (c.expert_model_parallel_size > 1) for c in p.candidates)
    table = plan_output.format_plan(p, limit=3)
    assert " EP " in table.splitlines()[0] and "a2a %" in table.splitlines()[0]
    dense = _plan(MIXTRAL_DENSE, tmp_path)
    assert dense.candidates and {c.expert_model_parallel_size for c in dense.candidates} == {1}
    assert not any("_ep" in c.layout or "--expert-model-parallel-size" in c.pretrain_argv for c in dense.candidates)
    assert " EP " not in plan_output.format_plan(dense).splitlines()[0]


def test_expert_parallelism_shrinks_the_memory_estimate_of_a_stage():
    """E/EP experts per rank, their optimizer states over DP / EP: TP 4 x PP 1 needs EP 2 to fit 72 GiB."""
    peaks = [_peak_gib(MIXTRAL_8X7B, 4, 1, ep) for ep in (1, 2, 4, 8)]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > 80 > peaks[1]


def test_max_expert_parallel_1_plans_an_moe_model_without_expert_parallelism(tmp_path):
    p = _plan(MOE, tmp_path, nodes=1, gpus_per_node=4, max_expert_parallel=1)
    assert {c.expert_model_parallel_size for c in p.candidates} == {1}


HW = Hardware(gpus_per_node=8, peak_tflops=100.0, intra_node_gbps=100.0, inter_node_gbps=10.0)
R = 2e8  # bytes of one dispatch all-to-all on a rank


def _experts(ep, moe_layers=4, recomputed=0, rows=R, parameters=0):
    return Experts(ep=ep, stage_moe_layers=[moe_layers], stage_recomputed_moe_layers=[recomputed],
                   all_to_all_bytes=rows, stage_parameters=[parameters], layer_flops_per_token=1e8,
                   rows_per_expert=4096.0)


def _step(ep, tp=1, profile=None, dp=8, **kw):
    return predict_step_seconds([1e9], [4], [10 ** 8], HW, hidden=1024, seq=4096, tp=tp, pp=1, dp=dp, micro=1,
                                gas=1, zero_stage=0, recompute_flops=[0.0], cpu_offload=False,
                                experts=_experts(ep, **kw), profile=profile, bytes_per_value=2)


@pytest.mark.parametrize("tp, ep, gbps", [(1, 2, 100.0), (1, 4, 100.0), (1, 8, 100.0), (2, 4, 100.0), (2, 8, 10.0),
                                          (8, 2, 10.0)])
def test_expert_all_to_alls_cost_four_per_moe_layer_the_share_leaving_the_rank_over_the_link_tp_x_ep_spans(
        tp, ep, gbps):
    """Dispatch and combine, forward and backward; (EP-1)/EP of each rank's rows leave it; NVLink while the
    TP x EP consecutive ranks of the group fit a node, the network beyond."""
    expected = 4 * 4 * (ep - 1) / ep * R / (gbps * 1e9)  # 4 MoE layers
    assert _step(ep, tp)["ep_comm_seconds"] == pytest.approx(expected)
    assert _step(ep, tp)["stage_seconds"] - _step(ep, tp, rows=0)["stage_seconds"] == pytest.approx(expected)
    assert _step(1, tp)["ep_comm_seconds"] == 0.0


def test_full_recompute_runs_the_forward_expert_all_to_alls_again():
    forward = 2 * (2 - 1) / 2 * R / 100e9  # one MoE layer's dispatch and combine at EP 2
    assert _step(2, recomputed=4)["ep_comm_seconds"] - _step(2)["ep_comm_seconds"] == pytest.approx(4 * forward)


def test_expert_gradients_are_reduced_over_the_ranks_holding_the_same_experts():
    """10^8 parameters of which 8 x 10^7 experts' at DP 8: at EP 8 only the 2 x 10^7 others cross ranks."""
    dense = _step(1, dp=8, parameters=0)["dp_comm_seconds"]
    assert _step(8, dp=8, parameters=8 * 10 ** 7)["dp_comm_seconds"] == pytest.approx(dense * 0.2)
    assert _step(2, dp=8, parameters=8 * 10 ** 7)["dp_comm_seconds"] == pytest.approx(
        dense * 0.2 + 2 * 3 / 4 * 8e7 * 2 / 100e9)  # the experts over 4 ranks


def _profile(device="cpu", all_to_all_gbps=1.0, groups=(2, 4, 8)):
    fit = calibration.LinkFit(1e-4, 5.0, [4096, 65536], [1e-4, 1e-4])
    a2a = calibration.LinkFit(2e-4, all_to_all_gbps, [4096, 65536], [2e-4, 2e-4])
    collectives = {name: {g: a2a if name == "all_to_all" else fit for g in groups}
                   for name in calibration.COLLECTIVES}
    return calibration.Profile(device, "x", "gloo", "2", "now", "float32", 1,
                               [calibration.GemmPoint(128, 8, 8, 1e10), calibration.GemmPoint(4096, 8, 8, 2e10)],
                               10.0, collectives)


def test_with_a_profile_the_expert_all_to_alls_are_its_all_to_all_fit_at_the_ep_group():
    """4 MoE layers: 16 all-to-alls of R bytes and 20 messages (the row counts before each forward dispatch)."""
    for ep in (2, 4, 8):
        expected = 20 * 2e-4 + 16 * R / 1e9  # measured at this group: its bandwidth has the (EP-1)/EP share in it
        assert _step(ep, profile=_profile())["ep_comm_seconds"] == pytest.approx(expected)
    # Halving the measured bandwidth doubles the bytes' part.
    slow = _step(4, profile=_profile(all_to_all_gbps=0.5))["ep_comm_seconds"]
    assert slow - _step(4, profile=_profile())["ep_comm_seconds"] == pytest.approx(16 * R / 1e9)
    # A group the profile did not measure: scaled from the nearest by the share leaving a rank, (g-1)/g.
    only_2 = _profile(groups=(2,))
    at = {ep: _step(ep, profile=only_2)["ep_comm_seconds"] - 20 * 2e-4 * (ep - 1) for ep in (2, 4, 8)}
    assert at[4] / at[2] == pytest.approx((3 / 4) / (1 / 2)) and at[8] / at[2] == pytest.approx((7 / 8) / (1 / 2))


MOE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
       "--vocab-size", "256", "--make-vocab-size-divisible-by", "16", "--hidden-dropout", "0",
       "--attention-dropout", "0", "--global-batch-size", "8", "--num-experts", "4", "--moe-router-topk", "2"]


def test_a_plan_with_a_profile_prices_its_expert_parallel_layouts_by_the_profiles_all_to_all(tmp_path):
    kw = dict(nodes=1, gpus_per_node=4, device="cpu", order="throughput")
    fast = {c.layout: c for c in _plan(MOE, tmp_path, profile=_profile(all_to_all_gbps=1.0), **kw).candidates}
    slow = {c.layout: c for c in _plan(MOE, tmp_path, profile=_profile(all_to_all_gbps=0.25), **kw).candidates}
    assert fast.keys() == slow.keys() and {c.expert_model_parallel_size for c in fast.values()} == {1, 2, 4}
    for layout, c in fast.items():
        assert c.predicted_from == "profile"
        extra = slow[layout].predicted_step_seconds - c.predicted_step_seconds
        if c.expert_model_parallel_size == 1:
            assert extra == 0.0 and c.predicted_ep_comm_seconds == 0.0
            continue
        assert slow[layout].predicted_ep_comm_seconds > c.predicted_ep_comm_seconds > 0 and extra > 0
        if c.pipeline_model_parallel_size == 1:
            # 4 MoE layers x 4 all-to-alls x gas micro-batches of R = T k h x 4 bytes (fp32), at 1/4 the bandwidth.
            rows = c.micro_batch_size * 32 * 2 * 64 * 4
            assert extra == pytest.approx(c.gradient_accumulation_steps * 4 * 4 * rows * (1 / 0.25e9 - 1 / 1e9))


def test_expert_costs_count_each_stages_moe_layers_and_those_full_recompute_runs_again():
    """--moe-layer-freq ([0]*1+[1]*3) at PP 2, recomputing one layer per stage (block): stage 0 holds layers 1-2 and
    recomputes the dense layer 1, stage 1 holds 3-4 and recomputes the MoE layer 3."""
    argv = MOE + ["--moe-layer-freq", "([0]*1+[1]*3)", "--pipeline-model-parallel-size", "2",
                  "--pipeline-partition-method", "uniform", "--recompute-granularity", "full",
                  "--recompute-method", "block", "--recompute-num-layers", "1", "--expert-model-parallel-size", "2"]
    config, _ = parse_args(argv, world_size=4)
    from megatron_lite.cost.stages import stage_bounds

    experts = pricing.expert_costs(config, stage_bounds(config, estimate=True), bytes_per_value=4)
    assert experts.ep == 2 and list(experts.stage_moe_layers) == [1, 2]
    assert list(experts.stage_recomputed_moe_layers) == [0, 1]
    assert experts.all_to_all_bytes == 32 * 2 * 64 * 4  # T k h x 4 bytes, micro batch 1
    assert experts.rows_per_expert == 2 * 32 * 2 / 4  # EP x T k / E
    dense, _ = parse_args(MOE[:-4], world_size=1)
    assert pricing.expert_costs(dense, stage_bounds(dense, estimate=True), bytes_per_value=4) is None


def test_the_micro_batch_probe_cuts_a_layer_pattern_with_the_layers(tmp_path):
    # The probe trains the model's first layers only: a one-entry-per-layer --moe-layer-freq must shrink with them.
    argv = MIXTRAL_8X7B + ["--moe-layer-freq", "([0]*1+[1]*31)"]
    p = _plan(argv, tmp_path, nodes=1, micro_batch_probe=True, max_micro_batch=2)
    assert p.mode == "micro-batch-probe" and p.candidates
    assert not [r for r in p.rejected if "--moe-layer-freq" in str(r)], p.rejected[:2]
