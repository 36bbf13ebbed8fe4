"""An MoE layer with biases, as gpt-oss has them: the router's logits are x W^T + b (model/router.py), and each
expert's down-projection bias is inside the output its routing weight scales, y = sum_k w_k (expert_k(x) + b2_k).
Checked against a hand-written dense loop over tokens and against transformers' GptOssMLP; checkpoints of MoE
models with biases written before the router had a bias load as a zero bias, the same model."""
import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.model.moe import MoELayer
from megatron_lite.model.router import TopKRouter
from tests.model.gpt_layouts import tiny_config
from tests.model.test_gated_activations import GPT_OSS, gpt_oss_reference
from tests.parallel.reference import assert_matches

HIDDEN, EXPERTS, TOPK, FFN, TOKENS = 32, 4, 2, 16, 24
FLAGS = ("--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads", "4", "--seq-length", "8",
         "--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", "1", "--num-experts", str(EXPERTS),
         "--moe-router-topk", str(TOPK), "--moe-ffn-hidden-size", str(FFN)) + GPT_OSS
"""gpt-oss's MoE MLP in small: biases on every linear (no --disable-bias-linear), softmax over the top-k logits."""


def gpt_oss_layer(seed=5):
    """Our layer (TP = EP = 1, eval: no aux loss), every weight and bias drawn afresh, of std 1 (the clamp
    bites) and 0.5 for the router (the tokens spread over the experts)."""
    layer = MoELayer(parse_args(list(FLAGS), world_size=1)[0].model).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name.startswith("router") else 1.0))
    return layer


def dense_reference(layer, x):
    """The layer written out token by token: logits = x W^T + b, softmax over the top k, and each chosen
    expert's whole output, its down-projection bias included, times its weight."""
    r, e = layer.router, layer.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        top, chosen = (r.weight @ x[t] + r.bias).topk(TOPK)
        for w, i in zip(torch.softmax(top, dim=0), chosen):
            inner = e.weight1[i] @ x[t] + e.bias1[i]
            out[t] += w * (e.weight2[i] @ gpt_oss_reference(inner) + e.bias2[i])
    return out


def test_expert_output_bias_is_scaled_by_the_routing_weight_as_in_a_dense_reference():
    layer = gpt_oss_layer()
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ours, reference = layer(x.unsqueeze(0)).squeeze(0), dense_reference(layer, x)
        chosen = layer.router(x, 1).indices
    assert chosen.unique().numel() == EXPERTS  # every expert gets tokens
    assert_matches(ours, reference, "output")
    # The check tells the bias apart: added once per chosen expert, unweighted, it is far from ours.
    weights = layer.router(x, 1).weights.detach()
    unweighted = reference + ((1 - weights).unsqueeze(-1) * layer.experts.bias2[chosen]).sum(1).detach()
    assert (unweighted - ours).abs().max() > 0.1


def test_the_router_bias_moves_the_logits_and_gets_their_gradient():
    layer = gpt_oss_layer()
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7))
    before = layer.router(x, 1).indices
    with torch.no_grad():
        layer.router.bias[0] += 100.0  # expert 0 now wins every token's first choice
    after = layer.router(x, 1).indices
    assert (after[:, 0] == 0).all() and not (before[:, 0] == 0).all()
    layer(x.unsqueeze(0)).sum().backward()
    assert layer.router.bias.grad is not None and layer.router.bias.grad.abs().sum() > 0


def test_moe_layer_equals_transformers_gpt_oss_mlp():
    """transformers' GptOssMLP (router with bias, experts with gate_up interleaved by columns: gate = [..., ::2])
    with our layer's weights: the same output, input gradient and bias gradients."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    ours = gpt_oss_layer()
    hf = GptOssMLP(transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=EXPERTS,
                                             num_experts_per_tok=TOPK, experts_implementation="eager")).eval()
    e = ours.experts
    with torch.no_grad():
        hf.router.weight.copy_(ours.router.weight)
        hf.router.bias.copy_(ours.router.bias)
        gate_up = torch.empty_like(hf.experts.gate_up_proj)  # [E, h, 2F], gate and up columns interleaved
        gate_up[..., ::2], gate_up[..., 1::2] = e.weight1[:, :FFN].transpose(1, 2), e.weight1[:, FFN:].transpose(1, 2)
        hf.experts.gate_up_proj.copy_(gate_up)
        hf.experts.gate_up_proj_bias[:, ::2], hf.experts.gate_up_proj_bias[:, 1::2] = e.bias1[:, :FFN], e.bias1[:, FFN:]
        hf.experts.down_proj.copy_(e.weight2.transpose(1, 2))
        hf.experts.down_proj_bias.copy_(e.bias2)
    g = torch.Generator().manual_seed(8)
    x, probe = torch.randn(1, TOKENS, HIDDEN, generator=g), torch.randn(1, TOKENS, HIDDEN, generator=g)
    results = []
    for module, output in ((ours, lambda y: y), (hf, lambda y: y[0])):
        xi = x.clone().requires_grad_(True)
        (output(module(xi)) * probe).sum().backward()
        results.append((output(module(xi)).detach(), xi.grad))
    for what, theirs, mine in zip(("output", "input gradient"), results[1], results[0]):
        assert_matches(mine, theirs, what)
    assert_matches(ours.router.bias.grad, hf.router.bias.grad, "router bias gradient")
    assert_matches(e.bias2.grad, hf.experts.down_proj_bias.grad, "down-projection bias gradient")


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_router_bias_is_replicated_like_the_weight(sequence_parallel):
    config = parse_args(list(FLAGS), world_size=1)[0].model
    router = TopKRouter(config, sequence_parallel)
    for param in (router.weight, router.bias):
        assert not param.tensor_model_parallel and param.partition_dim == -1
        assert getattr(param, "sequence_parallel", False) == sequence_parallel
    assert router.bias.shape == (EXPERTS,) and (router.bias == 0).all()
    assert TopKRouter(parse_args(list(FLAGS) + ["--disable-bias-linear"], world_size=1)[0].model).bias is None


def test_a_checkpoint_written_before_the_router_had_a_bias_loads_as_the_same_model():
    """An MoE GPT with biases, its state dict without the routers' biases (what older versions saved): a fresh
    model loads it strictly, with zero router biases, and computes the saved model's loss; a saved bias loads
    as it is."""
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    config = tiny_config(extra=("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48"))
    saved = GPTModel(config).eval()
    old = {k: v for k, v in saved.state_dict().items() if not k.endswith("router.bias")}
    assert len(old) < len(saved.state_dict())
    torch.manual_seed(99)
    loaded = GPTModel(config).eval()
    with torch.no_grad():
        for name, p in loaded.named_parameters():
            if name.endswith("router.bias"):
                p.fill_(1.0)
    loaded.load_state_dict(old, strict=True)
    biases = [p for name, p in loaded.named_parameters() if name.endswith("router.bias")]
    assert len(biases) == config.model.num_layers and all((b == 0).all() for b in biases)
    model_parallel_seed(config.training.seed, config.model.num_layers)  # the forward's dropout streams (p = 0)
    tokens = torch.randint(0, config.model.vocab_size, (2, config.model.seq_length))
    args = (tokens, torch.arange(tokens.shape[1]).expand_as(tokens), tokens, torch.ones(tokens.shape))
    with torch.no_grad():
        assert torch.equal(loaded(*args), saved(*args))
    with_bias = dict(old, **{k: torch.full_like(v, 0.5) for k, v in saved.state_dict().items()
                             if k.endswith("router.bias")})
    loaded.load_state_dict(with_bias, strict=True)
    assert all((b == 0.5).all() for b in biases)


def test_gpt_oss_experts_with_router_bias_under_sequence_parallelism_match_the_dense_losses_at_tp2():
    """Each TP rank routes its own part of the sequence, so the router bias's gradient, like the weight's, is
    summed over TP (parallel/sequence_parallel.py); at a learning rate of 1e-2 the bias moves the losses."""
    from tests.model.test_moe_parallel import GELU_MOE, assert_matches, dense_reference, run_layout

    base = GELU_MOE + GPT_OSS + ("--lr", "1e-2")
    assert_matches(run_layout(2, 1, 1, 1, 1, ("--sequence-parallel",), base=base), dense_reference(base=base))
