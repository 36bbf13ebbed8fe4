"""cost/arithmetic.py for Multi-head Latent Attention against built models: parameters per rank and stage (the
down projections and latent norms whole on every TP rank), the matrices Muon steps, FLOPs against torch's FLOP
counter and Megatron-LM's formula, and DeepSeek-V3's published sizes."""
import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.cost import arithmetic, muon, stages
from megatron_lite.cost.matrices import layer_matrices
from tests.cost.test_arithmetic import RECOMPUTE, _built_stage, as_built, assert_counts_match_the_built_model
from tests.harness import run_distributed
from tests.model.gpt_layouts import tiny_config

MLA = ("--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "10", "--qk-layernorm", "--swiglu", "--normalization", "RMSNorm",
       "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
       "--ffn-hidden-size", "96")
"""DeepSeek-V3's attention in small: 4 heads, q latent 24, kv latent 16, queries and keys 8 + 4 wide, values 10
(narrower: the projection reads 4 x 10), with the latents' RMSNorms; SwiGLU, no biases, untied head."""
MLA_VARIANTS = {
    "deepseek_v3": MLA,
    # DeepSeek-V2-Lite's query: one projection from the hidden state; no latent norms
    "no_q_lora": tuple(f for f in MLA if f not in ("--q-lora-rank", "24", "--qk-layernorm")),
    # biases on the down projections and the projection alone, LayerNorm's latent norms (weight and bias), GeLU
    "biases_layernorm": tuple(f for f in MLA if f not in ("--disable-bias-linear", "--swiglu", "--normalization",
                                                         "RMSNorm", "--untie-embeddings-and-output-weights"))
    + ("--normalization", "LayerNorm"),
}


def test_an_mla_layer_is_counted_by_hand_with_its_down_projections_and_latent_norms_whole_on_every_tp_rank():
    """h 64: q down 24 x 64, q norm 24, q up 4 (8 + 4) x 24, kv down (16 + 4) x 64, kv norm 16, kv up
    4 (8 + 10) x 16, projection 64 x 4 x 10; two RMSNorms, SwiGLU 3 x 96 x 64. At TP 2 the up projections, the
    projection and the MLP are halved, the down projections and all norms are not."""
    config = tiny_config(1, 1, 1, MLA)
    whole = 24 * 64 + 24 + 20 * 64 + 16 + 2 * 64
    split = 48 * 24 + 72 * 16 + 64 * 40 + 3 * 96 * 64
    assert arithmetic.spec_parameters(config)[1] == whole + split
    assert arithmetic.spec_parameters(config, tp=2)[1] == whole + split // 2
    assert arithmetic.total_parameters(config) == 4 * (whole + split) + 64 + 2 * 128 * 64
    # Biases on q down, kv down and the projection (whole), and the MLP's (2 x 96 split, 64 whole)
    biased = tiny_config(1, 1, 1, tuple(f for f in MLA if f != "--disable-bias-linear")).model
    assert sum(arithmetic.layer_tensors(biased, 2)) - sum(arithmetic.layer_tensors(config.model, 2)) == (
        24 + 20 + 64 + 2 * 96 // 2 + 64)


@pytest.mark.parametrize("variant", sorted(MLA_VARIANTS))
def test_total_parameters_and_each_spec_match_the_dense_mla_model_tensor_by_tensor(variant):
    assert_counts_match_the_built_model(tiny_config(1, 1, 1, MLA_VARIANTS[variant]))


def _built_at_tp2(extra):
    """Each layer's parameters on this TP rank, and the local shapes of its weights tagged for Muon."""
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel import state

    state.initialize(2, 1)
    model = GPTModel(tiny_config(2, 1, 1, extra))
    return ([sum(p.numel() for p in layer.parameters()) for layer in model.layers],
            [tuple(p.shape) for p in model.layers[1].parameters() if getattr(p, "hidden_matrix", False)])


@pytest.mark.parametrize("variant", sorted(MLA_VARIANTS))
def test_each_specs_parameters_and_muons_matrices_per_tp_rank_match_the_mla_model_built_at_tp2(variant):
    config = tiny_config(2, 1, 1, MLA_VARIANTS[variant])
    per_spec = arithmetic.spec_parameters(config)
    matrices = layer_matrices(config.model, 1)
    local = [(x.rows, x.cols) if x.replicated else (x.rows // 2, x.cols) if x.partition_dim == 0
             else (x.rows, x.cols // 2) for x in matrices]
    for built, shapes in run_distributed(_built_at_tp2, 2, MLA_VARIANTS[variant]):
        assert built == as_built(config, per_spec)
        assert shapes == local  # in the layer's parameter order, the down projections whole
    assert sum(x.elements(2) for x in matrices) == sum(r * c for r, c in local)


def test_stage_bounds_and_parameters_per_rank_match_the_mla_pipeline_built_at_tp2_pp2():
    config = tiny_config(2, 2, 1, MLA)
    bounds = stages.stage_bounds(config)
    expected = stages.stage_parameters(config, bounds)
    for stage, tp_rank, parameters, parts, _ in run_distributed(_built_stage, 4, 2, 2, MLA):
        assert parts == bounds and parameters == expected[stage], (stage, tp_rank)


def test_muon_orthogonalises_a_down_projection_whole_on_every_rank_and_gathers_only_the_split_matrices():
    blockwise = tiny_config(2, 1, 1, MLA + ("--optimizer", "muon", "--muon-tp-mode", "blockwise"))
    duplicated = tiny_config(2, 1, 1, MLA + ("--optimizer", "muon"))
    q_down, q_up = layer_matrices(blockwise.model, 1)[:2]
    assert q_down.replicated and muon.matrix_parts(blockwise, q_down) == [(24, 64)]
    assert muon.matrix_parts(blockwise, q_up) == [(24, 24)]  # this rank's 2 of 4 heads
    matrices = layer_matrices(duplicated.model, 1)
    work = muon.stage_work(duplicated, matrices, 1, 1)
    split = [x for x in matrices if not x.replicated]
    assert work.all_gathers == len(split) == len(matrices) - 2
    assert work.all_gather_bytes == sum(4 * x.rows * x.cols for x in split)


def _flops_counted(config, train):
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    m = config.model
    model = GPTModel(config).train(train)
    model_parallel_seed(config.training.seed, m.num_layers)
    b, s = 2, m.seq_length
    tokens = torch.randint(0, m.vocab_size, (b, s))
    with FlopCounterMode(display=False) as counter:
        if train:
            model(tokens, torch.arange(s).expand(b, s), tokens, torch.ones(b, s)).backward()
        else:
            with torch.no_grad():
                model(tokens, torch.arange(s).expand(b, s))
    return counter.get_total_flops() / (b * s)


@pytest.mark.parametrize("variant", sorted(MLA_VARIANTS))
def test_mla_forward_flops_per_token_match_torchs_flop_counter(variant):
    """Down, up and output projections, scores over 8 + 4 wide queries and keys, x V over 10 wide values."""
    config = tiny_config(1, 1, 1, MLA_VARIANTS[variant] + ("--attention-backend", "fused"))
    m = config.model
    forward = m.num_layers * arithmetic.layer_forward_flops(m, causal=False) + arithmetic.head_forward_flops(m)
    assert _flops_counted(config, train=False) == pytest.approx(forward, rel=1e-6)


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_mla_training_flops_match_torchs_flop_counter_and_selective_recompute_reruns_the_scores_alone(recompute):
    config = tiny_config(1, 1, 1, MLA + ("--attention-backend", "fused") + RECOMPUTE.get(recompute, ()))
    m = config.model
    assert _flops_counted(config, train=True) == pytest.approx(arithmetic.training_flops_per_token(m, causal=False),
                                                               rel=1e-6)
    scores = 2 * 32 * 4 * 12  # s x a x (d_n + d_r), not half of the core: values are 10 wide
    assert arithmetic.attention_scores_forward_flops(m) == scores
    assert arithmetic.attention_core_forward_flops(m) == scores + 2 * 32 * 4 * 10
    if recompute == "selective":
        assert arithmetic.recompute_forward_flops_per_token(m, causal=False) == m.num_layers * scores
        assert arithmetic.recompute_forward_flops_per_token(m, causal=True) == m.num_layers * scores / 2


def megatron_lm_mla_attention_flops(m):
    """Megatron-LM's training.py `num_floating_point_operations`, its multi_latent_attention branch (per token,
    forward: the 3x of forward and backward left out), with its causal s / 2."""
    h, n, s = m.hidden_size, m.num_attention_heads, m.seq_length
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    q_term = h * n * q_head if m.q_lora_rank is None else m.q_lora_rank * (h + n * q_head + 1)
    return 2 * (q_term + m.kv_lora_rank * (h + n * (m.qk_head_dim + m.v_head_dim) + 1) + h * m.qk_pos_emb_head_dim
                + n * m.v_head_dim * h + s * n * q_head / 2 + s * n * m.v_head_dim / 2)


@pytest.mark.parametrize("variant", ["deepseek_v3", "no_q_lora"])
def test_causal_mla_flops_are_megatron_lms_less_the_latent_norms_it_counts_as_matmul_work(variant):
    m = tiny_config(1, 1, 1, MLA_VARIANTS[variant]).model
    attention = arithmetic.layer_forward_flops(m, causal=True) - arithmetic.mlp_forward_flops(m)
    norms = 2 * ((m.q_lora_rank or 0) + m.kv_lora_rank)  # Megatron-LM's "+ 1" per latent dimension
    assert attention == pytest.approx(megatron_lm_mla_attention_flops(m) - norms)


DEEPSEEK_V3 = ["--num-layers", "61", "--hidden-size", "7168", "--num-attention-heads", "128",
               "--multi-latent-attention", "--q-lora-rank", "1536", "--kv-lora-rank", "512", "--qk-head-dim", "128",
               "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--qk-layernorm", "--vocab-size", "129280",
               "--make-vocab-size-divisible-by", "128", "--ffn-hidden-size", "18432", "--num-experts", "256",
               "--moe-router-topk", "8", "--moe-ffn-hidden-size", "2048", "--moe-shared-expert-intermediate-size",
               "2048", "--moe-layer-freq", "([0]*3+[1]*58)", "--moe-router-score-function", "sigmoid",
               "--moe-router-enable-expert-bias", "--moe-router-num-groups", "8", "--moe-router-group-topk", "4",
               "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
               "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--seq-length", "4096",
               "--max-position-embeddings", "4096", "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16"]
"""DeepSeek-V3 without its MTP module (config.json of deepseek-ai/DeepSeek-V3), at the 4K it was pretrained at."""


def test_deepseek_v3_counts_671b_parameters_37_6b_active_and_megatron_lms_250_gflops_per_token():
    """Hugging Face's shapes per layer: q_a 1536 x 7168, q_a_layernorm, q_b 128 x 192 x 1536, kv_a 576 x 7168,
    kv_a_layernorm, kv_b 128 x 256 x 512, o 7168 x 128 x 128. DeepSeek quotes 671B (685B with MTP) and 37B
    activated; Megatron-LM counts 249.8 GFLOP per token of training at 4K (DeepSeek: 250), which our causal
    count matches but for the router's 2 h E per MoE layer (Megatron-LM leaves it out)."""
    config, _ = parse_args(DEEPSEEK_V3, world_size=1)
    m, h = config.model, 7168
    attention = 1536 * h + 1536 + 128 * 192 * 1536 + 576 * h + 512 + 128 * 256 * 512 + h * 128 * 128
    assert sum(arithmetic.latent_attention_tensors(m)) + h * 128 * 128 == attention == 187_107_328
    dense, expert = attention + 2 * h + 3 * 18432 * h, 3 * 2048 * h
    moe = attention + 2 * h + 256 * h + 256 * expert + expert
    total = 2 * 129280 * h + h + 3 * dense + 58 * moe
    assert arithmetic.total_parameters(config) == total == 671_026_404_352
    assert arithmetic.active_parameters(config) == total - 58 * 248 * expert == 37_552_282_624
    training = 3 * (sum(arithmetic.layer_forward_flops(m, causal=True, layer_number=n) for n in range(1, 62))
                    + arithmetic.head_forward_flops(m))
    megatron = 3 * (61 * megatron_lm_mla_attention_flops(m) + 2 * h * (3 * 3 * 18432 + 58 * 9 * 3 * 2048)
                    + 2 * h * 129280)
    assert training == pytest.approx(megatron + 3 * 58 * 2 * h * 256 - 3 * 61 * 2 * (1536 + 512))
    assert round(megatron / 1e9, 1) == 249.8 and round(training / 1e9, 1) == 250.4
