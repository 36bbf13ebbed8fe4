"""The planner and the memory estimate tool for a model with Multi-Token Prediction depths, end to end: every kept
layout's memory is the estimate with the depths on its last stage, its price counts the depths' FLOPs, their MoE
layer and their layer's communication, and DeepSeek-V3's last stage holds its MTP module."""
import json

from megatron_lite.arguments import parse_args
from megatron_lite.cost import memory, stages
from megatron_lite.cost.arithmetic import mtp_tensors
from megatron_lite.deepspeed_config import deepspeed_config
from megatron_lite.tuning import pricing, recipe
from tests.cost.test_mla_arithmetic import DEEPSEEK_V3
from tests.tuning.test_mla_plan import MLA_SMALL, _estimate_memory, _world

EXPERTS = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
           "--moe-shared-expert-intermediate-size", "64", "--moe-layer-freq", "([0]*1+[1]*1)"]
MTP_SMALL = MLA_SMALL + EXPERTS + ["--mtp-num-layers", "1"]
"""DeepSeek-V3 in small: MLA, a dense layer then one of 8 experts, one depth (an MoE layer, as the last)."""


def test_an_mtp_plan_estimates_and_prices_every_layout_with_its_depths_on_the_last_stage(tmp_path):
    p = recipe.plan(MTP_SMALL, workdir=str(tmp_path), nodes=1, gpus_per_node=8, gpu_memory_gb=80, max_micro_batch=1,
                    max_context_parallel=1)
    assert p.candidates and {c.pipeline_model_parallel_size for c in p.candidates} >= {1, 2}
    for c in p.candidates:
        config, _ = parse_args(c.pretrain_argv, world_size=_world(c))
        assert config.model.mtp_num_layers == 1
        estimated = memory.estimate(config, deepspeed_config(config))
        assert c.peak_bytes_per_stage == [st.peak for st in estimated]
        assert c.predicted_step_seconds > 0
        bounds = stages.stage_bounds(config, estimate=True)
        assert [len(n) for n in stages.stage_mtp_layer_numbers(config, bounds)][-1] == 1
        # The depth's MoE layer dispatches its tokens as the model's does, on the last stage.
        experts = pricing.expert_costs(config, bounds, 2)
        assert experts.stage_moe_layers[-1] == 1 + sum(n == 2 for n in stages.stage_layer_numbers(config, bounds)[-1])
    # The depth and its head GEMM cost the step: the same layouts without it price lower.
    plain = recipe.plan(MLA_SMALL + EXPERTS, workdir=str(tmp_path / "plain"), nodes=1, gpus_per_node=8,
                        gpu_memory_gb=80, max_micro_batch=1, max_context_parallel=1)
    without = {c.layout: c.predicted_step_seconds for c in plain.candidates}
    assert all(c.predicted_step_seconds > without[c.layout] for c in p.candidates if c.layout in without)


def test_estimate_memory_books_deepseek_v3s_mtp_module_and_its_embedding_copy_on_the_last_stage():
    """TP 1 x PP 16 x EP 64 on 2,048 GPUs with the one depth: the last stage holds its MoE layers, the depth (4 of
    its 256 experts on a rank, eh_proj 7168 x 14336), its final norm, its own copy of the embedding and the head."""
    layout = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "16",
              "--expert-model-parallel-size", "64", "--zero-stage", "1", "--global-batch-size", "1024"]
    argv = DEEPSEEK_V3 + ["--mtp-num-layers", "1"]
    code, out, err = _estimate_memory(*argv, *layout, "--world-size", "2048", "--json")
    assert code == 0, err
    rows = json.loads(out)
    config, _ = parse_args(argv + layout, world_size=2048)
    bounds = stages.stage_bounds(config, estimate=True)
    assert [r["parameters"] for r in rows] == stages.stage_parameters(config, bounds)
    h, v, attention, expert = 7168, 129280, 187_107_328, 3 * 2048 * 7168
    moe = attention + 2 * h + 256 * h + 4 * expert + expert
    depth = 3 * h + 2 * h * h + moe
    assert sum(mtp_tensors(config.model, 1, 64)) == depth
    last = len(stages.stage_layer_numbers(config, bounds)[-1])
    assert rows[-1]["parameters"] == last * moe + h + v * h + depth + v * h
    plain, _ = parse_args(DEEPSEEK_V3 + layout, world_size=2048)
    without = memory.estimate(plain, deepspeed_config(plain))[-1]
    assert rows[-1]["activations_per_micro_batch"] > without.activations_per_micro_batch
