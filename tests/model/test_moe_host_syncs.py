"""No host syncs on the MoE layer's hot path (issue 58): at EP 1 the router, top-k, aux and z-losses, dispatch,
the experts' grouped GEMM, combine and the shared expert read nothing from the device, forward or backward, and
the layer compiles to one graph (fullgraph) that computes eager's numbers; at EP > 1 the only read is the one copy
of the counts the all-to-alls need (parallel/experts.py), and the layer compiled around that part still computes
eager's numbers.

The CPU has no sync debug mode, so `count_host_syncs` counts what would be one on a GPU: every op that reads a
tensor's value into Python (item, bool, int, equal, tolist, numpy, a copy to the CPU) and every op whose output
shape depends on the data (nonzero, boolean-mask indexing, bincount, unique, repeat_interleave without
output_size), which must read the device to size its output. On a GPU, torch.cuda.set_sync_debug_mode("error")
checks the same (skipped without one).
"""
import contextlib
import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lite.arguments import parse_args
from megatron_lite.model import aux_loss
from megatron_lite.model.grouped_linear import grouped_linear, grouped_mm_linear, grouped_mm_takes
from megatron_lite.model.moe import MoELayer
from tests.harness import run_distributed

aten = torch.ops.aten

VALUE_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
               aten._assert_async.default, aten._assert_async.msg}
"""Ops that hand a tensor's value to the host (item(), int(), bool(), torch.equal, asserts on a value)."""
DATA_SHAPED = {aten.nonzero.default, aten.argwhere.default, aten.masked_select.default, aten.bincount.default,
               aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default}
"""Ops whose output shape is read from the data."""
MASK_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
"""Indexing that is data-shaped when an index is a boolean mask."""


class _DispatchedReads(TorchDispatchMode):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in VALUE_READS or func in DATA_SHAPED:
            self.seen.append(str(func))
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.seen.append(f"{func} without output_size")
        elif func in MASK_INDEXED and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            self.seen.append(f"{func} by a mask")
        elif func in (aten._to_copy.default, aten.copy_.default) and _to_host(func, args, kwargs):
            self.seen.append(f"{func} to the CPU")
        return func(*args, **kwargs)


def _to_host(func, args, kwargs) -> bool:
    """A copy from a device to the CPU (on a CPU-only run there is none)."""
    if func is aten.copy_.default:
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    device = kwargs.get("device")
    return args[0].device.type != "cpu" and device is not None and torch.device(device).type == "cpu"


class _PythonReads(TorchFunctionMode):
    """tolist() and numpy() of a CPU tensor read it without any op reaching the dispatcher."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in ("tolist", "numpy") and args[0].device.type == "cpu":
            self.seen.append(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_syncs():
    """Yields a list that fills with one entry per host read (see the module docstring) inside the block."""
    seen = []
    with _PythonReads(seen), _DispatchedReads(seen):
        yield seen


MOE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
       "--vocab-size", "64", "--micro-batch-size", "2", "--global-batch-size", "2", "--hidden-dropout", "0",
       "--attention-dropout", "0", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
       "--moe-aux-loss-coeff", "0.5", "--moe-z-loss-coeff", "0.1", "--moe-shared-expert-intermediate-size", "32"]
"""Top-2 of 4 experts, strong aux and z-losses (their gradients show in the comparison), a shared expert."""
SWIGLU = ("--swiglu", "--disable-bias-linear")
VARIANTS = {
    "loop_flag": SWIGLU,
    "grouped_gemm": SWIGLU + ("--moe-grouped-gemm",),
    "gelu_biases_capacity": ("--moe-expert-capacity-factor", "0.5", "--moe-shared-expert-gate"),
    "sigmoid_groups_expert_bias": SWIGLU + ("--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                                            "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
                                            "--moe-router-load-balancing-type", "seq_aux_loss"),
}
"""On the CPU both GEMM settings run the grouped GEMM (model/moe.py); GeLU experts with biases and a capacity
take its bias and padding paths."""


def moe_layer(flags, world_size=1):
    torch.manual_seed(0)
    return MoELayer(parse_args(MOE + list(flags), world_size=world_size)[0].model).train()


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 16, 32, generator=g), torch.randn(2, 16, 32, generator=g)


def forward_backward(layer, x, probe, run=None):
    """Output, input gradient, parameter gradients and the device statistics of one step of `layer` (called
    through `run`, its compiled form, if given)."""
    x = x.clone().requires_grad_(True)
    out = (layer if run is None else run)(x)
    (out * probe).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    stats = {"step_sums": layer.step_sums.clone(), "local_load": layer.router.local_load.clone()}
    return out.detach(), x.grad, grads, stats


def assert_same(compiled, eager):
    for what, c, e in zip(("output", "input gradient"), compiled[:2], eager[:2]):
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-7, msg=lambda m: f"{what}: {m}")
    for kind in (2, 3):
        assert compiled[kind].keys() == eager[kind].keys()
        for name in eager[kind]:
            torch.testing.assert_close(compiled[kind][name], eager[kind][name], rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"{name}: {m}")


def test_the_host_sync_counter_sees_each_kind_of_host_read():
    # A count of zero below means nothing only if the counter sees what it is meant to.
    t = torch.tensor([0, 2, 1, 2], device="cpu")
    with count_host_syncs() as seen:
        t.sum().item(), int(t[0]), bool(t[1]), t.tolist(), t.numpy(), torch.equal(t, t)
        torch.bincount(t), t.nonzero(), t[t > 0], t.repeat_interleave(t), torch.unique(t)
        t.repeat_interleave(t, output_size=5), t.index_select(0, t), t.cumsum(0)  # none of these reads
    assert len(seen) == 11, seen


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_layer_forward_and_backward_read_nothing_to_the_host_at_ep1(variant):
    layer = moe_layer(VARIANTS[variant])
    x, probe = inputs()
    with count_host_syncs() as seen:
        out = layer(x.clone().requires_grad_(True))
        (out * probe).sum().backward()
    # On CUDA the per-expert loop runs but with --moe-grouped-gemm in bf16 on SM90/SM100 (model/moe.py): its
    # cuBLAS calls take host sizes, one read per layer.
    e = layer.experts
    looped = x.is_cuda and not (e.grouped_gemm and grouped_mm_takes(x, e.weight1, e.weight2))
    assert len(seen) == (1 if looped else 0), seen
    assert layer.step_sums[-1] == 1 and layer.router.local_load.sum() == 2 * 16 * 2  # the statistics still count


def test_the_per_expert_loop_reads_its_row_counts_to_the_host_once_per_layer():
    """Rows _grouped_mm does not take (an expert width of 18 fp32 numbers is not a multiple of 16 bytes) go
    through the per-expert loop, whose sizes are host numbers: one copy per layer, forward and backward."""
    layer = moe_layer(SWIGLU + ("--moe-ffn-hidden-size", "18"))
    x, probe = inputs()
    with count_host_syncs() as seen:
        (layer(x) * probe).sum().backward()
    assert len(seen) == 1, seen


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_mm_linear_equals_the_per_expert_loop_with_an_empty_expert_and_padding_rows(bias):
    """Expert 1 gets no row, and 5 padding rows follow the last expert's (a capacity's dropped copies): both
    give zero outputs there and the same outputs and gradients elsewhere; no gradient comes from padding."""
    g = torch.Generator().manual_seed(3)
    counts, padding = [6, 0, 9, 4], 5
    x = torch.randn(sum(counts) + padding, 16, generator=g)
    weight, b = torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, generator=g) if bias else None
    probe = torch.randn(x.shape[0], 8, generator=g)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    results = []
    for grouped in (True, False):
        xi, wi = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        bi = b.clone().requires_grad_(True) if bias else None
        if grouped:
            out = grouped_mm_linear(xi, wi, offsets, bi, padded=True)
        else:
            out = grouped_linear(xi, wi, counts + [padding], bi)
        (out * probe).sum().backward()
        results.append([out, xi.grad, wi.grad] + ([bi.grad] if bias else []))
    for grouped, looped in zip(*results):
        torch.testing.assert_close(grouped, looped, rtol=1e-6, atol=1e-6)
    assert (results[0][0][-padding:] == 0).all() and (results[0][1][-padding:] == 0).all()
    assert (results[0][2][1] == 0).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["grouped_gemm", "gelu_biases_capacity"])
def test_moe_layer_at_ep1_runs_under_cuda_sync_debug_mode_error(variant):
    """bf16 with --moe-grouped-gemm on SM90/SM100: torch's grouped GEMM kernel, which reads no offsets."""
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("torch's grouped GEMM kernel needs SM90 or SM100")
    flags = VARIANTS[variant] + (() if variant == "grouped_gemm" else ("--moe-grouped-gemm",))
    layer = moe_layer(flags).cuda().to(torch.bfloat16)
    x, probe = (t.cuda().to(torch.bfloat16) for t in inputs())
    x.requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        (layer(x) * probe).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("variant", ["loop_flag", "gelu_biases_capacity"])
def test_moe_layer_at_ep1_compiles_to_one_graph_and_matches_eager(variant):
    torch._dynamo.reset()
    layer = moe_layer(VARIANTS[variant])
    explained = torch._dynamo.explain(copy.deepcopy(layer))(inputs()[0])
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled_layer = copy.deepcopy(layer)
    compiled = torch.compile(compiled_layer, backend="aot_eager", fullgraph=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    try:
        # Other tokens (other counts per expert) and a new router-loss scale (fp16's loss scale moves) are inputs
        # of the graph, not recompiles.
        for seed, scale in ((1, 1.0), (2, 0.25)):
            aux_loss.set_scale(scale)
            x, probe = inputs(seed)
            for m in (layer, compiled_layer):
                m.zero_grad()
            assert_same(forward_backward(compiled_layer, x, probe, compiled), forward_backward(layer, x, probe))
    finally:
        aux_loss.set_scale(1.0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1


def _at_ep2(flags):
    """On each of 2 ranks (EP 2, DP 2): the host reads of one forward and backward of an eager MoE layer, and
    the same step compiled (aot_eager) against eager on this rank's own tokens."""
    import torch.distributed as dist

    from megatron_lite.parallel import state

    state.initialize(1, 1, expert_model_parallel_size=2)
    torch._dynamo.reset()
    layer = moe_layer(tuple(flags) + ("--expert-model-parallel-size", "2", "--global-batch-size", "4"), world_size=2)
    x, probe = inputs(seed=1 + dist.get_rank())  # each rank its own tokens: uneven counts to send
    with count_host_syncs() as seen:
        (layer(x.clone().requires_grad_(True)) * probe).sum().backward()
    layer.zero_grad()
    compiled_layer = copy.deepcopy(layer)
    compiled = torch.compile(compiled_layer, backend="aot_eager")
    assert_same(forward_backward(compiled_layer, x, probe, compiled), forward_backward(layer, x, probe))
    # Other tokens send other numbers of rows: the experts' graph recompiles once with the row count dynamic,
    # then never again.
    graphs = []
    for step in (1, 2):
        forward_backward(compiled_layer, *inputs(seed=10 * step + dist.get_rank()), compiled)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return seen, graphs


@pytest.mark.parametrize("variant", ["loop_flag", "gelu_biases_capacity"])
def test_moe_layer_at_ep2_reads_the_host_once_and_compiled_matches_eager(variant):
    for rank, (seen, graphs) in enumerate(run_distributed(_at_ep2, 2, VARIANTS[variant])):
        assert seen == ["Tensor.tolist"], f"rank {rank}: {seen}"
        assert graphs[0] == graphs[1], f"rank {rank}: recompiled at every step ({graphs} graphs)"
