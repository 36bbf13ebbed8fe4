"""The all-to-all attention of context parallelism: each CP rank's output (and input gradient) is its
part of the unsplit attention's, for multi-head and grouped keys, fewer groups than CP ranks included."""
import pytest
import torch

from tests.harness import run_distributed
from tests.model.gpt_layouts import tiny_config


def _attention(config):
    from megatron_lite.model.attention import ParallelAttention

    torch.manual_seed(11)
    return ParallelAttention(config.model, layer_number=1)


def _compare(cp, extra):
    import torch.distributed as dist

    from megatron_lite.parallel import state
    from megatron_lite.parallel.random import model_parallel_seed

    config = tiny_config(extra=extra, cp=cp)
    b, s, h = 2, config.model.seq_length, config.model.hidden_size
    x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(5), requires_grad=True)
    model_parallel_seed(1, 1)
    dense = _attention(config)  # before the groups exist: CP = 1
    expected = dense(x)
    expected.square().sum().backward()
    state.initialize(1, 1, context_parallel_size=cp)
    split = _attention(config)
    rank, part = state.get_context_parallel_rank(), s // cp
    mine = x.detach()[:, rank * part:(rank + 1) * part].clone().requires_grad_()
    out = split(mine)
    out.square().sum().backward()
    return {"rank": dist.get_rank(),
            "out": (out - expected[:, rank * part:(rank + 1) * part]).abs().max().item(),
            "grad": (mine.grad - x.grad[:, rank * part:(rank + 1) * part]).abs().max().item()}


@pytest.mark.parametrize("cp, extra", [
    (2, ()),
    (2, ("--position-embedding-type", "rope")),
    (2, ("--group-query-attention", "--num-query-groups", "2")),
    (4, ("--group-query-attention", "--num-query-groups", "2")),  # 2 groups, 4 CP ranks: repeated
    (2, ("--group-query-attention", "--num-query-groups", "1", "--attention-backend", "fused")),
])
def test_each_context_parallel_rank_computes_its_part_of_the_whole_attention(cp, extra):
    for r in run_distributed(_compare, cp, cp, extra):
        assert r["out"] < 1e-5 and r["grad"] < 1e-4, r
