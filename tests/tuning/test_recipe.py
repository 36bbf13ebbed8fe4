import json
import subprocess
import sys

import pytest

from megatron_lite.arguments import parse_args
from megatron_lite.cost import memory
from megatron_lite.deepspeed_config import deepspeed_config
from megatron_lite.tuning import plan_output, recipe
from tests.harness import REPO_ROOT

BIG = ["--num-layers", "104", "--hidden-size", "8192", "--num-attention-heads", "64", "--seq-length", "2048",
       "--vocab-size", "51200", "--bf16", "--hidden-dropout", "0", "--attention-dropout", "0",
       "--global-batch-size", "1024"]
SMALL = ["--num-layers", "2", "--hidden-size", "96", "--num-attention-heads", "12", "--seq-length", "64",
         "--vocab-size", "1000", "--global-batch-size", "16"]


def _plan(argv, tmp_path, **kw):
    kw.setdefault("max_micro_batch", 4)
    return recipe.plan(argv, workdir=str(tmp_path), **kw)


def _rejections(p, code):
    return {r["layout"] for r in p.rejected if r["reason_code"] == code}


def test_model_too_big_for_one_node_on_four_nodes_gets_tp8_pp2_with_sequence_parallelism_and_selective(tmp_path):
    # The fused softmax keeps the [b, a, s, s] probabilities per layer.
    fused = BIG + ["--attention-backend", "fused"]
    p = _plan(fused, tmp_path, nodes=4, gpus_per_node=8, gpu_memory_gb=80)
    first = p.candidates[0]
    # Sequence parallelism and selective recompute fit it on two stages; without them, it took four (TP 8 x PP 4).
    # (SP alone did, until issue 31's census booked the bf16 gradients BF16_Optimizer holds during a step.)
    assert (first.tensor_model_parallel_size, first.pipeline_model_parallel_size) == (8, 2)
    assert first.saver == "sequence parallel + selective recompute"
    assert first.micro_batch_size == 1 and first.gradient_accumulation_steps >= 32
    assert max(first.peak_bytes_per_stage) <= p.memory_budget_bytes
    assert "does_not_fit_memory" in {r["reason_code"] for r in p.rejected}
    # One node does not hold it without the slow savers (ZeRO 2/3, offload).
    one_node = _plan(fused, tmp_path, nodes=1, gpus_per_node=8, gpu_memory_gb=80, max_micro_batch=1)
    assert all(c.saver_tier == 2 for c in one_node.candidates)
    # SDPA's flash kernel (auto's choice on CUDA) keeps no s x s tensor: two stages need only sequence parallelism.
    flash = _plan(BIG, tmp_path, nodes=4, gpus_per_node=8, gpu_memory_gb=80, max_micro_batch=1).candidates[0]
    assert (flash.tensor_model_parallel_size, flash.pipeline_model_parallel_size, flash.saver) == (
        8, 2, "sequence parallel")


def test_rejections_name_their_reasons(tmp_path):
    p = _plan(SMALL, tmp_path, nodes=1, gpus_per_node=8, gpu_memory_gb=80)
    # 12 heads: TP 8 does not divide them
    assert {"tp8_cp1_pp1_dp1_mb1"} <= _rejections(p, "heads_not_divisible_by_tp")
    # 2 layers: 4 and 8 stages are too many
    assert {"tp1_cp1_pp4_dp2_mb1", "tp1_cp1_pp8_dp1_mb1", "tp2_cp1_pp4_dp1_mb1"} <= _rejections(
        p, "layers_fewer_than_stages")
    # global batch 16 with micro 4 x DP 8 = 32
    assert "tp1_cp1_pp1_dp8_mb4" in _rejections(p, "batch_not_divisible")
    table = plan_output.format_plan(p)
    assert "x heads not divisible by TP: tp8_cp1_pp1_dp1_mb1" in table and "x layers fewer than stages" in table
    kept = {c.layout for c in p.candidates}
    assert {"tp1_cp1_pp1_dp8_mb1", "tp2_cp1_pp2_dp2_mb2", "tp4_cp1_pp1_dp2_mb1"} <= kept
    assert not kept & {r["layout"] for r in p.rejected}
    first = p.candidates[0]
    # Shaden's order: TP as close to the GPUs per node as the heads allow (4), micro batch 1
    assert first.tensor_model_parallel_size == 4 and first.micro_batch_size == 1


def test_too_little_memory_rejects_everything_with_the_needed_bytes(tmp_path):
    p = _plan(SMALL, tmp_path, nodes=1, gpus_per_node=2, gpu_memory_gb=0.0001)
    assert not p.candidates
    assert all("does not fit" in r["reason"] and "GiB" in r["reason"] for r in p.rejected
               if r["reason_code"] == "does_not_fit_memory")


def test_memory_savers_are_tried_fastest_first_and_named(tmp_path):
    # Enough memory for the states but not for micro batch 4's activations at ZeRO 0: recompute saves it.
    loose = _plan(SMALL, tmp_path, nodes=1, gpus_per_node=2, gpu_memory_gb=80)
    assert all(c.saver == ("none" if c.context_parallel_size == 1 else f"context parallel {c.context_parallel_size}")
               and c.zero_stage == 0 for c in loose.candidates)
    c = next(c for c in loose.candidates if c.layout == "tp1_cp1_pp1_dp2_mb4")
    tight_gb = (max(c.peak_bytes_per_stage) - 1) / 2 ** 30 / 0.9
    tight = _plan(SMALL, tmp_path, nodes=1, gpus_per_node=2, gpu_memory_gb=tight_gb)
    saved = next(x for x in tight.candidates if x.layout == "tp1_cp1_pp1_dp2_mb4")
    assert saved.saver != "none" and max(saved.peak_bytes_per_stage) < max(c.peak_bytes_per_stage)
    assert saved.saver_order > 0


# Sequence 2048, hidden 256: activations outweigh the weights, as in large-model training.
LONG = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "2048",
        "--vocab-size", "1000", "--global-batch-size", "64", "--bf16"]


def _peak(argv, tp, pp, dp, micro, *extra, cp=1):
    """The estimated peak (GiB) of the layout at ZeRO 0 (unless extra says otherwise), on a GPU."""
    config, _ = parse_args(argv + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                                   "--context-parallel-size", str(cp), "--micro-batch-size", str(micro), *extra],
                           world_size=tp * cp * pp * dp)
    return max(st.peak for st in memory.estimate(config, deepspeed_config(config))) / 2 ** 30


@pytest.mark.parametrize("backend, tp, saver", [("sdpa", 2, "sequence parallel"), ("fused", 1, "selective recompute")])
def test_a_layout_that_fits_by_sequence_parallelism_or_selective_recompute_ranks_above_one_recomputing_layers(
        backend, tp, saver, tmp_path):
    argv = LONG + ["--attention-backend", backend]
    cheap = ("--sequence-parallel",) if tp > 1 else ("--recompute-granularity", "selective")
    # The budget lies between what tp x pp2 x mb4 and tp x pp1 x mb4 need with the cheap saver: the first fits
    # with it, the second must recompute layers too.
    fits, tight = _peak(argv, tp, 2, 2 // tp, 4, *cheap), _peak(argv, tp, 1, 4 // tp, 4, *cheap)
    assert fits < tight
    assert _peak(argv, tp, 2, 2 // tp, 4) > (fits + tight) / 2, "without the saver it would not fit"
    p = _plan(argv, tmp_path, nodes=2, gpus_per_node=2, gpu_memory_gb=(fits + tight) / 2 / 0.9)
    by_layout = {c.layout: c for c in p.candidates}
    cheap_fit = by_layout[f"tp{tp}_cp1_pp2_dp{2 // tp}_mb4"]
    recomputed = by_layout[f"tp{tp}_cp1_pp1_dp{4 // tp}_mb4"]
    assert cheap_fit.saver == saver and cheap_fit.saver_tier == 0
    assert recompute_needed(recomputed)
    assert cheap_fit.rank < recomputed.rank, "it ranks higher although it has twice the stages"


def recompute_needed(c):
    return c.saver_tier == 1 and c.recompute_granularity == "full"


def _world(c):
    return (c.tensor_model_parallel_size * c.context_parallel_size * c.pipeline_model_parallel_size
            * c.data_parallel_size)


def test_every_kept_candidates_command_line_passes_pretrain_validation_with_its_layout(tmp_path):
    p = _plan(SMALL + ["--zero-stage", "1", "--lr", "3e-4"], tmp_path, nodes=1, gpus_per_node=8, gpu_memory_gb=80)
    for c in p.candidates:
        world = _world(c)
        config, _ = parse_args(c.pretrain_argv, world_size=world)
        assert config.batch.gradient_accumulation_steps == c.gradient_accumulation_steps
        assert config.parallel.tensor_model_parallel_size == c.tensor_model_parallel_size
        assert config.parallel.context_parallel_size == c.context_parallel_size
        assert config.parallel.data_parallel_size == c.data_parallel_size
        assert config.parallel.zero_stage == c.zero_stage and config.batch.micro_batch_size == c.micro_batch_size
        assert config.optimizer.lr == 3e-4 and config.model.num_attention_heads == 12
        assert c.pretrain_argv[-len(c.argv):] == c.argv


def test_plan_says_it_replaces_the_users_zero_stage(tmp_path):
    p = _plan(SMALL + ["--zero-stage", "1"], tmp_path, nodes=1, gpus_per_node=2, gpu_memory_gb=80)
    assert any("your --zero-stage 1 is replaced" in note for note in p.notes)
    assert {c.zero_stage for c in p.candidates} == {0}  # the fastest saver that fits, not the user's 1
    assert "note: your --zero-stage 1 is replaced" in plan_output.format_plan(p)
    assert not _plan(SMALL, tmp_path, nodes=1, gpus_per_node=2, gpu_memory_gb=80).notes


def test_micro_batch_probe_uses_one_node_few_layers_and_micro_batches_to_64(tmp_path):
    p = _plan(BIG, tmp_path, nodes=4, gpus_per_node=8, gpu_memory_gb=80, micro_batch_probe=True)
    assert p.mode == "micro-batch-probe"
    assert all(c.pretrain_argv[c.pretrain_argv.index("--num-layers") + 1] == "2" for c in p.candidates)
    assert all(c.pipeline_model_parallel_size == 1 and c.gradient_accumulation_steps == 1 for c in p.candidates)
    assert all(_world(c) == 8 for c in p.candidates)
    assert 64 in {c.micro_batch_size for c in p.candidates} | {r["micro_batch_size"] for r in p.rejected}


def test_plan_cli_writes_json_and_refuses_unknown_flags(tmp_path):
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "tools/tune_parallelism.py", "plan", "--nodes", "1", "--gpus-per-node", "2",
           "--gpu-memory-gb", "80", *SMALL, "--output", str(out)]
    r = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["candidates"] and data["candidates"][0]["rank"] == 1 and "plan:" in r.stdout
    bad = subprocess.run(cmd[:-2] + ["--num-layer", "3"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--num-layer" in bad.stderr and "Traceback" not in bad.stderr


def test_tune_parallelism_help_exits_0_and_lists_the_commands():
    r = subprocess.run([sys.executable, "tools/tune_parallelism.py", "--help"], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "commands: calibrate | plan | sweep | report" in r.stdout, r.stderr


def test_estimate_memory_refuses_a_negative_gpu_memory_naming_the_flag():
    r = subprocess.run([sys.executable, "tools/estimate_memory.py", "--world-size", "1", "--vocab-size", "128",
                        "--gpu-memory-gb", "-1"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "argument --gpu-memory-gb: must be more than 0, got -1; e.g. 80" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


# The Llama block with 2 key/value groups for 12 heads of 16: TP 1 and 2 hold whole groups, TP 4 shares each
# group between 2 ranks (each keeps half of its K/V rows); TP 3 neither divides nor is divided by 2 groups,
# and at TP 6 and 12 a group's 16 rows do not split into 3 or 6 equal pieces.
LLAMA_SMALL = ["--num-layers", "2", "--hidden-size", "192", "--num-attention-heads", "12", "--group-query-attention",
               "--num-query-groups", "2", "--swiglu", "--ffn-hidden-size", "96", "--normalization", "RMSNorm",
               "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
               "--seq-length", "48", "--vocab-size", "1000", "--global-batch-size", "24", "--bf16"]


def test_llama_plan_with_2_query_groups_proposes_tp4_and_no_tp_that_validation_refuses(tmp_path):
    p = _plan(LLAMA_SMALL, tmp_path, nodes=1, gpus_per_node=12, gpu_memory_gb=80)
    assert {c.tensor_model_parallel_size for c in p.candidates} == {1, 2, 4}
    refused = {r["tensor_model_parallel_size"] for r in p.rejected
               if r["reason_code"] == "groups_not_compatible_with_tp"}
    assert refused == {3, 6, 12}
    assert "x query groups neither divide nor are divided by TP" in plan_output.format_plan(p)
    for c in p.candidates:  # what pretrain_gpt.py would be given: it validates
        world = _world(c)
        config, _ = parse_args(c.pretrain_argv, world_size=world)
        assert config.model.num_query_groups == 2 and config.model.swiglu
        # Memory through the same estimate as tools/estimate_memory.py, for the Llama block.
        assert c.peak_bytes_per_stage == [st.peak for st in memory.estimate(config, deepspeed_config(config))]
    first = p.candidates[0]
    assert first.tensor_model_parallel_size == 4, "Shaden's order: the TP nearest the GPUs per node that validates"
    assert plan_output.first_choice_reason(p).startswith(f"{first.layout}: gas ")


def test_plan_tries_context_parallelism_up_to_the_heads_per_tp_rank_and_names_the_cps_it_refuses(tmp_path):
    """12 heads, 2 key/value groups, 8 GPUs: CP 1, 2, 4, 8 at TP 1 (8 refused: 12 heads do not split into 8),
    1, 2, 4 at TP 2 (4 refused: 6 heads per TP rank) and 1, 2 at TP 4 (2 refused: 3 heads); at TP 1 CP 4
    repeats the 2 groups to 4. Every kept CP candidate launches TP x CP x PP x DP ranks and validates."""
    p = _plan(LLAMA_SMALL, tmp_path, nodes=1, gpus_per_node=8, gpu_memory_gb=80, max_micro_batch=1)
    kept = {(c.tensor_model_parallel_size, c.context_parallel_size) for c in p.candidates}
    assert {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)} <= kept
    refused = {(r["tensor_model_parallel_size"], r["context_parallel_size"]) for r in p.rejected
               if r["reason_code"] == "heads_not_divisible_by_cp"}
    assert refused == {(1, 8), (2, 4), (4, 2)}
    assert "tp1_cp8_pp1_dp1_mb1" in _rejections(p, "heads_not_divisible_by_cp")
    assert "x heads per TP rank not divisible by CP: " in plan_output.format_plan(p)
    for c in p.candidates:
        if c.context_parallel_size == 1:
            continue
        config, _ = parse_args(c.pretrain_argv, world_size=_world(c))
        flag = c.pretrain_argv.index("--context-parallel-size")
        assert c.pretrain_argv[flag + 1] == str(c.context_parallel_size) and flag >= len(c.pretrain_argv) - len(c.argv)
        assert config.parallel.data_parallel_size == c.data_parallel_size
        assert c.saver.startswith(f"context parallel {c.context_parallel_size}") and c.saver_tier < 2
        assert c.peak_bytes_per_stage == [st.peak for st in memory.estimate(config, deepspeed_config(config))]
    no_cp = _plan(LLAMA_SMALL, tmp_path, nodes=1, gpus_per_node=8, gpu_memory_gb=80, max_micro_batch=1,
                  max_context_parallel=1)
    assert {c.context_parallel_size for c in no_cp.candidates} == {1}


def test_a_layout_that_fits_by_context_parallelism_ranks_above_one_recomputing_layers(tmp_path):
    """LONG on 2 GPUs at micro batch 4: the budget fits TP 1 x CP 2 with nothing else, while TP 1 x DP 2
    (CP 1) must recompute whole layers. CP costs two all-to-alls per layer and direction, no compute, so
    it ranks above, as sequence parallelism and selective recompute do."""
    argv = LONG + ["--attention-backend", "sdpa"]
    cp2 = _peak(argv, 1, 1, 1, 4, cp=2)
    cheapest_cp1 = min(_peak(argv, 1, 1, 2, 4, "--recompute-granularity", "selective", *zero)
                       for zero in ((), ("--zero-stage", "1")))
    assert cp2 < cheapest_cp1
    p = _plan(argv, tmp_path, nodes=1, gpus_per_node=2, gpu_memory_gb=(cp2 + cheapest_cp1) / 2 / 0.9)
    by_layout = {c.layout: c for c in p.candidates}
    split, recomputed = by_layout["tp1_cp2_pp1_dp1_mb4"], by_layout["tp1_cp1_pp1_dp2_mb4"]
    assert split.saver == "context parallel 2" and split.saver_tier == 0
    assert recompute_needed(recomputed)
    assert split.rank < recomputed.rank


def test_a_muon_plan_books_one_moment_per_matrix_and_prices_the_newton_schulz_work(tmp_path):
    """SMALL planned with --optimizer muon: each layer's four matrices (QKV, projection, the MLP's two: 12 h^2)
    keep 4 bytes of optimizer state per value on a rank less than AdamW's two moments, and a TP 1 step at fp32
    ZeRO 0 (no partitions to assemble, nothing to gather) adds Newton-Schulz on Q, K, V, the projection
    (h x h each) and the MLP's two (h x 4h): k = 5 iterations of 4 m^2 n + 2 m^3 FLOPs at the fp32 rate."""
    adam = {c.name: c for c in _plan(SMALL, tmp_path, nodes=1, gpus_per_node=2, gpu_memory_gb=80).candidates}
    muon = {c.name: c for c in _plan(SMALL + ["--optimizer", "muon"], tmp_path, nodes=1, gpus_per_node=2,
                                     gpu_memory_gb=80).candidates}
    assert muon.keys() == adam.keys()
    h, layers = 96, 2
    single = [name for name, c in muon.items() if c.pipeline_model_parallel_size == 1]
    assert single
    for name in single:
        c, a = muon[name], adam[name]
        tp, dp, zero = c.tensor_model_parallel_size, c.data_parallel_size, c.zero_stage
        saved = 4 * layers * 12 * h * h // tp // (dp if zero else 1)
        assert a.stage_memory[0]["optimizer_states"] - c.stage_memory[0]["optimizer_states"] == saved, name
    ns = lambda m, n: 5 * (4 * m * m * n + 2 * m ** 3)  # noqa: E731
    flops = layers * (4 * ns(h, h) + 2 * ns(h, 4 * h))
    hw = recipe.Hardware(gpus_per_node=2)
    rate = hw.fp32_tflops * 1e12 * h / (h + 256.0)  # throughput.gemm_efficiency at m = h rows
    name = next(n for n in single if muon[n].tensor_model_parallel_size == 1 and muon[n].zero_stage == 0)
    assert muon[name].predicted_step_seconds - adam[name].predicted_step_seconds == pytest.approx(flops / rate)


def test_at_pp2_the_plan_keeps_dualpipev_where_its_bubble_wins_and_1f1b_where_rank_0_would_hold_both_heavy_ends(
        tmp_path):
    def pp2(vocab, layers):
        argv = ["--num-layers", str(layers), "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length",
                "128", "--vocab-size", str(vocab), "--global-batch-size", "4"]
        p = _plan(argv, tmp_path, nodes=1, gpus_per_node=2, gpu_memory_gb=16, max_micro_batch=1, device="cpu")
        return next(c for c in p.candidates if c.pipeline_model_parallel_size == 2)

    # Balanced stages at gas 4 = 2 x PP: the V's bubble (4 of 28 forward units) beats 1F1B's (6 of 30).
    v = pp2(512, 8)
    assert v.pipeline_schedule == "dualpipev" and v.layout.endswith("_dualpipev")
    assert v.predicted_step_seconds < v.predicted_parts["1f1b_step_seconds"]
    assert v.argv[-2:] == ["--pipeline-schedule", "dualpipev"]
    config = parse_args(v.pretrain_argv, world_size=2)[0]
    assert config.parallel.pipeline_schedule == "dualpipev" and config.batch.gradient_accumulation_steps == 4
    # A head of two layers' cost: under dualpipev rank 0 would hold it, the embedding and two layers.
    one = pp2(6400, 4)
    assert one.pipeline_schedule == "1f1b" and "--pipeline-schedule" not in one.argv
    assert one.predicted_parts["dualpipev_step_seconds"] > 1.2 * one.predicted_step_seconds
