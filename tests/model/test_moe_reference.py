"""Our MoE layer (model/moe.py's MoELayer, model/router.py's TopKRouter) against MoE blocks that are not ours:
transformers' Mixtral, DeepSeek-V3 and Qwen2-MoE sparse blocks. Each HF block is given random weights, they
are copied into our layer, and both run on the same input: the output and the input's gradient (which also
carries the router's gradient: the routing weights depend on x) agree to 1e-5 relative in fp32.

transformers 5 stores a block's routed experts fused: experts.gate_up_proj [E, 2I, h] (each expert's gate rows,
then its up rows, nn.Linear's [out, in]) and experts.down_proj [E, h, I], which is our GroupedExperts'
weight1 [E, 2F, h] ([gate; up]) and weight2 [E, h, F] as they are. Its dense MLPs (the shared experts) hold
gate_proj, up_proj and down_proj apart; our ParallelMLP's dense_h_to_4h is [gate; up] stacked.

The HF experts run with experts_implementation="eager", the plain loop over experts (one index_add_ per
expert), an independent computation from our dispatch / combine.
"""
import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.model.moe import MoELayer

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock  # noqa: E402

BATCH, SEQ, HIDDEN = 2, 16, 32
EXPERTS, FFN = 8, 16
TOLERANCE = 1e-5

BASE = ["--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads", "4", "--seq-length", str(SEQ),
        "--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", "1", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--swiglu", "--disable-bias-linear", "--num-experts", str(EXPERTS),
        "--moe-ffn-hidden-size", str(FFN)]

MIXTRAL = ["--moe-router-topk", "2"]  # softmax scoring, top-k of the logits then softmax over the k
DEEPSEEK_SHARED, DEEPSEEK_GROUPS, DEEPSEEK_GROUP_TOPK, DEEPSEEK_TOPK, DEEPSEEK_SCALE = 2, 4, 2, 3, 2.5
DEEPSEEK = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
            "--moe-router-num-groups", str(DEEPSEEK_GROUPS), "--moe-router-group-topk", str(DEEPSEEK_GROUP_TOPK),
            "--moe-router-topk", str(DEEPSEEK_TOPK), "--moe-router-topk-scaling-factor", str(DEEPSEEK_SCALE),
            "--moe-shared-expert-intermediate-size", str(DEEPSEEK_SHARED * FFN)]
QWEN_SHARED = 24
QWEN2_MOE = ["--moe-router-topk", "2", "--moe-router-pre-softmax",
             "--moe-shared-expert-intermediate-size", str(QWEN_SHARED), "--moe-shared-expert-gate"]


def our_layer(flags):
    """Our MoE layer, single process (TP = EP = 1), in eval mode: no aux-loss gradient, no load counting."""
    config = parse_args(flags + BASE, world_size=1)[0]
    return MoELayer(config.model).eval()


def randomised(block, seed, router_std=0.5, std=0.2):
    """Every HF parameter drawn afresh (their experts start as torch.empty, their router at zero); a wide
    router so that the tokens spread over the experts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (router_std if name.startswith("gate.") else std))
    return block.eval()


def load_routed(ours, hf_block):
    """HF router and fused experts -> ours, unchanged layouts (see the module docstring)."""
    with torch.no_grad():
        ours.router.weight.copy_(hf_block.gate.weight)
        ours.experts.weight1.copy_(hf_block.experts.gate_up_proj)
        ours.experts.weight2.copy_(hf_block.experts.down_proj)


def load_shared(ours, hf_mlp):
    with torch.no_grad():
        ours.shared_expert.dense_h_to_4h.weight.copy_(torch.cat([hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight]))
        ours.shared_expert.dense_4h_to_h.weight.copy_(hf_mlp.down_proj.weight)


def random_input(seed=11):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=g), torch.randn(BATCH, SEQ, HIDDEN, generator=g)


def output_and_input_gradient(module, x, probe):
    """module(x) and d/dx of (module(x) * probe).sum(): a random probe, so every output element counts."""
    x = x.clone().requires_grad_(True)
    out = module(x)
    (out * probe).sum().backward()
    return out.detach(), x.grad


def relative_error(theirs, ours):
    return ((theirs - ours).abs().max() / ours.abs().max()).item()


def assert_same_as(ours, hf_block, seed=11):
    x, probe = random_input(seed)
    out, grad = output_and_input_gradient(ours, x, probe)
    hf_out, hf_grad = output_and_input_gradient(hf_block, x, probe)
    assert relative_error(hf_out, out) <= TOLERANCE
    assert relative_error(hf_grad, grad) <= TOLERANCE
    # The weights' gradients too: the router's (through the routing weights only) and the experts'.
    assert relative_error(hf_block.gate.weight.grad, ours.router.weight.grad) <= TOLERANCE
    assert relative_error(hf_block.experts.gate_up_proj.grad, ours.experts.weight1.grad) <= TOLERANCE
    assert relative_error(hf_block.experts.down_proj.grad, ours.experts.weight2.grad) <= TOLERANCE


def chosen_experts(ours, x):
    """[T, k] our router's choice, sorted per token (HF's top-k may order the k differently)."""
    with torch.no_grad():
        return ours.router(x.reshape(-1, HIDDEN), BATCH).indices.sort(dim=-1).values


def assert_routing_is_spread(indices):
    """A match where every token went to the same experts would not test the routing."""
    assert indices.unique().numel() >= EXPERTS - 1
    assert indices.unique(dim=0).shape[0] >= 8


# --- Mixtral: softmax, top-2, renormalised ------------------------------------------------------------------

def mixtral_block(seed=1):
    config = transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=EXPERTS,
                                        num_experts_per_tok=2, router_jitter_noise=0.0, hidden_act="silu",
                                        experts_implementation="eager")
    return randomised(MixtralSparseMoeBlock(config), seed)


def mixtral_pair(flags=MIXTRAL):
    hf = mixtral_block()
    ours = our_layer(flags)
    load_routed(ours, hf)
    return ours, hf


def test_moe_layer_equals_mixtral_sparse_block():
    ours, hf = mixtral_pair()
    assert_routing_is_spread(chosen_experts(ours, random_input()[0]))
    assert_same_as(ours, hf)


def test_the_mixtral_match_depends_on_renormalising():
    """Pre-softmax routing (the same experts, weights not renormalised over the two) is far from Mixtral: the
    tolerance tells the routing weights apart."""
    ours, hf = mixtral_pair(["--moe-router-pre-softmax"] + MIXTRAL)
    x, _ = random_input()
    with torch.no_grad():
        assert relative_error(hf(x), ours(x)) > 1e-2


def test_an_experts_weights_reach_exactly_the_tokens_routed_to_it():
    """Perturbing one expert moves our output for the tokens routed to it and for no other token: the experts
    are not mixed up, and the comparison above sees each expert's own weights."""
    ours, _ = mixtral_pair()
    x, _ = random_input()
    indices = chosen_experts(ours, x)
    expert = int(indices.reshape(-1).mode().values)
    routed_there = (indices == expert).any(-1)
    assert 0 < routed_there.sum() < routed_there.numel()
    with torch.no_grad():
        before = ours(x).reshape(-1, HIDDEN)
        ours.experts.weight2[expert] += 0.1
        moved = (ours(x).reshape(-1, HIDDEN) - before).abs().amax(-1)
    assert (moved[routed_there] > 1e-3).all()
    assert (moved[~routed_there] == 0).all()


# --- DeepSeek-V3: sigmoid, selection bias, group-limited top-k, scaling, shared experts ------------------

def deepseek_block(seed=2, bias_scale=0.1):
    config = transformers.DeepseekV3Config(
        hidden_size=HIDDEN, moe_intermediate_size=FFN, n_routed_experts=EXPERTS, num_experts_per_tok=DEEPSEEK_TOPK,
        n_group=DEEPSEEK_GROUPS, topk_group=DEEPSEEK_GROUP_TOPK, routed_scaling_factor=DEEPSEEK_SCALE,
        norm_topk_prob=True, n_shared_experts=DEEPSEEK_SHARED, hidden_act="silu", experts_implementation="eager")
    # A narrower router than the others': sigmoid scores away from 0 and 1, where the bias can reorder them.
    block = randomised(DeepseekV3MoE(config), seed, router_std=0.2)
    # A non-negative bias, so that every biased score stays positive (see the test).
    g = torch.Generator().manual_seed(seed + 100)
    block.gate.e_score_correction_bias.copy_(torch.rand(EXPERTS, generator=g) * bias_scale)
    return block


def deepseek_pair():
    hf = deepseek_block()
    ours = our_layer(DEEPSEEK)
    load_routed(ours, hf)
    load_shared(ours, hf.shared_experts)
    with torch.no_grad():
        ours.router.expert_bias.copy_(hf.gate.e_score_correction_bias)
    return ours, hf


def test_moe_layer_equals_deepseek_v3_moe():
    ours, hf = deepseek_pair()
    x, _ = random_input()
    with torch.no_grad():
        scores = torch.sigmoid(x.reshape(-1, HIDDEN) @ hf.gate.weight.T)
        biased = scores + hf.gate.e_score_correction_bias
        _, _, hf_indices = hf.gate(x)
    # Our group masking fills the dropped groups with -inf, as transformers 5.24 does; DeepSeek's own
    # modeling_deepseek.py (and older transformers) fills with 0.0. The two choose alike while every biased
    # score is positive, which the non-negative bias of deepseek_block ensures: the match holds for either.
    assert biased.min() > 0

    indices = chosen_experts(ours, x)
    assert_routing_is_spread(indices)
    assert torch.equal(indices, hf_indices.sort(dim=-1).values)
    # Both the group limit and the bias decide some tokens' experts here, so the match exercises both.
    ungrouped = biased.topk(DEEPSEEK_TOPK, dim=-1).indices.sort(dim=-1).values
    assert (indices != ungrouped).any(-1).any()
    assert (indices != grouped_choice(scores)).any(-1).any()

    assert_same_as(ours, hf)
    shared = hf.shared_experts
    gate_up_grad = torch.cat([shared.gate_proj.weight.grad, shared.up_proj.weight.grad])
    assert relative_error(gate_up_grad, ours.shared_expert.dense_h_to_4h.weight.grad) <= TOLERANCE
    assert relative_error(shared.down_proj.weight.grad, ours.shared_expert.dense_4h_to_h.weight.grad) <= TOLERANCE


def grouped_choice(scores):
    """DeepSeek-V3's group-limited top-k (sorted per token), written out here: applied to the unbiased
    scores, the choice the bias would leave alone."""
    grouped = scores.view(-1, DEEPSEEK_GROUPS, EXPERTS // DEEPSEEK_GROUPS)
    kept = grouped.topk(2, dim=-1).values.sum(-1).topk(DEEPSEEK_GROUP_TOPK, dim=-1).indices
    mask = torch.zeros(grouped.shape[:2], dtype=torch.bool).scatter_(1, kept, True)
    masked = grouped.masked_fill(~mask[..., None], float("-inf")).view(-1, EXPERTS)
    return masked.topk(DEEPSEEK_TOPK, dim=-1).indices.sort(dim=-1).values


# --- Qwen2-MoE: softmax over all experts, top-k not renormalised, sigmoid-gated shared expert ----------------

def qwen2_moe_block(seed=3):
    config = transformers.Qwen2MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=FFN, num_experts=EXPERTS,
                                         num_experts_per_tok=2, norm_topk_prob=False,
                                         shared_expert_intermediate_size=QWEN_SHARED, hidden_act="silu",
                                         experts_implementation="eager")
    return randomised(Qwen2MoeSparseMoeBlock(config), seed)


def test_moe_layer_with_pre_softmax_and_shared_gate_equals_qwen2_moe_sparse_block():
    hf = qwen2_moe_block()
    ours = our_layer(QWEN2_MOE)
    load_routed(ours, hf)
    load_shared(ours, hf.shared_expert)
    with torch.no_grad():
        ours.shared_expert_gate.copy_(hf.shared_expert_gate.weight)  # both [1, h]
    assert_routing_is_spread(chosen_experts(ours, random_input()[0]))

    assert_same_as(ours, hf)
    assert relative_error(hf.shared_expert_gate.weight.grad, ours.shared_expert_gate.grad) <= TOLERANCE
