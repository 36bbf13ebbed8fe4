"""The FLOPs behind our TFLOP/s and MFU against Megatron-LM's `num_floating_point_operations`, term by term, on the
configs the GPU check trains (the 1.3B GPT, the ~1B MoE, the DeepSeek-shaped MLA + MoE + MTP) and on Llama- and
Qwen3-shaped grouped-query models. Every term agrees to 1e-9, the attention core's causal half included, but these,
each kept on purpose and tested as a delta (docs/training.md quotes the sizes):
  router          we count its 2hE GEMM per token and MoE layer; Megatron-LM leaves it out
  norms           Megatron-LM counts MLA's latent norms (q_l + c) and MTP's three norms (3h) as GEMM work; we count
                  no norm, as no elementwise op
  quick-GeGLU     three GEMMs; Megatron-LM's count reads --swiglu alone and counts two
  recompute       Megatron-LM's count has none, ours adds what recompute runs again, its attention halved too"""
import pytest

from megatron_lite.arguments import parse_args
from megatron_lite.cost import arithmetic
from megatron_lite.model.moe_options import expert_ffn_hidden_size, is_moe_layer
from megatron_lite.training.metrics import IntervalStats, interval_scalars

MEGATRON_LM_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


def megatron_num_floating_point_operations(*, batch_size, seq_length, num_layers, hidden_size, ffn_hidden_size,
                                           num_attention_heads, padded_vocab_size, kv_channels=None,
                                           group_query_attention=False, num_query_groups=None, swiglu=False,
                                           num_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None,
                                           moe_shared_expert_intermediate_size=None, moe_layer_freq=1,
                                           multi_latent_attention=False, q_lora_rank=None, kv_lora_rank=None,
                                           qk_head_dim=None, qk_pos_emb_head_dim=None, v_head_dim=None,
                                           mtp_num_layers=None):
    """Megatron-LM's FLOPs of one training step of `batch_size` samples, as NVIDIA/Megatron-LM
    megatron/training/training.py `num_floating_point_operations` counts them (its `transformer_flops` branch, unpacked
    BSHD batches: every sample seq_length long), at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22).
    Written from its rules, split into named terms whose sum is its single number:

    - every GEMM costs 2 FLOPs per multiply-add and runs 3 times (forward, data and weight gradients): x 6;
    - kv_channels defaults to hidden / heads (arguments.py); without group_query_attention there are as many
      key/value groups as heads;
    - layers: num_layers plus the MTP depths, each depth's layer MoE exactly when the last layer is; with an int
      moe_layer_freq N layer i (from 0) is MoE when i % N == 0;
    - attention projections: QKV (a + 2g) d x h and out a d x h; under MLA the q down/up (or one q projection without
      q_lora_rank), the kv down (c + d_r) x h, the kv up a (d_n + d_v) x c and out a d_v x h, and one more
      multiply-add per latent width (q_l and c: its "+ 1", the latent norms);
    - attention core, QK^T and x V over s^2 per sample, halved for the causal mask: a d s per token (MLA: a (d_qk + d_v)
      s / 2);
    - MLP: 2 GEMMs of h x f, 3 with swiglu; an MoE layer topk experts of moe_ffn_hidden_size (ffn_hidden_size unless
      given) and the shared expert at the same factor; no router, no shared-expert gate;
    - per MTP depth 3h of norms and its eh_proj 2h x h; the logits h x V once plus once per depth.
    """
    h, a = hidden_size, num_attention_heads
    tokens, gemm = batch_size * seq_length, 3 * 2
    d = kv_channels or h // a
    g = num_query_groups if group_query_attention else a
    depths = mtp_num_layers or 0
    if num_experts is None:
        pattern, topk = [0] * num_layers, 0
    else:
        pattern = moe_layer_freq if isinstance(moe_layer_freq, list) else [
            int(i % moe_layer_freq == 0) for i in range(num_layers)]
        topk = moe_router_topk
    moe_layers = sum(pattern) + pattern[-1] * depths
    layers = num_layers + depths
    dense_layers = layers - moe_layers
    ffn_factor = 3 if swiglu else 2
    if multi_latent_attention:
        q_head = qk_head_dim + qk_pos_emb_head_dim
        query = h * a * q_head if q_lora_rank is None else q_lora_rank * (h + a * q_head)
        key_value = kv_lora_rank * (h + a * (qk_head_dim + v_head_dim)) + h * qk_pos_emb_head_dim
        projections = query + key_value + a * v_head_dim * h
        latent_norms = (q_lora_rank or 0) + kv_lora_rank
        core_per_key = (a * q_head + a * v_head_dim) / 2
    else:
        projections = h * (a * d + 2 * g * d) + a * d * h
        latent_norms = 0
        core_per_key = a * d / 2 * 2  # causal half, two matmuls
    return {
        "attention_projections": gemm * tokens * layers * projections,
        "attention_core": gemm * batch_size * seq_length ** 2 * layers * core_per_key,
        "dense_mlp": gemm * tokens * dense_layers * h * ffn_hidden_size * ffn_factor,
        "routed_experts": gemm * tokens * moe_layers * h * (moe_ffn_hidden_size or ffn_hidden_size) * topk * ffn_factor,
        "shared_experts": gemm * tokens * moe_layers * h * (moe_shared_expert_intermediate_size or 0) * ffn_factor,
        "router": 0,
        "mtp_eh_proj": gemm * tokens * depths * 2 * h * h,
        "logits": gemm * tokens * h * padded_vocab_size * (1 + depths),
        "latent_norms": gemm * tokens * layers * latent_norms,
        "mtp_norms": gemm * tokens * depths * 3 * h,
    }


def megatron_padded_vocab_size(vocab_size, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1):
    """Megatron-LM's padding of the vocabulary (megatron/training/vocab_utils.py at the commit above): up to a
    multiple of divisible-by x TP."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


REFERENCE_INPUTS = ("seq_length", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
                    "group_query_attention", "num_query_groups", "swiglu", "num_experts", "moe_router_topk",
                    "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq",
                    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                    "v_head_dim", "mtp_num_layers")

AGREEING = ("attention_projections", "attention_core", "dense_mlp", "routed_experts", "shared_experts", "mtp_eh_proj", "logits")

LLAMA_BLOCK = ("--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "rope",
               "--untie-embeddings-and-output-weights")
"""Flags Megatron-LM's count does not read (norms, biases and positions are not GEMMs): ours must not depend on them
either."""

GPT_1_3B = dict(num_layers=24, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192, seq_length=2048,
                max_position_embeddings=2048, vocab_size=50257, micro_batch_size=2, global_batch_size=16)
"""The GPU check's step c: GPT-2's block (LayerNorm, GeLU, learned positions, biases, tied head)."""

GQA_SWIGLU = {
    "llama3_8b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, group_query_attention=True,
                      num_query_groups=8, ffn_hidden_size=14336, swiglu=True, seq_length=8192,
                      max_position_embeddings=8192, vocab_size=128256, micro_batch_size=1, global_batch_size=8),
    # heads of 128 on hidden 2560: a d = 4096 is not h
    "qwen3_4b": dict(num_layers=36, hidden_size=2560, num_attention_heads=32, group_query_attention=True,
                     num_query_groups=8, kv_channels=128, ffn_hidden_size=9728, swiglu=True, seq_length=4096,
                     max_position_embeddings=4096, vocab_size=151936, micro_batch_size=1, global_batch_size=8),
}

MOE_1B = dict(num_layers=12, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096, seq_length=2048,
              max_position_embeddings=2048, vocab_size=50304, num_experts=8, moe_router_topk=2,
              moe_ffn_hidden_size=4096, micro_batch_size=4, global_batch_size=16)
"""The GPU check's moe step: 12 MoE layers of 8 GeLU experts, top-2, no shared expert."""
MOE = {
    "gpu_check": MOE_1B,
    # every other layer MoE (Megatron-LM's int --moe-layer-freq), a GeLU shared expert: x 2
    "gelu_shared_every_other": {**MOE_1B, "moe_layer_freq": 2, "moe_shared_expert_intermediate_size": 2048},
    # SwiGLU experts and shared expert (x 3) after one dense layer of another width
    "swiglu_shared_after_a_dense_layer": {**MOE_1B, "swiglu": True, "ffn_hidden_size": 2816,
                                          "moe_ffn_hidden_size": 1408, "moe_shared_expert_intermediate_size": 1408,
                                          "moe_layer_freq": [0] + [1] * 11},
}

DEEPSEEK = dict(num_layers=12, hidden_size=2048, num_attention_heads=16, seq_length=4096, max_position_embeddings=4096,
                multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                qk_pos_emb_head_dim=64, v_head_dim=128, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=1408,
                moe_shared_expert_intermediate_size=1408, moe_layer_freq=[0] + [1] * 11, ffn_hidden_size=5632,
                swiglu=True, mtp_num_layers=1, vocab_size=50304, micro_batch_size=1, global_batch_size=16)
"""The GPU check's deepseek step: DeepSeek-V3's head widths, latent norms, a shared expert after one dense layer,
one MTP depth."""
MLA = {
    "gpu_check": DEEPSEEK,
    # DeepSeek-V2-Lite's query: one projection from the hidden state, no q latent
    "no_q_lora": {k: v for k, v in DEEPSEEK.items() if k != "q_lora_rank"},
}
MLA_EXTRA = LLAMA_BLOCK + ("--qk-layernorm",)


def argv_of(case):
    """Our command line for a case: Megatron-LM's flag names carry over."""
    argv = []
    for name, value in case.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, "[" + ",".join(map(str, value)) + "]"]
        else:
            argv += [flag, str(value)]
    return argv


def megatron_count(case, tp=1):
    """Megatron-LM's terms of one step of the case (its global batch)."""
    inputs = {name: case[name] for name in REFERENCE_INPUTS if name in case}
    return megatron_num_floating_point_operations(
        batch_size=case["global_batch_size"], padded_vocab_size=megatron_padded_vocab_size(case["vocab_size"], 128, tp),
        **inputs)


def our_config(case, extra=()):
    return parse_args(argv_of(case) + list(extra), world_size=1)[0]


def our_terms(config):
    """Our FLOPs of one step (the global batch) in Megatron-LM's terms, from cost/arithmetic.py's pieces, each x 3 for
    forward and backward."""
    m = config.model
    tokens = config.batch.global_batch_size * m.seq_length
    depths = m.mtp_num_layers or 0
    numbers = range(1, m.num_layers + depths + 1)
    moe = sum(is_moe_layer(m, n) for n in numbers)
    routed = m.moe_router_topk * arithmetic.mlp_forward_flops(m, expert_ffn_hidden_size(m)) if moe else 0.0
    shared = m.moe_shared_expert_intermediate_size
    shared = arithmetic.mlp_forward_flops(m, shared) if moe and shared else 0.0
    depth_layers = sum(arithmetic.layer_forward_flops(m, True, layer_number=m.num_layers + k)
                       for k in range(1, depths + 1))
    # The core as a layer counts it causally: the layer less the same layer without attention matmuls.
    causal_core = arithmetic.layer_forward_flops(m, True) - arithmetic.layer_forward_flops(m, True, attention_share=0.0)
    forward = {
        "attention_projections": len(numbers) * arithmetic.attention_projection_flops(m),
        "attention_core": len(numbers) * causal_core,
        "dense_mlp": (len(numbers) - moe) * arithmetic.mlp_forward_flops(m),
        "routed_experts": moe * routed,
        "shared_experts": moe * shared,
        "router": moe * (arithmetic.moe_forward_flops(m) - routed - shared) if moe else 0.0,
        "mtp_eh_proj": arithmetic.mtp_forward_flops(m, True) - depth_layers,
        "logits": (1 + depths) * arithmetic.head_forward_flops(m),
        "latent_norms": 0.0,
        "mtp_norms": 0.0,
    }
    return {name: 3 * tokens * flops for name, flops in forward.items()}


def logged_step_flops(config):
    """The FLOPs of one step behind the TFLOP/s and MFU the training log prints (training/metrics.py), one step of
    one second on one rank."""
    stats = IntervalStats(iteration=1, consumed_samples=0, loss=0.0, lr=0.0, grad_norm=None, loss_scale=None,
                          skipped_steps=0, seconds=1.0, iterations=1, samples=config.batch.global_batch_size,
                          global_batch_size=config.batch.global_batch_size)
    return interval_scalars(stats, config.model, world_size=1)["tflops_per_rank"] * 1e12


def compare(name, case, extra=()):
    """(ours, Megatron-LM's) terms of one step, after checking that ours add up to what the log reports; prints the
    table the docs quote (pytest -s)."""
    config = our_config(case, extra)
    ours, megatron = our_terms(config), megatron_count(case)
    assert config.model.padded_vocab_size == megatron_padded_vocab_size(case["vocab_size"])
    assert sum(ours.values()) == pytest.approx(logged_step_flops(config), rel=1e-12)
    total_ours, total_megatron = sum(ours.values()), sum(megatron.values())
    print(f"\n{name}: ours {total_ours:.6e}, Megatron-LM {total_megatron:.6e} FLOPs per step, "
          f"ours / Megatron-LM {total_ours / total_megatron:.4f}")
    for term in ours:
        print(f"  {term:22s} ours {ours[term]:.6e}  Megatron-LM {megatron[term]:.6e}")
    return ours, megatron


def assert_agreeing_terms_match(ours, megatron):
    for term in AGREEING:
        assert ours[term] == pytest.approx(megatron[term], rel=1e-9, abs=0), term


def router_flops(case):
    """2hE per token per MoE layer (the MTP depth's included, of the last layer's kind), forward and backward, one
    step."""
    pattern = case.get("moe_layer_freq", 1)
    if not isinstance(pattern, list):
        pattern = [int(i % pattern == 0) for i in range(case["num_layers"])]
    layers = sum(pattern) + pattern[-1] * case.get("mtp_num_layers", 0)
    return 3 * 2 * case["hidden_size"] * case["num_experts"] * layers * case["global_batch_size"] * case["seq_length"]


def test_megatron_reference_counts_the_1_3b_gpt_by_hand():
    """The reference itself against the textbook 72 B s L h^2 (1 + s / 6h + V / 12 L h) less half the attention
    core (Narayanan et al. 2021, appendix; f = 4h): Megatron-LM's count before it halved causal attention."""
    terms = megatron_count(GPT_1_3B)
    b, s, layers, h, v = 16, 2048, 24, 2048, 50304
    textbook = 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
    assert sum(terms.values()) == pytest.approx(textbook - 12 * b * s * s * layers * h / 2, rel=1e-12)


def test_dense_gpt2_flops_equal_megatron_lms_count():
    ours, megatron = compare("1.3B GPT", GPT_1_3B)
    assert_agreeing_terms_match(ours, megatron)
    assert sum(ours.values()) == pytest.approx(sum(megatron.values()), rel=1e-9)


@pytest.mark.parametrize("variant", sorted(GQA_SWIGLU))
def test_gqa_swiglu_flops_equal_megatron_lms_count(variant):
    ours, megatron = compare(variant, GQA_SWIGLU[variant], LLAMA_BLOCK + ("--qk-layernorm",))
    assert_agreeing_terms_match(ours, megatron)
    assert sum(ours.values()) == pytest.approx(sum(megatron.values()), rel=1e-9)


@pytest.mark.parametrize("variant", sorted(MOE))
def test_moe_flops_equal_megatron_lms_count_but_for_the_router(variant):
    case = MOE[variant]
    ours, megatron = compare(f"MoE {variant}", case)
    assert_agreeing_terms_match(ours, megatron)
    assert ours["router"] == pytest.approx(router_flops(case), rel=1e-12) and megatron["router"] == 0
    assert sum(ours.values()) - sum(megatron.values()) == pytest.approx(ours["router"], rel=1e-9)
    if variant == "gpu_check":  # the delta docs/training.md quotes: the router, 0.03% above
        assert sum(ours.values()) / sum(megatron.values()) == pytest.approx(1.0003, abs=5e-5)


@pytest.mark.parametrize("variant", sorted(MLA))
def test_mla_moe_mtp_flops_equal_megatron_lms_count_but_for_the_router_and_the_norms_it_counts(variant):
    case = MLA[variant]
    ours, megatron = compare(f"DeepSeek-shaped {variant}", case, MLA_EXTRA)
    assert_agreeing_terms_match(ours, megatron)
    assert ours["router"] == pytest.approx(router_flops(case), rel=1e-12)
    tokens, layers = case["global_batch_size"] * case["seq_length"], case["num_layers"] + case["mtp_num_layers"]
    latent = (case.get("q_lora_rank") or 0) + case["kv_lora_rank"]
    assert megatron["latent_norms"] == 6 * tokens * layers * latent
    assert megatron["mtp_norms"] == 6 * tokens * 3 * case["hidden_size"]
    delta = ours["router"] - megatron["latent_norms"] - megatron["mtp_norms"]
    assert sum(ours.values()) - sum(megatron.values()) == pytest.approx(delta, rel=1e-9)


OLD_COUNT = {
    "1.3B GPT, no recompute": (GPT_1_3B, (), 1.0713, {41.1: 38.4}),
    "1.3B GPT, selective recompute": (GPT_1_3B, ("--recompute-granularity", "selective"), 1.0822, {37.3: 34.5}),
    "~0.9B MoE": (MOE_1B, (), 1.0766, {13.1: 12.2, 19.6: 18.2}),
    "DeepSeek-shaped": (DEEPSEEK, MLA_EXTRA, 1.1521, {}),
    "Llama-3-8B-shaped": (GQA_SWIGLU["llama3_8b"], LLAMA_BLOCK, 1.1252, {}),
}
"""The count over every key that the log used before it halved causal attention, over the logged count, as
docs/training.md quotes it; and each MFU (%) the docs record in the old count (the GPU check's 1.3B on one H100, the
MoE's per-expert loop and grouped GEMM on one H200) in the new one."""


@pytest.mark.parametrize("run", sorted(OLD_COUNT))
def test_mfu_recorded_over_every_key_is_the_logged_count_times_the_ratio_docs_quote(run):
    case, extra, ratio, recorded = OLD_COUNT[run]
    m = our_config(case, extra).model
    measured = arithmetic.training_flops_per_token(m, causal=False) / arithmetic.training_flops_per_token(m)
    assert measured == pytest.approx(ratio, abs=5e-5)
    assert {old: round(old / measured, 1) for old in recorded} == recorded


@pytest.mark.parametrize("case, extra", [(GPT_1_3B, ()), (GQA_SWIGLU["qwen3_4b"], LLAMA_BLOCK),
                                         (MOE["swiglu_shared_after_a_dense_layer"], ()), (DEEPSEEK, MLA_EXTRA)])
def test_our_causal_layer_count_is_megatron_lms_less_the_norms_it_counts_and_plus_the_router(case, extra):
    """layer_forward_flops(causal=True), what the logged count, the pipeline split and the planner price, is
    Megatron-LM's accounting."""
    config = our_config(case, extra)
    m = config.model
    depths = m.mtp_num_layers or 0
    forward = (sum(arithmetic.layer_forward_flops(m, True, layer_number=n) for n in range(1, m.num_layers + 1))
               + arithmetic.mtp_forward_flops(m, True) + (1 + depths) * arithmetic.head_forward_flops(m))
    megatron = megatron_count(case)
    router = router_flops(case) if m.num_experts else 0
    expected = sum(megatron.values()) - megatron["latent_norms"] - megatron["mtp_norms"] + router
    assert 3 * forward * case["global_batch_size"] * case["seq_length"] == pytest.approx(expected, rel=1e-9)


def test_logged_flops_add_what_recompute_runs_again_which_megatron_lms_count_leaves_out():
    plain = our_config(GPT_1_3B)
    selective = our_config(GPT_1_3B, ("--recompute-granularity", "selective"))
    tokens = GPT_1_3B["global_batch_size"] * GPT_1_3B["seq_length"]
    again = arithmetic.recompute_forward_flops_per_token(selective.model, causal=True) * tokens
    assert again == pytest.approx(24 * 2 * 2048 * 2048 / 2 * tokens, rel=1e-12)  # each layer's scores, causal half
    assert logged_step_flops(selective) - logged_step_flops(plain) == pytest.approx(again, rel=1e-9)


def test_quick_geglu_mlp_counts_three_gemms_where_megatron_lms_count_reads_swiglu_alone():
    """gpt-oss's MLP is gated like SwiGLU (gate, up, down), but Megatron-LM's count reads args.swiglu only, so with
    --quick-geglu it counts two GEMMs: ours is 3/2 of it."""
    case = {**GPT_1_3B, "ffn_hidden_size": 5632}
    ours, megatron = compare("1.3B GPT with quick-GeGLU", case, ("--quick-geglu",))
    assert ours["dense_mlp"] == pytest.approx(1.5 * megatron["dense_mlp"], rel=1e-12)
    assert ours["dense_mlp"] == pytest.approx(megatron_count({**case, "swiglu": True})["dense_mlp"], rel=1e-12)
