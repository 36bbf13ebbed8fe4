"""Attention sinks (--softmax-type learnable / off-by-one, gpt-oss): every path equals a float64 eager reference
written here from the formula p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij)), forward and gradients of the
input, the weights and the sinks, with causal, window and document masks: the fused kernel (fp32, relative error
<= 1e-6), the eager fallback and SDPA's sink-as-a-key (float64 gradchecks and <= 1e-6 against the reference), the
decoding path after cached keys, and the layer as a whole for each backend."""
import pytest
import torch

from megatron_lite.model.attention_sinks import sdpa_with_sinks
from megatron_lite.model.fused_softmax import FusedScaleMaskSoftmax, kernel_available
from tests.model.gpt_layouts import tiny_config
from tests.model.softmax_reference import random_padding_mask


@pytest.fixture(autouse=True)
def seeded_streams():
    from megatron_lite.parallel.random import model_parallel_seed

    model_parallel_seed(0, 4)

SINKS = ["--softmax-type", "learnable", "--position-embedding-type", "rope", "--group-query-attention",
         "--num-query-groups", "2", "--kv-channels", "12"]


def reference_probs(scores, allowed, sinks, scale):
    """float64: the sink is one more column of the softmax, dropped after it; masked keys get exp(-inf) = 0."""
    x = (scores.double() * scale).masked_fill(~allowed, float("-inf"))
    column = sinks.double().view(1, -1, 1, 1).expand(*x.shape[:-1], 1)
    return torch.softmax(torch.cat([x, column], dim=-1), dim=-1)[..., :-1]


def relative(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def masks(s, kind, generator):
    """bool [b or 1, 1, s, s], True where a query may attend a key."""
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    if kind == "causal":
        return causal.view(1, 1, s, s)
    if kind == "window":  # the key itself and the 2 before it (--window-size 2,0)
        return (causal & ~torch.ones(s, s, dtype=torch.bool).tril(-3)).view(1, 1, s, s)
    if kind == "document":  # two samples, documents [0, 3), [3, s) and [0, 5), [5, s)
        doc = torch.tensor([[0] * 3 + [1] * (s - 3), [0] * 5 + [1] * (s - 5)])
        return (doc[:, :, None] == doc[:, None, :]).unsqueeze(1) & causal
    return ~random_padding_mask(2, s, s, generator)  # with a fully masked row


@pytest.mark.parametrize("kind", ["causal", "window", "document", "padding"])
def test_the_fused_kernel_with_sinks_equals_the_float64_reference_forward_and_backward(kind):
    g = torch.Generator().manual_seed(1)
    b, heads, s, scale = 2, 3, 11, 0.37
    scores = torch.randn(b, heads, s, s, generator=g) * 3
    sinks = torch.randn(heads, generator=g)
    allowed = masks(s, kind, g).expand(b, 1, s, s)
    softmax = FusedScaleMaskSoftmax("causal" if kind == "causal" else "padding", scale)
    assert kernel_available(scores)
    x, sink = scores.clone().requires_grad_(), sinks.clone().requires_grad_()
    probs = softmax(x, None if kind == "causal" else ~allowed, sink)
    grad = torch.randn(probs.shape, generator=g)
    probs.backward(grad)
    x64, sink64 = scores.double().requires_grad_(), sinks.double().requires_grad_()
    expected = reference_probs(x64, allowed, sink64, scale)
    expected.backward(grad.double())
    assert relative(probs, expected) <= 1e-6
    assert relative(x.grad, x64.grad) <= 1e-6
    assert relative(sink.grad, sink64.grad) <= 1e-6
    if kind == "padding":  # the fully masked row: the sink takes all the mass, the keys none
        assert probs[0, :, s // 2].abs().max().item() == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fused_kernel_with_sinks_in_low_precision_stays_near_the_reference(dtype):
    g = torch.Generator().manual_seed(2)
    scores, sinks = torch.randn(2, 4, 9, 9, generator=g), torch.randn(4, generator=g)
    probs = FusedScaleMaskSoftmax("causal", 0.5)(scores.to(dtype), sinks=sinks.to(dtype))
    expected = reference_probs(scores.to(dtype), masks(9, "causal", g), sinks.to(dtype), 0.5)
    assert (probs.double() - expected).abs().max().item() <= (1e-2 if dtype == torch.bfloat16 else 1e-3)


@pytest.mark.parametrize("kind", ["causal", "window", "padding"])
def test_the_eager_fallback_with_sinks_passes_a_float64_gradcheck(kind):
    g = torch.Generator().manual_seed(3)
    allowed = masks(6, kind, g).expand(2, 1, 6, 6)
    softmax = FusedScaleMaskSoftmax("causal" if kind == "causal" else "padding", 0.7)
    scores = torch.randn(2, 2, 6, 6, generator=g, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(2, generator=g, dtype=torch.float64, requires_grad=True)
    mask = None if kind == "causal" else ~allowed
    assert torch.autograd.gradcheck(lambda x, s: softmax(x, mask, s), (scores, sinks))
    assert relative(softmax(scores, mask, sinks), reference_probs(scores, allowed, sinks, 0.7)) <= 1e-12


@pytest.mark.parametrize("kind", ["causal", "window", "document"])
def test_sdpa_with_the_sink_as_a_key_passes_a_float64_gradcheck_with_grouped_keys(kind):
    g = torch.Generator().manual_seed(4)
    b, heads, groups, s, hd, hd_v = 2, 4, 2, 7, 5, 3
    q = torch.randn(b, heads, s, hd, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, groups, s, hd, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, groups, s, hd_v, generator=g, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(heads, generator=g, dtype=torch.float64, requires_grad=True)
    allowed = masks(s, kind, g)
    given = None if kind == "causal" else allowed
    assert torch.autograd.gradcheck(lambda *t: sdpa_with_sinks(*t[:3], given, t[3], 0.45), (q, k, v, sinks))
    expected = torch.matmul(reference_probs(q @ k.repeat_interleave(2, 1).transpose(-1, -2), allowed, sinks, 0.45),
                            v.repeat_interleave(2, 1))
    assert relative(sdpa_with_sinks(q, k, v, given, sinks, 0.45), expected) <= 1e-12


def reference_attention(attention, config, x, allowed):
    """The layer in float64 from its own weights, eager: QKV, RoPE (the layer's own tables), scores, the sink
    column, softmax, x V, output projection."""
    m = config.model
    heads, groups, hd = m.num_attention_heads, m.num_query_groups, m.head_dim
    b, s, _ = x.shape
    qkv = torch.nn.functional.linear(x, attention.query_key_value.weight.double(),
                                     attention.query_key_value.bias.double())
    q, k, v = qkv.split((heads * hd, groups * hd, groups * hd), dim=-1)
    q, k, v = (t.view(b, s, -1, hd).transpose(1, 2) for t in (q, k, v))
    q, k = attention.rotary(q, k, 0, None)
    k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
    probs = reference_probs(q @ k.transpose(-1, -2), allowed, attention.softmax_offset, attention.scale)
    context = (probs @ v).transpose(1, 2).reshape(b, s, heads * hd)
    return torch.nn.functional.linear(context, attention.dense.weight.double(), attention.dense.bias.double())


def grads_of(attention, x, out, grad):
    attention.zero_grad()
    x.grad = None
    out.backward(grad)
    return [x.grad] + [p.grad for _, p in sorted(attention.named_parameters())]


@pytest.mark.parametrize("backend", ["sdpa", "fused", "eager"])
@pytest.mark.parametrize("kind", ["causal", "window", "document"])
def test_the_attention_layer_with_learned_sinks_equals_the_float64_eager_reference(backend, kind):
    from megatron_lite.model.attention import ParallelAttention

    extra = SINKS + ["--attention-backend", "sdpa" if backend == "sdpa" else "fused"]
    extra += ["--no-masked-softmax-fusion"] if backend == "eager" else []
    extra += {"window": ["--window-size", "2,0"], "document": ["--reset-attention-mask"]}.get(kind, [])
    config = tiny_config(extra=extra)
    torch.manual_seed(0)
    attention = ParallelAttention(config.model, 1)
    dtype = torch.float32 if backend == "fused" else torch.float64  # the kernels take no float64
    attention.to(dtype)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        attention.softmax_offset.copy_(torch.randn(4, generator=g) * 2)
        attention.query_key_value.bias.normal_(generator=g)
    x = torch.randn(2, 11, 64, generator=g, dtype=dtype, requires_grad=True)
    allowed = masks(11, kind, g)
    documents = None
    if kind == "document":
        documents = torch.tensor([[0] * 3 + [1] * 8, [0] * 5 + [1] * 6])
    out = attention(x, documents=documents)
    grad = torch.randn(out.shape, generator=g, dtype=dtype)
    ours = grads_of(attention, x, out, grad)
    reference = attention.to(torch.float64)
    x64 = x.detach().double().requires_grad_()
    expected_out = reference_attention(reference, config, x64, allowed)
    expected = grads_of(reference, x64, expected_out, grad.double())
    limit = 1e-6 if backend == "fused" else 1e-12
    assert relative(out, expected_out) <= limit
    for got, want in zip(ours, expected):
        assert relative(got, want) <= limit
    assert attention.softmax_offset.grad.abs().min() > 0  # every head's sink learns


def test_off_by_one_is_a_zero_sink_with_no_parameter():
    from megatron_lite.model.attention import ParallelAttention

    torch.manual_seed(0)
    learned = ParallelAttention(tiny_config(extra=SINKS).model, 1)
    torch.manual_seed(0)
    off_by_one = ParallelAttention(tiny_config(extra=SINKS[:1] + ["off-by-one"] + SINKS[2:]).model, 1)
    assert "softmax_offset" not in dict(off_by_one.named_parameters())
    assert "softmax_offset" not in off_by_one.state_dict()
    with torch.no_grad():
        learned.softmax_offset.zero_()
    learned.load_state_dict(off_by_one.state_dict(), strict=False)
    x = torch.randn(1, 6, 64)
    assert torch.equal(learned(x), off_by_one(x))


@pytest.mark.parametrize("window", [None, "2,0"])
def test_decoding_after_cached_keys_honours_the_sinks(window):
    from megatron_lite.inference.kv_cache import KVCache
    from megatron_lite.model.attention import ParallelAttention

    config = tiny_config(extra=SINKS + (["--window-size", window] if window else []))
    torch.manual_seed(0)
    attention = ParallelAttention(config.model, 1).double().eval()
    with torch.no_grad():
        attention.softmax_offset.normal_(std=2.0)
    x = torch.randn(1, 8, 64, dtype=torch.float64)
    whole = attention(x)
    cache = KVCache()
    steps = [attention(x[:, :5], kv_cache=cache)]
    for t in range(5, 8):
        steps.append(attention(x[:, t:t + 1], kv_cache=cache))
    assert relative(torch.cat(steps, dim=1), whole) <= 1e-6  # decoding's softmax runs in float32
