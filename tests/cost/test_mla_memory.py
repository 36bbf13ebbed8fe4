"""The memory estimate of Multi-head Latent Attention against what is measured: one layer's saved activations
byte for byte (TP, sequence parallelism, recompute, both attention backends, 16 bits at micro batch 1, with and
without the query latent and the latents' norms), a pipeline's stages with experts, context parallelism (q and
k exchanged together, v apart), and the model states of a real engine whose down projections are whole on
every TP rank."""
import json

import pytest

from megatron_lite.cost import activations, memory
from megatron_lite.deepspeed_config import deepspeed_config
from tests.cost.test_memory import RECOMPUTE, _assert_layer_census_equals_the_estimate
from tests.cost.test_mla_arithmetic import MLA, MLA_VARIANTS
from tests.device import census_device
from tests.harness import run_distributed, shutdown_pools
from tests.model.gpt_layouts import tiny_config

DROPOUT = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1")
EQUAL_WIDTHS = tuple(f if f != "10" else "12" for f in MLA)
"""Values as wide as queries and keys (8 + 4): SDPA's flash kernel takes them on the CPU (narrower ones take its
math path), and under context parallelism v goes in the all-to-all of q and k."""
BLOCKS = dict(MLA_VARIANTS, equal_widths=EQUAL_WIDTHS)


def _rows(tp, block, backend, dropout=True, micro=2, bf16=False):
    extra = BLOCKS[block] + ("--attention-backend", backend, "--micro-batch-size", str(micro),
                             "--global-batch-size", "8")
    extra += (DROPOUT if dropout else ()) + (("--bf16",) if bf16 else ())
    return [(sp, recompute, tiny_config(tp, 1, 1, extra + tuple(RECOMPUTE[recompute])
                                        + (("--sequence-parallel",) if sp else ())))
            for sp in ((False, True) if tp > 1 else (False,)) for recompute in ("none", "selective", "full")]


LAYER_CASES = {  # (TP, block, backend, dropout, micro batch, bf16)
    "deepseek_v3-fused-tp1": (1, "deepseek_v3", "fused", True, 2, False),
    "deepseek_v3-sdpa-tp2": (2, "deepseek_v3", "sdpa", True, 2, False),
    "deepseek_v3-sdpa-tp2-bf16-micro1": (2, "deepseek_v3", "sdpa", False, 1, True),
    "no_q_lora-fused-tp2": (2, "no_q_lora", "fused", True, 2, False),
    "no_q_lora-sdpa-tp1-bf16-micro1": (1, "no_q_lora", "sdpa", False, 1, True),
    "biases_layernorm-sdpa-tp2": (2, "biases_layernorm", "sdpa", True, 2, False),
    "equal_widths-sdpa-tp2": (2, "equal_widths", "sdpa", False, 2, False),
    "equal_widths-fused-tp1-bf16-micro1": (1, "equal_widths", "fused", False, 1, True),
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_one_mla_layers_activations_match_the_estimate_with_sequence_parallel_and_recompute(case):
    """The latents (the kv one a view of the kv down output, which whatever keeps the view keeps whole), q and k
    made new by RoPE, v a view of the kv up output (kept whole where kept as given), the d_v wide context, per
    layer and micro-batch on every TP rank, without and with sequence parallelism, selective and full recompute."""
    tp, block, backend, dropout, micro, bf16 = LAYER_CASES[case]
    rows = _rows(tp, block, backend, dropout, micro, bf16)
    none, selective, full = _assert_layer_census_equals_the_estimate(tp, rows)[-3:]
    assert full < selective < none


def _stage_census(tp, cp, extra):
    from tests.cost.activation_census import forced_routing, saved_bytes_per_stage

    with forced_routing():
        return saved_bytes_per_stage(tiny_config(tp, 2, 1, extra, cp=cp))


EXPERTS = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
           "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "([0]*1+[1]*3)",
           "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias")
"""DeepSeek-V3's layers in small: a dense first layer, then experts behind a sigmoid router with a shared one."""
STAGE_CASES = {  # (TP, CP, flags)
    "deepseek_v3-experts-tp2-sp-bf16-micro1": (2, 1, MLA + EXPERTS + ("--sequence-parallel", "--bf16",
                                                                     "--global-batch-size", "8")),
    "deepseek_v3-experts-selective": (1, 1, MLA + EXPERTS + DROPOUT + tuple(RECOMPUTE["selective"])
                                      + ("--micro-batch-size", "2", "--global-batch-size", "8")),
    "deepseek_v3-cp2": (1, 2, MLA + ("--attention-backend", "sdpa", "--micro-batch-size", "2",
                                     "--global-batch-size", "8")),
    "deepseek_v3-cp2-tp2-sp-fused": (2, 2, MLA + ("--attention-backend", "fused", "--sequence-parallel",
                                                  "--micro-batch-size", "2", "--global-batch-size", "8")),
    "equal_widths-cp2": (1, 2, EQUAL_WIDTHS + ("--attention-backend", "sdpa", "--micro-batch-size", "2",
                                               "--global-batch-size", "8")),
    "equal_widths-cp2-selective": (1, 2, EQUAL_WIDTHS + tuple(RECOMPUTE["selective"]) + ("--micro-batch-size", "2",
                                                                                  "--global-batch-size", "8")),
}


@pytest.mark.parametrize("case", list(STAGE_CASES))
def test_every_mla_pipeline_stages_activations_per_micro_batch_match_the_estimate(case):
    """Two stages (embedding, head, the send included), with experts under balanced routing, and under context
    parallelism, where q and k go in one all-to-all and v, 10 wide, in another (as wide as them, with them)."""
    tp, cp, extra = STAGE_CASES[case]
    measured = run_distributed(_stage_census, tp * cp, tp, cp, extra)
    config = tiny_config(tp, 2, 1, extra, cp=cp)
    want = [st.activations_per_micro_batch for st in memory.estimate(config, deepspeed_config(config),
                                                                     device=census_device())]
    for rank, got in enumerate(measured):
        assert got == want, f"rank {rank}: measured {got}, estimate {want}"


def test_the_context_parallel_all_to_alls_carry_q_and_k_of_d_qk_and_v_and_the_context_of_d_v():
    """Per layer at CP 2, fp32, micro batch 2, seq 32, 4 heads: q and k [2, 2 + 2, 32, 12] in, v [2, 2, 32, 10] in,
    the context [2, 2, 32, 10] back."""
    config = tiny_config(1, 1, 1, MLA + ("--micro-batch-size", "2", "--global-batch-size", "8"), cp=2)
    assert activations.context_parallel_all_to_all_bytes(config) == 4 * 2 * 32 * (4 * 12 + 2 * 10 + 2 * 10)


def test_model_states_of_a_real_mla_engine_at_tp2_count_the_down_projections_whole_on_each_rank(tmp_path):
    """TP 2 with ZeRO 1 at DP 2 in bf16: every rank holds the whole down projections and latent norms (as it holds
    the residual norms) and half of the rest, and the estimate books their weights, gradients and optimizer
    states so."""
    from tests.cost.engine_census import engine_census

    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 2000}}))
    argv = MLA + ("--zero-stage", "1", "--bf16", "--global-batch-size", "8")
    shutdown_pools()  # a fresh pool: no engine of an earlier test still holds memory
    results = run_distributed(engine_census, 4, 2, 1, 2, list(argv), str(ds_json))
    shutdown_pools()
    config = results[0]["config"]
    st = memory.estimate(config, {"zero_optimization": {"stage": 1, "reduce_bucket_size": 2000}}, device="cpu")[0]
    for r in results:
        assert r["between"] == pytest.approx(st.between_steps, rel=0.01), (r["rank"], r["between"], st)
