"""The planner and the memory estimate tool for a Multi-head Latent Attention model: the layouts MLA allows (heads
split whole over TP, then over CP), each priced and estimated with MLA's own counts, end to end."""
import importlib.util
import io
import json
import os
from contextlib import redirect_stderr, redirect_stdout

from megatron_lite.arguments import parse_args
from megatron_lite.cost import memory, stages
from megatron_lite.deepspeed_config import deepspeed_config
from megatron_lite.tuning import recipe
from tests.cost.test_mla_arithmetic import DEEPSEEK_V3
from tests.harness import REPO_ROOT

MLA_SMALL = ["--num-layers", "2", "--hidden-size", "192", "--num-attention-heads", "12", "--multi-latent-attention",
             "--q-lora-rank", "48", "--kv-lora-rank", "32", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
             "--v-head-dim", "16", "--qk-layernorm", "--swiglu", "--ffn-hidden-size", "96", "--normalization",
             "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--position-embedding-type",
             "rope", "--seq-length", "48", "--vocab-size", "1000", "--global-batch-size", "24", "--bf16"]
"""12 heads of 16 + 8 (queries, keys) and 16 (values), latents of 48 and 32."""


def _world(c):
    return (c.tensor_model_parallel_size * c.context_parallel_size * c.pipeline_model_parallel_size
            * c.data_parallel_size)


def test_an_mla_plan_splits_whole_heads_over_tp_and_cp_and_prices_each_layout_with_mlas_costs(tmp_path):
    """8 GPUs: TP 1, 2, 4 (8 refused: 12 heads), CP up to the heads per TP rank (CP 8 at TP 1, 4 at TP 2 and 2
    at TP 4 refused); every kept candidate's command line validates, its memory is the MLA estimate of that
    layout, and it is priced (a predicted step)."""
    p = recipe.plan(MLA_SMALL, workdir=str(tmp_path), nodes=1, gpus_per_node=8, gpu_memory_gb=80, max_micro_batch=1)
    kept = {(c.tensor_model_parallel_size, c.context_parallel_size) for c in p.candidates}
    assert kept == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)}
    refused = {(r["tensor_model_parallel_size"], r["context_parallel_size"], r["reason_code"]) for r in p.rejected
               if r["reason_code"].startswith("heads_")}
    assert refused == {(8, 1, "heads_not_divisible_by_tp"), (1, 8, "heads_not_divisible_by_cp"),
                       (2, 4, "heads_not_divisible_by_cp"), (4, 2, "heads_not_divisible_by_cp")}
    for c in p.candidates:
        config, _ = parse_args(c.pretrain_argv, world_size=_world(c))
        assert config.model.multi_latent_attention and config.model.q_lora_rank == 48
        assert c.peak_bytes_per_stage == [st.peak for st in memory.estimate(config, deepspeed_config(config))]
        assert c.predicted_step_seconds > 0 and c.predicted_pipeline_efficiency > 0


def _estimate_memory(*argv):
    """tools/estimate_memory.py's exit code, output and errors, its main run in this process."""
    spec = importlib.util.spec_from_file_location("estimate_memory", os.path.join(REPO_ROOT, "tools",
                                                                                  "estimate_memory.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = tool.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_estimate_memory_books_deepseek_v3s_stages_with_their_latent_attention_and_experts():
    """TP 1 x PP 16 x EP 64 on 2,048 GPUs: stage 0 holds the embedding, the 3 dense layers and the first MoE layer,
    stages 1-14 four MoE layers each, 4 of the 256 experts per layer on a rank (MLA's 187,107,328 parameters per
    layer, counted from Hugging Face's shapes in tests/cost/test_mla_arithmetic.py)."""
    layout = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "16",
              "--expert-model-parallel-size", "64", "--zero-stage", "1", "--global-batch-size", "1024"]
    code, out, err = _estimate_memory(*DEEPSEEK_V3, *layout, "--world-size", "2048", "--json")
    assert code == 0, err
    rows = json.loads(out)
    h, attention, expert = 7168, 187_107_328, 3 * 2048 * 7168
    dense = attention + 2 * h + 3 * 18432 * h
    moe = attention + 2 * h + 256 * h + 4 * expert + expert
    assert [r["parameters"] for r in rows[:2]] == [129280 * h + 3 * dense + moe, 4 * moe]
    config, _ = parse_args(list(DEEPSEEK_V3) + layout, world_size=2048)
    assert [r["parameters"] for r in rows] == stages.stage_parameters(config, stages.stage_bounds(config,
                                                                                                  estimate=True))
    assert all(r["activations_per_micro_batch"] > 0 for r in rows)
