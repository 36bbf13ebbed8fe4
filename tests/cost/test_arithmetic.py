"""cost/arithmetic.py against built models: parameters and stage splits at several TP x PP layouts,
and forward FLOPs against torch's own FLOP counter."""
import pytest
import torch

from megatron_lite.cost import arithmetic

from megatron_lite.model import recompute_options

from megatron_lite.cost import stages
from megatron_lite.model.moe_options import is_moe_layer
from tests.harness import run_distributed
from tests.model.gpt_layouts import tiny_config
from tests.model.test_llama_parallel import LLAMA  # SwiGLU, RMSNorm, 2 groups for 4 heads, no biases, RoPE
from tests.model.test_llama_parallel import QK_HEADS  # QK-norm, heads of 24 (not 64 / 4)

QWEN2 = LLAMA + ("--add-qkv-bias",)  # biases on the QKV linear alone
GPT_OSS = ("--quick-geglu", "--glu-linear-offset", "1", "--activation-func-clamp-value", "7", "--softmax-type",
           "learnable")
"""gpt-oss's MLP and attention sinks (softmax_offset, one per head) on GPT-2's block (biases everywhere)."""

VARIANTS = {"tied": (), "untied": ("--untie-embeddings-and-output-weights",), "rope": ("--position-embedding-type", "rope"),
            "uneven": ("--num-layers", "5", "--ffn-hidden-size", "96"), "llama": LLAMA,
            # one key/value group, with biases, LayerNorm and GeLU: each feature of the block on its own
            "mqa_with_biases": ("--group-query-attention", "--num-query-groups", "1"),
            "swiglu_tied": ("--swiglu",), "rmsnorm": ("--normalization", "RMSNorm"),
            "qwen3": LLAMA + QK_HEADS, "gpt2_qk": QK_HEADS, "qwen2": QWEN2, "gpt_oss": GPT_OSS}


def as_built(config, per_spec, placeholder=0):
    """`per_spec` (parameters, or tensors with placeholder []) as GPTModel's `layers` hold them (spec N is
    layers.N): the embedding module once, each later spec of it (the tied head, Multi-Token Prediction's
    embedding) a placeholder without parameters."""
    again = set(arithmetic.embedding_specs(config.model)[1:])
    return [placeholder if i in again else n for i, n in enumerate(per_spec)]


def _built_stage(tp, pp, extra):
    """This rank's stage of the pipeline module: (pp rank, tp rank, parameters, parts, layers per stage)."""
    import deepspeed
    import torch.distributed as dist

    from megatron_lite.cost.stages import pipeline_split
    from megatron_lite.model.gpt import build
    from megatron_lite.parallel import state

    config = tiny_config(tp, pp, 1, extra)
    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    state.initialize(tp, pp)
    module = build(config, state.get_topology(), pipeline_split(config))
    parameters = sum(p.numel() for p in module.parameters())
    return (state.get_pipeline_model_parallel_rank(), state.get_tensor_model_parallel_rank(), parameters,
            list(module.parts), list(module.layers_per_stage))


@pytest.mark.parametrize("tp, pp, variant", [(2, 2, "uneven"), (4, 1, "llama"), (2, 2, "qwen3")] + [  # the rest: slow
    pytest.param(*layout, marks=pytest.mark.slow) for layout in [
        (1, 1, "tied"), (2, 1, "tied"), (1, 2, "tied"), (2, 2, "tied"), (1, 4, "tied"), (2, 2, "untied"),
        (1, 2, "rope"), (1, 3, "uneven"), (2, 2, "llama"), (2, 1, "mqa_with_biases"), (4, 1, "mqa_with_biases")]])
def test_stage_bounds_and_parameters_per_rank_match_the_built_pipeline(tp, pp, variant):
    config = tiny_config(tp, pp, 1, VARIANTS[variant])
    bounds = stages.stage_bounds(config)
    expected = stages.stage_parameters(config, bounds)
    for stage, tp_rank, parameters, parts, layers in run_distributed(_built_stage, tp * pp, tp, pp, VARIANTS[variant]):
        assert parts == bounds, f"stage {stage}"
        assert layers == stages.transformer_layers_per_stage(config, bounds)
        assert parameters == expected[stage], f"stage {stage} tp rank {tp_rank}: built {parameters}, counted {expected[stage]}"


def test_llama_parameters_and_flops_are_counted_by_hand():
    """h 64, 4 heads of 16, 2 groups, f 96, V 128, s 32, 4 layers: QKV (4 + 2 x 2) 16 x 64, projection
    64 x 64, SwiGLU 2 x 96 x 64 + 64 x 96, two RMSNorms 64 each, no biases; final RMSNorm 64; untied head."""
    config = tiny_config(1, 1, 1, LLAMA)
    layer = 8 * 16 * 64 + 64 * 64 + 3 * 96 * 64 + 2 * 64
    assert arithmetic.spec_parameters(config) == [128 * 64] + [layer] * 4 + [64, 128 * 64]
    assert arithmetic.total_parameters(config) == 2 * 128 * 64 + 4 * layer + 64
    # Per TP rank at TP 4, the 2 groups shared by 2 ranks each: every split matrix by 4, the norms whole.
    assert arithmetic.spec_parameters(config, tp=4)[1] == (8 * 16 * 64 + 64 * 64 + 3 * 96 * 64) // 4 + 2 * 64
    # Forward FLOPs per token: 2 per multiply-add of each matmul (the keys and values are 2 x 2 x 16 wide,
    # not 2 x 64), and the attention's two matmuls over all 32 keys of every query head.
    matmuls = 8 * 16 * 64 + 64 * 64 + 3 * 96 * 64
    assert arithmetic.layer_forward_flops(config.model, causal=False) == 2 * matmuls + 4 * 32 * 64


def test_qkv_bias_alone_adds_the_qkv_rows_to_each_layer_split_over_tp():
    """The Llama block above with --add-qkv-bias: one bias of (4 + 2 x 2) 16 rows per layer, split as the QKV
    weight's rows; the projection and the MLP keep none."""
    llama, qwen2 = tiny_config(1, 1, 1, LLAMA), tiny_config(1, 1, 1, QWEN2)
    for tp in (1, 2, 4):
        assert arithmetic.layer_tensors(qwen2.model, tp) == arithmetic.layer_tensors(llama.model, tp)[:2] + [
            8 * 16 // tp] + arithmetic.layer_tensors(llama.model, tp)[2:]
    assert arithmetic.total_parameters(qwen2) == arithmetic.total_parameters(llama) + 4 * 8 * 16
    # With biases everywhere the flag adds nothing.
    gpt2 = tiny_config(extra=("--add-qkv-bias",))
    assert arithmetic.total_parameters(gpt2) == arithmetic.total_parameters(tiny_config())


def test_qwen3_attention_parameters_and_flops_are_counted_by_hand():
    """As the Llama block above but heads of 24 with QK-norm: QKV (4 + 2 x 2) 24 x 64, projection 64 x 4 x 24,
    the two QK-norms' weights (24 each, whole on every TP rank); attention's matmuls over 4 heads of 24."""
    config = tiny_config(1, 1, 1, LLAMA + QK_HEADS)
    matmuls = 8 * 24 * 64 + 64 * 96 + 3 * 96 * 64
    layer = matmuls + 2 * 64 + 2 * 24
    assert arithmetic.spec_parameters(config) == [128 * 64] + [layer] * 4 + [64, 128 * 64]
    assert arithmetic.spec_parameters(config, tp=2)[1] == matmuls // 2 + 2 * 64 + 2 * 24
    assert arithmetic.layer_forward_flops(config.model, causal=False) == 2 * matmuls + 4 * 32 * 96
    assert arithmetic.attention_core_forward_flops(config.model) == 4 * 32 * 96
    gpt2 = tiny_config(1, 1, 1, QK_HEADS).model  # LayerNorm's QK-norm: weight and bias of 24 each
    assert arithmetic.qk_norm_tensors(gpt2) == [24] * 4 and arithmetic.qk_norm_tensors(config.model) == [24] * 2


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_total_parameters_and_each_spec_match_the_dense_model(variant):
    from megatron_lite.model.gpt import GPTModel

    config = tiny_config(1, 1, 1, VARIANTS[variant])
    model = GPTModel(config)
    assert sum(p.numel() for p in model.parameters()) == arithmetic.total_parameters(config)
    built = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    per_spec = arithmetic.spec_parameters(config)
    # model.layers holds the tied embedding once: a tied head is a placeholder without parameters.
    tied = "--untie-embeddings-and-output-weights" not in VARIANTS[variant]
    assert built == as_built(config, per_spec)
    # Tensor by tensor too (what ZeRO 3 partitions or keeps whole, memory.py).
    tensors = [sorted(p.numel() for p in layer.parameters()) for layer in model.layers][:len(model.layers) - tied]
    assert tensors == [sorted(t) for t in arithmetic.spec_tensors(config)][:len(model.layers) - tied]
    assert [c.parameters for c in stages.spec_costs(config)][:-1] == per_spec[:-1]
    # `type:<regex>` partitioning matches the costs' names against the built classes.
    names = [c.name for c in stages.spec_costs(config)]
    assert names[:len(model.layers) - tied] == [type(layer).__name__ for layer in model.layers][:len(model.layers) - tied]


def _dense_parameters_at_tp(tp, variant):
    """This TP rank's parameters of the whole model (PP 1) and the per-spec split."""
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel import state

    config = tiny_config(tp, 1, 1, VARIANTS[variant])
    state.initialize(tp, 1)
    model = GPTModel(config)
    return [sum(p.numel() for p in layer.parameters()) for layer in model.layers]


@pytest.mark.parametrize("variant", ["llama", pytest.param("mqa_with_biases", marks=pytest.mark.slow),
                                     pytest.param("qwen2", marks=pytest.mark.slow),
                                     pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_each_specs_parameters_per_tp_rank_match_the_built_model_with_groups_shared_by_ranks(variant):
    """TP 4 with 2 (or 1) key/value groups: each rank holds a 1/4 piece of the K and V rows (parallel/qkv.py)."""
    config = tiny_config(4, 1, 1, VARIANTS[variant])
    per_spec = arithmetic.spec_parameters(config)
    for built in run_distributed(_dense_parameters_at_tp, 4, 4, variant):
        assert built == as_built(config, per_spec)


@pytest.mark.parametrize("variant", ["tied", "uneven", "llama", "mqa_with_biases", "qwen3", "gpt_oss"])
def test_forward_flops_per_token_match_torchs_flop_counter(variant):
    """Megatron's accounting (attention over all s keys), as torch counts the dense model's matmuls."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    config = tiny_config(1, 1, 1, VARIANTS[variant] + ("--attention-backend", "fused"))
    m = config.model
    model = GPTModel(config).eval()
    model_parallel_seed(config.training.seed, m.num_layers)
    b, s = 2, m.seq_length
    tokens = torch.randint(0, m.vocab_size, (b, s))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(tokens, torch.arange(s).expand(b, s))
    counted = counter.get_total_flops() / (b * s)
    forward = m.num_layers * arithmetic.layer_forward_flops(m, causal=False) + arithmetic.head_forward_flops(m)
    assert counted == pytest.approx(forward, rel=1e-6)
    assert arithmetic.training_flops_per_token(m, causal=False) == pytest.approx(3 * forward)


RECOMPUTE = {"selective": ("--recompute-granularity", "selective"),
             "full": ("--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "2"),
             "block": ("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1")}


@pytest.mark.parametrize("block", ["gpt2", "llama", "qwen3"])
@pytest.mark.parametrize("recompute", [None, "selective", "full", "block"])
def test_training_flops_per_token_match_torchs_flop_counter_over_forward_backward_and_recompute(recompute, block):
    """Forward, backward (two matmuls per forward matmul) and what recompute runs again, counted by torch."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    llama = {"gpt2": (), "llama": LLAMA, "qwen3": LLAMA + QK_HEADS}[block]
    config = tiny_config(1, 1, 1, ("--attention-backend", "fused") + llama + RECOMPUTE.get(recompute, ()))
    m = config.model
    model = GPTModel(config).train()
    model_parallel_seed(config.training.seed, m.num_layers)
    b, s = 2, m.seq_length
    tokens = torch.randint(0, m.vocab_size, (b, s))
    with FlopCounterMode(display=False) as counter:
        model(tokens, torch.arange(s).expand(b, s), tokens, torch.ones(b, s)).backward()
    counted = counter.get_total_flops() / (b * s)
    assert counted == pytest.approx(arithmetic.training_flops_per_token(m, causal=False), rel=1e-6)
    # What recompute adds, by hand: torch's checkpoint does not rerun a region's last matmul (nothing keeps
    # its output): selective reruns the scores (half the attention core), full each chunk but its last
    # MLP projection (2 chunks of 2 layers, or the first layer under block 1).
    layer, projection = arithmetic.layer_forward_flops(m, causal=False), 2 * m.hidden_size * m.ffn_hidden_size
    added = {None: 0, "selective": m.num_layers * arithmetic.attention_core_forward_flops(m) / 2,
             "full": m.num_layers * layer - 2 * projection, "block": layer - projection}[recompute]
    assert arithmetic.recompute_forward_flops_per_token(m, causal=False) == pytest.approx(added)


@pytest.mark.parametrize("recompute", [None, "selective", "full", "block"])
def test_logged_training_flops_count_the_causal_half_of_the_attention_core_run_or_rerun(recompute):
    """TFLOP/s and MFU count attention as Megatron-LM does, over the s/2 keys a token attends to: in the forward,
    both backward matmuls and what recompute runs again; every other matmul as torch counts it (above)."""
    m = tiny_config(1, 1, 1, RECOMPUTE.get(recompute, ())).model
    core, scores = arithmetic.attention_core_forward_flops(m), arithmetic.attention_scores_forward_flops(m)
    rerun = {None: 0, "selective": m.num_layers * scores, "full": m.num_layers * core, "block": core}[recompute]
    every_key = arithmetic.training_flops_per_token(m, causal=False)
    halved = (3 * m.num_layers * core + rerun) / 2
    assert arithmetic.training_flops_per_token(m) == pytest.approx(every_key - halved)
    assert arithmetic.recompute_forward_flops_per_token(m, causal=True) == pytest.approx(
        arithmetic.recompute_forward_flops_per_token(m, causal=False) - rerun / 2)


def test_block_recompute_counts_its_layers_on_every_pipeline_stage():
    config = tiny_config(1, 2, 1, RECOMPUTE["block"])
    m = config.model
    layer = arithmetic.layer_forward_flops(m, causal=False) - 2 * m.hidden_size * m.ffn_hidden_size
    assert arithmetic.recompute_forward_flops_per_token(m, [2, 2], causal=False) == pytest.approx(2 * layer)
    assert recompute_options.recompute_chunks("uniform", 3, 4) == [(0, 3, True), (3, 4, True)]
    assert recompute_options.recompute_chunks("block", 3, 4) == [(0, 1, True), (1, 2, True), (2, 3, True), (3, 4, False)]
    assert recompute_options.recompute_chunks("block", 5, 2) == [(0, 1, True), (1, 2, True)]


def test_profile_needs_measured_seconds_unless_estimating():
    config = tiny_config(1, 2, 1, ("--pipeline-partition-method", "profile"))
    with pytest.raises(ValueError, match="profile needs the measured seconds"):
        stages.stage_bounds(config)
    assert stages.stage_bounds(config, estimate=True) == stages.stage_bounds(
        config.replace(parallel__pipeline_partition_method="cost"))
    # Measured seconds that make the head expensive move layers off the last stage.
    seconds = [0.0] + [1.0] * config.model.num_layers + [0.0, 10.0]
    assert stages.stage_bounds(config, seconds) == [0, 4, 7]  # 3 layers, then 1 layer + head
    assert stages.stage_bounds(config.replace(parallel__pipeline_partition_method="uniform")) == [0, 3, 7]


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_documents_attended_one_by_one_count_only_their_attention_in_the_training_flops(recompute, monkeypatch):
    """The blocks between documents are skipped, and the FLOPs behind TFLOP/s and MFU leave them out: the
    attention share the layers record (AttentionWork) scales the attention matmuls, as torch counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_lite.model import attention_mask
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    monkeypatch.setattr(attention_mask, "SEGMENTS_PER_TOKEN", 1.0)
    config = tiny_config(1, 1, 1, ("--attention-backend", "fused", "--reset-attention-mask")
                         + RECOMPUTE.get(recompute, ()))
    m = config.model
    model = GPTModel(config).train()
    model_parallel_seed(config.training.seed, m.num_layers)
    b, s = 2, m.seq_length
    tokens = torch.randint(0, m.vocab_size, (b, s))
    documents = torch.tensor([[0] * 5 + [1] * 20 + [2] * 7, [0] * 16 + [1] * 16], dtype=torch.int32)
    attention_mask.ATTENTION_WORK.take()
    with FlopCounterMode(display=False) as counter:
        model(tokens, torch.arange(s).expand(b, s), tokens, torch.ones(b, s), document_ids=documents).backward()
    share = attention_mask.ATTENTION_WORK.take()
    assert share == pytest.approx((5 ** 2 + 20 ** 2 + 7 ** 2 + 2 * 16 ** 2) / (2 * 32 ** 2))
    counted = counter.get_total_flops() / (b * s)
    # Selective recompute reruns x V for every document but the micro-batch's last, which the count includes.
    last = 2 * 16 ** 2 * m.hidden_size * m.num_layers / (b * s) if recompute == "selective" else 0
    every_key = arithmetic.training_flops_per_token(m, attention_share=share, causal=False)
    assert counted == pytest.approx(every_key - last, rel=1e-6)
    assert counted < arithmetic.training_flops_per_token(m, causal=False)
    # The logged count halves what the share leaves: the causal half of each document's square, forward, backward
    # and rerun alike.
    rerun = {None: 0, "selective": m.num_layers, "full": m.num_layers}[recompute]
    halved = (3 * m.num_layers + rerun) * arithmetic.attention_core_forward_flops(m) * share / 2
    assert arithmetic.training_flops_per_token(m, attention_share=share) == pytest.approx(every_key - halved)


EXPERTS = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48")
MOE_VARIANTS = {
    # GPT-2's block (GeLU, biases: each expert has two) with a gated shared expert, every layer MoE
    "gelu_gated_shared": EXPERTS + ("--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate"),
    # the Llama block (SwiGLU, no biases) with an ungated shared expert, the first layer dense
    "swiglu_shared": LLAMA + EXPERTS + ("--moe-shared-expert-intermediate-size", "64",
                                        "--moe-layer-freq", "([0]*1+[1]*3)"),
    # routed experts only, every other layer MoE (layers 1 and 3)
    "routed_only": EXPERTS + ("--moe-layer-freq", "2", "--moe-router-topk", "1"),
    # gpt-oss's: quick-GeGLU experts with biases, a router with a bias, attention sinks, every layer MoE
    "gpt_oss": EXPERTS + GPT_OSS,
}


def _expert_modules(model):
    from megatron_lite.model.moe import GroupedExperts

    return [module for module in model.modules() if isinstance(module, GroupedExperts)]


def assert_counts_match_the_built_model(config):
    """The whole model's parameters, each spec's and each spec's tensors equal the dense GPTModel's; the model."""
    from megatron_lite.model.gpt import GPTModel

    model = GPTModel(config)
    assert sum(p.numel() for p in model.parameters()) == arithmetic.total_parameters(config)
    per_spec = arithmetic.spec_parameters(config)
    assert [sum(p.numel() for p in layer.parameters()) for layer in model.layers] == as_built(config, per_spec)
    tensors = [sorted(p.numel() for p in layer.parameters()) for layer in model.layers]
    assert tensors == as_built(config, [sorted(t) for t in arithmetic.spec_tensors(config)], [])
    return model


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_moe_parameters_per_layer_and_in_total_match_the_built_model(variant):
    """Router, all E experts, shared expert and gate, layer by layer and tensor by tensor, at EP 1."""
    config = tiny_config(1, 1, 1, MOE_VARIANTS[variant])
    model = assert_counts_match_the_built_model(config)
    assert [c.parameters for c in stages.spec_costs(config)][:-1] == arithmetic.spec_parameters(config)[:-1]
    assert len(_expert_modules(model)) == arithmetic.moe_layers(config.model)


def test_a_rank_holds_half_the_experts_at_ep2():
    """Counted without building at EP 2: every MoE layer holds E/2 of the experts the EP 1 model built has
    (their stacked tensors' first dimension), the rest of the layer whole."""
    from megatron_lite.model.gpt import GPTModel

    extra = MOE_VARIANTS["swiglu_shared"] + ("--expert-model-parallel-size", "2")
    config = tiny_config(1, 1, 2, extra)
    model = GPTModel(tiny_config(1, 1, 1, MOE_VARIANTS["swiglu_shared"]))
    experts = {id(p) for module in _expert_modules(model) for p in module.parameters()}
    built = [sum(p.numel() // (2 if id(p) in experts else 1) for p in layer.parameters()) for layer in model.layers]
    assert built == arithmetic.spec_parameters(config)
    # 3 MoE layers x 2 of 4 experts: (2 x 48 + 48) x 64 elements each (SwiGLU, no biases)
    assert stages.stage_expert_parameters(config, [0, 7]) == [3 * 2 * 3 * 48 * 64]
    halves = sum(arithmetic.spec_parameters(config, ep=1)) - sum(arithmetic.spec_parameters(config))
    assert halves == 3 * 2 * 3 * 48 * 64
    assert arithmetic.total_parameters(config) == sum(p.numel() for p in model.parameters())  # all experts, once


def _built_at_ep(extra):
    import torch.distributed as dist

    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel import state

    state.initialize(1, 1, expert_model_parallel_size=2)
    model = GPTModel(tiny_config(1, 1, 2, extra))
    return dist.get_rank(), [sum(p.numel() for p in layer.parameters()) for layer in model.layers]


def test_each_specs_parameters_per_rank_match_the_model_built_at_ep2():
    extra = MOE_VARIANTS["gelu_gated_shared"] + ("--expert-model-parallel-size", "2")
    config = tiny_config(1, 1, 2, extra)
    for rank, built in run_distributed(_built_at_ep, 2, extra):
        assert built == as_built(config, arithmetic.spec_parameters(config)), f"rank {rank}"


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_active_parameters_are_those_a_token_gets_a_gradient_through(variant):
    """One token through the model: the expert slices whose gradient is not zero are the k it was routed
    to in each MoE layer; everything else counts whole (embedding rows included, as "active" is quoted)."""
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    config = tiny_config(1, 1, 1, MOE_VARIANTS[variant])
    model = GPTModel(config).train()
    model_parallel_seed(config.training.seed, config.model.num_layers)
    token = torch.tensor([[5]])
    model(token, torch.zeros_like(token), token, torch.ones(1, 1)).backward()
    experts = {id(p) for module in _expert_modules(model) for p in module.parameters()}
    touched = sum(p.numel() for p in model.parameters() if id(p) not in experts)
    for module in _expert_modules(model):
        for e in range(module.weight1.shape[0]):
            if module.weight1.grad[e].abs().sum() > 0:
                touched += sum(p[e].numel() for p in module.parameters())
    assert touched == arithmetic.active_parameters(config)
    assert arithmetic.active_parameters(config) < arithmetic.total_parameters(config)


def _counted_flops(config, backward):
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    m = config.model
    model = GPTModel(config).train()
    model_parallel_seed(config.training.seed, m.num_layers)
    b, s = 2, m.seq_length
    tokens = torch.randint(0, m.vocab_size, (b, s))
    with FlopCounterMode(display=False) as counter:
        if backward:
            model(tokens, torch.arange(s).expand(b, s), tokens, torch.ones(b, s)).backward()
        else:
            with torch.no_grad():
                model(tokens, torch.arange(s).expand(b, s))
    return counter.get_total_flops() / (b * s), model


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
@pytest.mark.parametrize("recompute", [None, "full", "block"])
def test_moe_training_flops_count_the_k_routed_experts_as_torchs_flop_counter_does(variant, recompute):
    """Dropless routing: every token through k experts, whatever the balance, so torch counts exactly the
    active FLOPs: router 2hE, k experts, the weighted sum 2hk, the shared expert and its gate; recompute
    reruns each chunk but the MLP's last matmul (the shared expert's projection, or the weighted sum)."""
    config = tiny_config(1, 1, 1, MOE_VARIANTS[variant] + ("--attention-backend", "fused")
                         + RECOMPUTE.get(recompute, ()))
    m = config.model
    counted, _ = _counted_flops(config, backward=True)
    assert counted == pytest.approx(arithmetic.training_flops_per_token(m, causal=False), rel=1e-6)
    if recompute is None:
        forward, _ = _counted_flops(config, backward=False)
        layers = sum(arithmetic.layer_forward_flops(m, False, layer_number=i) for i in range(1, m.num_layers + 1))
        assert forward == pytest.approx(layers + arithmetic.head_forward_flops(m), rel=1e-6)
        # The dense model of the same width with k experts' MLPs would cost this much less than E experts'.
        dense = arithmetic.layer_forward_flops(m, False)
        moe = [i for i in range(1, m.num_layers + 1) if is_moe_layer(m, i)]
        assert arithmetic.layer_forward_flops(m, False, layer_number=moe[0]) - dense == pytest.approx(
            arithmetic.moe_forward_flops(m) - arithmetic.mlp_forward_flops(m))


def test_pipeline_stage_costs_use_each_moe_layers_own_cost():
    """An MoE first layer (8 experts of 192, top-4) and three dense ones: each layer's cost is what torch counts
    running it (less half the attention: causal), so the cost split gives the MoE layer a stage of its own
    where the dense model's puts three layers first."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    extra = ("--num-experts", "8", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "192",
             "--moe-layer-freq", "([1]*1+[0]*3)", "--attention-backend", "fused")
    config = tiny_config(1, 1, 1, extra)
    m = config.model
    model = GPTModel(config).train()
    model_parallel_seed(config.training.seed, m.num_layers)
    x = torch.randn(1, m.seq_length, m.hidden_size)
    costs = stages.spec_costs(config)
    for i in range(1, m.num_layers + 1):
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model.layers[i](x)
        half_attention = 2 * m.seq_length * m.hidden_size
        assert costs[i].flops == pytest.approx(counter.get_total_flops() / m.seq_length - half_attention)
    assert costs[1].flops > 2 * costs[2].flops and costs[2].flops == costs[3].flops == costs[4].flops
    assert stages.stage_bounds(tiny_config(1, 2, 1, extra)) == [0, 2, 7]
    assert stages.stage_bounds(tiny_config(1, 2, 1)) == [0, 3, 7]
