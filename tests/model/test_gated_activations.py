"""The gated MLP activations (model/activation.py) against the formula and against transformers' gpt-oss experts:
--quick-geglu with --glu-linear-offset and --activation-func-clamp-value is gpt-oss's
    gate = min(gate, c), up = clamp(up, -c, c), out = gate sigmoid(1.702 gate) (up + offset);
no gradient flows where the clamp bites; ParallelMLP computes the same at TP 2 as at TP 1; and the Function
behind it keeps only its input for backward (the cost model's 3 e bsf / t, cost/activations.py)."""
import pytest
import torch
import torch.nn.functional as F

from megatron_lite.arguments import parse_args
from megatron_lite.model.activation import mlp_activation
from megatron_lite.model.mlp import ParallelMLP
from tests.harness import run_distributed
from tests.parallel.reference import assert_matches, rank_slice

HIDDEN, FFN, SEED = 32, 16, 1234
GPT_OSS = ("--quick-geglu", "--glu-linear-offset", "1", "--activation-func-clamp-value", "7")
BASE = ("--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads", "4", "--seq-length", "8",
        "--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", "1", "--ffn-hidden-size", str(FFN))


def model_config(flags, tp=1):
    argv = BASE + tuple(flags) + ("--tensor-model-parallel-size", str(tp))
    return parse_args(list(argv), world_size=tp)[0].model


def gpt_oss_reference(x, alpha=1.702, limit=7.0, offset=1.0):
    """transformers' GptOssExperts._apply_gate on [gate | up] halves (theirs interleaves them; ours are halves)."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + offset) * glu


def wide_input(*shape, seed=0):
    """Values of std 6: a good share beyond +-7, so the clamp bites on both halves."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 6


def value_and_gradient(fn, x, probe):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    (y * probe).sum().backward()
    return y.detach(), x.grad


def test_quick_geglu_with_offset_and_clamp_is_gpt_oss_formula_in_value_and_gradient():
    x = wide_input(64, 2 * FFN)
    probe = torch.randn(64, FFN, dtype=torch.float64)
    ours, ours_grad = value_and_gradient(mlp_activation(model_config(GPT_OSS)), x, probe)
    theirs, theirs_grad = value_and_gradient(gpt_oss_reference, x, probe)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("flags, act", [
    (("--quick-geglu",), lambda g: g * torch.sigmoid(1.702 * g)),
    (("--swiglu", "--glu-linear-offset", "0.5", "--activation-func-clamp-value", "3"), F.silu),
])
def test_each_gated_unit_is_its_formula_with_or_without_clamp_and_offset(flags, act):
    x, probe = wide_input(16, 2 * FFN, seed=1), torch.randn(16, FFN, dtype=torch.float64)
    config = model_config(flags)
    c, offset = config.activation_func_clamp_value, config.glu_linear_offset

    def reference(x):
        gate, up = x.chunk(2, dim=-1)
        if c is not None:
            gate, up = gate.clamp(max=c), up.clamp(-c, c)
        return act(gate) * (up + offset)

    ours, theirs = value_and_gradient(mlp_activation(config), x, probe), value_and_gradient(reference, x, probe)
    for mine, expected in zip(ours, theirs):
        torch.testing.assert_close(mine, expected, rtol=1e-12, atol=1e-12)


def test_plain_swiglu_and_gelu_are_computed_as_before():
    """Bitwise what ParallelMLP computed before model/activation.py: silu(gate) * up, and F.gelu."""
    x = torch.randn(8, 2 * FFN)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(mlp_activation(model_config(("--swiglu",)))(x), F.silu(gate) * up)
    assert torch.equal(mlp_activation(model_config(()))(x), F.gelu(x))
    assert torch.equal(mlp_activation(model_config(("--openai-gelu",)))(x), F.gelu(x, approximate="tanh"))


def test_no_gradient_flows_where_the_clamp_bites():
    x = wide_input(256, 2 * FFN, seed=2)
    _, grad = value_and_gradient(mlp_activation(model_config(GPT_OSS)), x, torch.ones(256, FFN, dtype=torch.float64))
    gate, up = x.chunk(2, dim=-1)
    grad_gate, grad_up = grad.chunk(2, dim=-1)
    clamped_gate, clamped_up = gate > 7, up.abs() > 7
    assert clamped_gate.float().mean() > 0.05 and clamped_up.float().mean() > 0.1  # the clamp is exercised
    assert (grad_gate[clamped_gate] == 0).all() and (grad_up[clamped_up] == 0).all()
    # Elsewhere the gradient flows: the up half's is the activation, nonzero for any gate other than 0.
    assert (grad_up[~clamped_up] != 0).all()
    assert (grad_gate[~clamped_gate & (up > -1)] != 0).all()  # up + 1 = 0 only at up = -1


def test_the_gated_unit_keeps_only_its_input_for_backward():
    """What the cost model books for --quick-geglu (3 e bsf / t with the product the next linear keeps): the
    [.., 2f] input alone, where autograd through the formula keeps the clamped halves, sigmoid and product too."""
    x = torch.randn(4, 2 * FFN, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        mlp_activation(model_config(GPT_OSS))(x)
    assert len(saved) == 1 and saved[0] is x


def test_parallel_mlp_equals_transformers_gpt_oss_expert():
    """One GptOssExperts expert (every token routed to it with weight 1) holds the MLP ParallelMLP builds with
    gpt-oss's flags and biases: its gate_up_proj [h, 2I] interleaves gate and up columns (gate = [..., ::2]),
    ours is [gate; up] rows; its down_proj is [I, h], ours [h, I]."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    hf_config = transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=1,
                                          num_experts_per_tok=1, experts_implementation="eager")
    experts = GptOssExperts(hf_config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    ours = ParallelMLP(model_config(GPT_OSS))
    gate_up, gate_up_bias = experts.gate_up_proj[0], experts.gate_up_proj_bias[0]
    with torch.no_grad():
        ours.dense_h_to_4h.weight.copy_(torch.cat([gate_up[:, ::2], gate_up[:, 1::2]], dim=1).T)
        ours.dense_h_to_4h.bias.copy_(torch.cat([gate_up_bias[::2], gate_up_bias[1::2]]))
        ours.dense_4h_to_h.weight.copy_(experts.down_proj[0].T)
        ours.dense_4h_to_h.bias.copy_(experts.down_proj_bias[0])
    x = torch.randn(24, HIDDEN, generator=g)
    inner = x @ gate_up + gate_up_bias
    assert (inner[:, ::2] > 7).any() and (inner[:, 1::2].abs() > 7).any()  # weights of std 1: the clamp bites
    with torch.no_grad():
        theirs = experts(x, torch.zeros(24, 1, dtype=torch.long), torch.ones(24, 1))
        torch.testing.assert_close(ours(x.unsqueeze(0)).squeeze(0), theirs, rtol=1e-5, atol=1e-5)


def _mlp_at_tp(tp, x, probe):
    """This rank's ParallelMLP (gpt-oss's flags, weights of std 1, biases away from zero: the same masters at
    every TP, sliced as the layers slice them) run forward and backward."""
    from megatron_lite.parallel import state
    from megatron_lite.parallel.tp import tp_rank

    if tp > 1:  # TP 1 is this process, without groups (parallel/tp.py says TP 1)
        state.initialize(tp)
    torch.manual_seed(SEED)
    mlp = ParallelMLP(model_config(GPT_OSS + ("--init-method-std", "1.0"), tp))
    with torch.no_grad():
        mlp.dense_h_to_4h.bias.copy_(_gate_up_slice(torch.linspace(-2, 2, 2 * FFN), tp_rank(), tp))
        mlp.dense_4h_to_h.bias.copy_(torch.linspace(-1, 1, HIDDEN))
    y, x_grad = value_and_gradient(mlp, x, probe)
    return {"y": y, "x_grad": x_grad, "grads": {name: p.grad for name, p in mlp.named_parameters()},
            "weights": {name: p.detach() for name, p in mlp.named_parameters()}}


def _gate_up_slice(t, rank, tp):
    """A TP rank's rows of a [gate; up] tensor: its slice of each half (stride 2)."""
    return torch.cat([rank_slice(half, rank, tp, 0) for half in t.chunk(2, dim=0)], dim=0)


def test_parallel_mlp_with_quick_geglu_at_tp2_equals_tp1():
    g = torch.Generator().manual_seed(4)
    x, probe = torch.randn(2, 8, HIDDEN, generator=g), torch.randn(2, 8, HIDDEN, generator=g)
    dense = _mlp_at_tp(1, x, probe)
    inner = x @ dense["weights"]["dense_h_to_4h.weight"].T
    assert (inner[..., :FFN] > 7).any() and (inner[..., FFN:].abs() > 7).any()  # the clamp bites
    as_split = {"dense_h_to_4h.weight": lambda t, r: _gate_up_slice(t, r, 2),
                "dense_h_to_4h.bias": lambda t, r: _gate_up_slice(t, r, 2),
                "dense_4h_to_h.weight": lambda t, r: rank_slice(t, r, 2, 1),
                "dense_4h_to_h.bias": lambda t, r: t}
    for rank, result in enumerate(run_distributed(_mlp_at_tp, 2, 2, x, probe)):
        assert_matches(result["y"], dense["y"], f"rank {rank} output")
        assert_matches(result["x_grad"], dense["x_grad"], f"rank {rank} input gradient")
        for name, split in as_split.items():
            assert torch.equal(result["weights"][name], split(dense["weights"][name], rank)), f"rank {rank} {name}"
            assert_matches(result["grads"][name], split(dense["grads"][name], rank), f"rank {rank} {name} grad")
