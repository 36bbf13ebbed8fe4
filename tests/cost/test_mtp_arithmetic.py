"""cost/arithmetic.py, cost/matrices.py and cost/stages.py for Multi-Token Prediction against built models: each
depth's parameters per rank (eh_proj whole on every TP rank), the last stage of a TP 2 x PP 2 pipeline (the depths
and one copy of the embedding, which a tied head shares), the matrices Muon steps and the experts there, the active
parameters a token gets a gradient through, FLOPs against torch's FLOP counter and Megatron-LM's formula, and
DeepSeek-V3 with its MTP module."""
import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.cost import arithmetic, stages
from megatron_lite.cost.matrices import mtp_matrices
from megatron_lite.model.moe_options import is_moe_layer
from tests.cost.test_arithmetic import RECOMPUTE, _expert_modules, as_built, assert_counts_match_the_built_model
from tests.cost.test_mla_arithmetic import DEEPSEEK_V3, MLA, megatron_lm_mla_attention_flops
from tests.harness import run_distributed
from tests.model.gpt_layouts import tiny_config
from tests.model.test_llama_parallel import LLAMA

EXPERTS = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
           "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "([0]*1+[1]*3)",
           "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias")
"""DeepSeek-V3's layers in small: a dense first layer, then sigmoid-routed experts with a shared one."""
MTP_VARIANTS = {
    # DeepSeek-V3 in small: MLA, experts, one depth (an MoE layer: the last layer's kind), untied head
    "deepseek_v3": MLA + EXPERTS + ("--mtp-num-layers", "1"),
    # the Llama block with a tied head (the last stage's embedding serves the depths and the head) and two depths
    "llama_tied_d2": tuple(f for f in LLAMA if f != "--untie-embeddings-and-output-weights")
    + ("--mtp-num-layers", "2"),
    # GPT-2's block (LayerNorm: weight and bias; biases, GeLU), rotary positions, the last layer dense
    "gpt2_d1": ("--position-embedding-type", "rope", "--mtp-num-layers", "1"),
}


def test_a_depth_is_two_norms_eh_proj_whole_on_every_tp_rank_a_decoder_layer_and_a_final_norm():
    """h 64, RMSNorm: enorm, hnorm and the final norm 64 each, eh_proj 64 x 128 whatever TP, the layer of the Llama
    block (2 groups of 16: QKV 128 x 64, projection 64 x 64, SwiGLU 3 x 96 x 64, its two norms), halved at TP 2
    but its norms."""
    config = tiny_config(1, 1, 1, MTP_VARIANTS["llama_tied_d2"])
    layer = (128 + 64) * 64 + 3 * 96 * 64
    depth = 3 * 64 + 64 * 128 + layer + 2 * 64
    assert sum(arithmetic.mtp_tensors(config.model)) == 2 * depth
    assert sum(arithmetic.mtp_tensors(config.model, tp=2)) == 2 * (3 * 64 + 64 * 128 + layer // 2 + 2 * 64)
    per_spec = arithmetic.spec_parameters(config)
    embedding = 128 * 64
    assert per_spec[6:] == [embedding, 2 * depth, embedding]  # its embedding copy, the depths, the tied head
    assert arithmetic.total_parameters(config) == embedding + 4 * (layer + 2 * 64) + 64 + 2 * depth
    assert arithmetic.embedding_specs(config.model) == [0, 6, 8]


@pytest.mark.parametrize("variant", sorted(MTP_VARIANTS))
def test_total_parameters_and_each_spec_match_the_model_with_depths_tensor_by_tensor(variant):
    config = tiny_config(1, 1, 1, MTP_VARIANTS[variant])
    model = assert_counts_match_the_built_model(config)
    assert len(_expert_modules(model)) == arithmetic.moe_layers(config.model)
    # `type:<regex>` partitioning matches the costs' names against the built classes.
    built = [type(layer).__name__ for layer in model.layers]
    names = [c.name for c in stages.spec_costs(config)]
    assert [n for n, b in zip(names, built) if b != "Identity"] == [b for b in built if b != "Identity"]


def _built_at_tp2(extra):
    """Each layer's parameters on this TP rank, and the local shapes of the depths' weights tagged for Muon."""
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel import state

    state.initialize(2, 1)
    config = tiny_config(2, 1, 1, extra)
    model = GPTModel(config)
    depths = model.layers[config.model.num_layers + 3]
    return ([sum(p.numel() for p in layer.parameters()) for layer in model.layers],
            [tuple(p.shape) for p in depths.parameters() if getattr(p, "hidden_matrix", False)])


def _local(matrices, tp):
    """Each matrix's shape on a TP rank: a rank's experts stacked [E/EP, rows, cols]."""
    shapes = [(x.rows, x.cols) if x.replicated else (x.rows // tp, x.cols) if x.partition_dim == 0
              else (x.rows, x.cols // tp) for x in matrices]
    return [(x.copies, *shape) if x.expert else shape for x, shape in zip(matrices, shapes)]


@pytest.mark.parametrize("variant", ["deepseek_v3", "llama_tied_d2"])
def test_each_specs_parameters_and_the_depths_muon_matrices_per_tp_rank_match_the_model_built_at_tp2(variant):
    config = tiny_config(2, 1, 1, MTP_VARIANTS[variant])
    per_spec = arithmetic.spec_parameters(config)
    matrices = mtp_matrices(config.model)
    for built, shapes in run_distributed(_built_at_tp2, 2, MTP_VARIANTS[variant]):
        assert built == as_built(config, per_spec)
        assert shapes == _local(matrices, 2)  # eh_proj [64, 128] whole, then the layer's, in parameter order
    assert matrices[0].replicated and (matrices[0].rows, matrices[0].cols) == (64, 128)


def _built_stage(tp, pp, extra):
    """This rank's pipeline stage: (pp rank, parameters, parts, local shapes of the weights tagged for Muon, the
    routed experts' parameters)."""
    import deepspeed
    import torch.distributed as dist

    from megatron_lite.model.gpt import build
    from megatron_lite.parallel import state

    config = tiny_config(tp, pp, 1, extra)
    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    state.initialize(tp, pp)
    module = build(config, state.get_topology(), stages.pipeline_split(config))
    experts = sum(p.numel() for m in _expert_modules(module) for p in m.parameters())
    return (state.get_pipeline_model_parallel_rank(), sum(p.numel() for p in module.parameters()), list(module.parts),
            sorted(tuple(p.shape) for p in module.parameters() if getattr(p, "hidden_matrix", False)), experts)


@pytest.mark.parametrize("variant", ["deepseek_v3", "llama_tied_d2"])
def test_the_last_stage_at_tp2_pp2_holds_the_depths_and_one_copy_of_the_embedding_as_counted(variant):
    """Per rank of each stage: the parameters (a tied head and the depths' embedding one module), the matrices
    Muon steps (the depths' after the layers') and the routed experts (a depth's MoE layer's among them)."""
    extra = MTP_VARIANTS[variant] + ("--optimizer", "muon")
    config = tiny_config(2, 2, 1, extra)
    bounds = stages.stage_bounds(config)
    assert bounds[-1] == config.model.num_layers + 5 and stages.stage_mtp_layer_numbers(config, bounds)[-1]
    parameters = stages.stage_parameters(config, bounds)
    matrices = [sorted(_local(stage, 2)) for stage in stages.stage_matrices(config, bounds)]
    experts = stages.stage_expert_parameters(config, bounds)
    for stage, built, parts, shapes, routed in run_distributed(_built_stage, 4, 2, 2, extra):
        assert parts == bounds and built == parameters[stage], (stage, built, parameters)
        assert shapes == matrices[stage] and routed == experts[stage], stage
    if variant == "deepseek_v3":  # per rank: 4 experts of 2 x 48 x 64 and 64 x 24 (SwiGLU, F 48 split over TP)
        last = stages.stage_layer_numbers(config, bounds)[-1]
        assert experts[-1] == (len(last) + 1) * 4 * (2 * 24 * 64 + 64 * 24)  # its MoE layers and the depth's


def test_active_parameters_count_the_k_experts_of_a_depth_a_token_is_routed_to():
    """One position through the model and its depth (the next token's embedding, the one after as its label; the
    second position masked out everywhere): the expert slices whose gradient is not zero are the k it was routed to
    in each MoE layer, the depth's included; everything else counts whole."""
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    config = tiny_config(1, 1, 1, MTP_VARIANTS["deepseek_v3"])
    model = GPTModel(config).train()
    model_parallel_seed(config.training.seed, config.model.numbered_layers)
    tokens, mask = torch.tensor([[5, 9]]), torch.tensor([[1.0, 0.0]])
    depth = (torch.tensor([[[9, 0]]]), torch.tensor([[[3, 0]]]), torch.tensor([[[1.0, 0.0]]]))
    model(tokens, torch.arange(2)[None], torch.tensor([[9, 3]]), mask, mtp=depth).backward()
    experts = {id(p) for module in _expert_modules(model) for p in module.parameters()}
    touched = sum(p.numel() for p in model.parameters() if id(p) not in experts)
    for module in _expert_modules(model):
        touched += sum(p[e].numel() for e in range(module.weight1.shape[0]) if module.weight1.grad[e].abs().sum() > 0
                       for p in module.parameters())
    assert touched == arithmetic.active_parameters(config)
    m = config.model
    assert arithmetic.moe_layers(m) == 4 and is_moe_layer(m, m.num_layers + 1)


def _flops_counted(config, train):
    """torch's FLOP count per token of a forward (and backward) of the model with its depths, micro batch 2."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_lite.data.mtp import mtp_arrays
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    m = config.model
    model = GPTModel(config).train(train)
    model_parallel_seed(config.training.seed, m.numbered_layers)
    b, s = 2, m.seq_length
    tokens = torch.randint(0, m.vocab_size, (b, s))
    labels, mask, positions = torch.randint(0, m.vocab_size, (b, s)), torch.ones(b, s), torch.arange(s).expand(b, s)
    depth = mtp_arrays(tokens, labels, mask, None, m.mtp_num_layers)
    with FlopCounterMode(display=False) as counter:
        if train:
            model(tokens, positions, labels, mask, mtp=depth).backward()
        else:
            with torch.no_grad():
                model(tokens, positions, mtp=depth)
    return counter.get_total_flops() / (b * s)


@pytest.mark.parametrize("variant", sorted(MTP_VARIANTS))
def test_forward_flops_per_token_with_the_depths_match_torchs_flop_counter(variant):
    """Every layer, then per depth its eh_proj (2 x 2h x h) and decoder layer, and 1 + D head GEMMs."""
    config = tiny_config(1, 1, 1, MTP_VARIANTS[variant] + ("--attention-backend", "fused"))
    m = config.model
    forward = (sum(arithmetic.layer_forward_flops(m, causal=False, layer_number=n) for n in range(1, 5))
               + arithmetic.mtp_forward_flops(m, causal=False)
               + (1 + m.mtp_num_layers) * arithmetic.head_forward_flops(m))
    assert _flops_counted(config, train=False) == pytest.approx(forward, rel=1e-6)
    assert arithmetic.mtp_forward_flops(m, causal=False) == pytest.approx(sum(
        4 * 64 * 64 + arithmetic.layer_forward_flops(m, False, layer_number=4 + k)
        for k in range(1, m.mtp_num_layers + 1)))


@pytest.mark.parametrize("variant", ["deepseek_v3", "llama_tied_d2"])
@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_training_flops_with_the_depths_match_torchs_flop_counter_and_only_selective_recompute_reruns_theirs(
        variant, recompute):
    """Forward and backward (3x), and what recompute runs again: selective reruns every layer's scores, the depths'
    included (their attention checkpoints as any); full runs the stage's transformer layers again, not the depths
    (model/recompute.py), which keep their activations."""
    config = tiny_config(1, 1, 1, MTP_VARIANTS[variant] + ("--attention-backend", "fused")
                         + RECOMPUTE.get(recompute, ()))
    m = config.model
    assert _flops_counted(config, train=True) == pytest.approx(arithmetic.training_flops_per_token(m, causal=False),
                                                               rel=1e-6)
    without_depths = arithmetic.recompute_forward_flops_per_token(m, depths=0, causal=False)
    added = arithmetic.recompute_forward_flops_per_token(m, causal=False) - without_depths
    scores = arithmetic.attention_scores_forward_flops(m)
    assert added == (m.mtp_num_layers * scores if recompute == "selective" else 0)


def megatron_lm_training_flops(m):
    """Megatron-LM's training.py `num_floating_point_operations` (transformer_flops, multi-head or grouped-query
    attention, dense layers) per token: L + D layers, D x (3h of norms + 2h^2 of eh_proj), (1 + D) logit GEMMs,
    each x 3 (forward and backward) x 2 (a multiply-add)."""
    h, s, d = m.hidden_size, m.seq_length, m.mtp_num_layers or 0
    query, kv = m.head_dim * m.num_attention_heads, m.head_dim * (m.num_query_groups or m.num_attention_heads)
    attention = h * (query + 2 * kv) + query * s / 2 * 2 + query * h
    mlp = h * m.ffn_hidden_size * (3 if m.swiglu else 2)
    logits = h * m.padded_vocab_size * (d + 1)
    return 3 * 2 * ((m.num_layers + d) * (attention + mlp) + d * (3 * h + 2 * h * h) + logits)


@pytest.mark.parametrize("variant", ["llama_tied_d2", "gpt2_d1"])
def test_our_causal_count_is_megatron_lms_with_the_depths_less_the_3h_of_norms_it_counts_per_depth(variant):
    m = tiny_config(1, 1, 1, MTP_VARIANTS[variant]).model
    ours = 3 * (sum(arithmetic.layer_forward_flops(m, causal=True, layer_number=n) for n in range(1, 5))
                + arithmetic.mtp_forward_flops(m, causal=True)
                + (1 + m.mtp_num_layers) * arithmetic.head_forward_flops(m))
    assert ours == pytest.approx(megatron_lm_training_flops(m) - 3 * 2 * 3 * m.hidden_size * m.mtp_num_layers)


def test_deepseek_v3_with_its_mtp_module_counts_682_6b_parameters_685b_with_its_checkpoints_copies():
    """DeepSeek-V3's MTP module (Hugging Face's model.layers.61): enorm, hnorm, eh_proj 7168 x 14336, an MoE decoder
    layer and shared_head.norm: 11.61B, stored with copies of the embedding and the head (DeepSeek's "14B", and
    685B in all); we count the shared ones once. A token passes through the depth's 8 routed experts and its shared
    one: 0.69B more active than the 37.55B of the model (which DeepSeek quotes without MTP). FLOPs per token of
    training at 4K: Megatron-LM's with the depth, less the router and the latent norms it leaves out and counts."""
    config, _ = parse_args(DEEPSEEK_V3 + ["--mtp-num-layers", "1"], world_size=1)
    m, h, v = config.model, 7168, 129280
    attention, expert = 187_107_328, 3 * 2048 * h
    moe = attention + 2 * h + 256 * h + 256 * expert + expert
    depth = 3 * h + 2 * h * h + moe
    assert sum(arithmetic.mtp_tensors(m)) == depth == 11_610_067_968
    assert arithmetic.total_parameters(config) == 671_026_404_352 + depth == 682_636_472_320
    assert round((671_026_404_352 + depth + 2 * v * h) / 1e9) == 684  # 684.5B: DeepSeek's "685B"
    assert arithmetic.active_parameters(config) == 37_552_282_624 + depth - 248 * expert == 38_240_382_976
    training = 3 * (sum(arithmetic.layer_forward_flops(m, causal=True, layer_number=n) for n in range(1, 62))
                    + arithmetic.mtp_forward_flops(m, causal=True) + 2 * arithmetic.head_forward_flops(m))
    megatron = 3 * (62 * megatron_lm_mla_attention_flops(m) + 2 * h * (3 * 3 * 18432 + 59 * 9 * 3 * 2048)
                    + 2 * (3 * h + 2 * h * h) + 2 * 2 * h * v)
    assert training == pytest.approx(megatron + 3 * 59 * 2 * h * 256 - 3 * 62 * 2 * (1536 + 512) - 3 * 2 * 3 * h)
    assert round(megatron / 1e9, 1) == 260.0 and round(training / 1e9, 1) == 260.6
    assert arithmetic.training_flops_per_token(m) == pytest.approx(training)  # MFU's
    assert round(arithmetic.training_flops_per_token(m, causal=False) / 1e9, 1) == 291.8  # every key
