"""--moe-grouped-gemm's CUDA path (torch._grouped_mm) computes what the per-expert loop computes, forward and
gradients, in bf16 and fp32 where the kernel takes them; skipped without a GPU (scripts/gpu_check.sh runs it)."""
import pytest
import torch

from megatron_lite.arguments import parse_args
from megatron_lite.model.moe import MoELayer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--vocab-size", "128", "--micro-batch-size", "2", "--num-experts", "8", "--moe-router-topk", "2",
         "--moe-ffn-hidden-size", "128", "--swiglu", "--disable-bias-linear", "--hidden-dropout", "0",
         "--attention-dropout", "0"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gemm_matches_the_per_expert_loop_on_cuda(dtype, bias):
    flags = [f for f in FLAGS if not (bias and f == "--disable-bias-linear")]
    layers = {}
    for grouped in (False, True):
        config = parse_args(flags + (["--moe-grouped-gemm"] if grouped else []), world_size=1)[0]
        torch.manual_seed(0)
        layers[grouped] = MoELayer(config.model).cuda().to(dtype)
    layers[True].load_state_dict(layers[False].state_dict())
    x = torch.randn(2, 64, 64, device="cuda", dtype=dtype)
    outs, grads = {}, {}
    for grouped, layer in layers.items():
        inp = x.clone().requires_grad_()
        out = layer(inp)
        out.float().square().sum().backward()
        outs[grouped], grads[grouped] = out.float(), inp.grad.float()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for a, b in ((outs[False], outs[True]), (grads[False], grads[True])):
        assert (a - b).abs().max() <= tolerance * b.abs().max(), (dtype, bias)
    w = [dict(l.experts.named_parameters())["weight1"].grad.float() for l in (layers[False], layers[True])]
    assert (w[0] - w[1]).abs().max() <= tolerance * w[1].abs().max()
