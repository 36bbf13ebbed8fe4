"""Global gradient norm of a TP-split model against the dense model's, replicated parameters counted once."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed
from tests.parallel.reference import assert_matches, master_weights

SEED = 99
SEQ, BATCH, HIDDEN, FFN, VOCAB = 4, 2, 8, 16, 16


def _data():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (SEQ, BATCH), generator=g)
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=g)
    loss_mask = (torch.rand(SEQ, BATCH, generator=g) > 0.25).float()
    return ids, target, loss_mask


class _TinyParallelLM(nn.Module):
    """Embedding -> LayerNorm -> Column/GeLU/Row MLP -> tied head: split, replicated and tied parameters."""

    def __init__(self):
        from megatron_lite.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

        super().__init__()
        torch.manual_seed(SEED)
        self.embedding = VocabParallelEmbedding(VOCAB, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)  # untagged: must count as replicated
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN)
        self.fc2 = RowParallelLinear(FFN, HIDDEN)
        with torch.no_grad():
            # Nonzero replicated parameters, the same on every rank.
            self.norm.weight.copy_(torch.linspace(0.5, 1.5, HIDDEN))
            self.fc2.bias.copy_(torch.linspace(-0.1, 0.1, HIDDEN))

    def forward(self, ids, target, loss_mask):
        from megatron_lite.parallel.cross_entropy import masked_mean, vocab_parallel_cross_entropy
        from megatron_lite.parallel.layers import parallel_lm_logits

        h = self.embedding(ids)
        h = h + self.fc2(F.gelu(self.fc1(self.norm(h))))
        logits = parallel_lm_logits(h, self.embedding.weight)
        return masked_mean(vocab_parallel_cross_entropy(logits, target), loss_mask)


def _dense_norm():
    """The same model as plain torch modules and F.cross_entropy."""
    ids, target, loss_mask = _data()
    torch.manual_seed(SEED)
    table, w1, w2 = master_weights((VOCAB, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN))
    embedding, norm = nn.Embedding(VOCAB, HIDDEN), nn.LayerNorm(HIDDEN)
    fc1, fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
    with torch.no_grad():
        embedding.weight.copy_(table), fc1.weight.copy_(w1), fc1.bias.zero_(), fc2.weight.copy_(w2)
        norm.weight.copy_(torch.linspace(0.5, 1.5, HIDDEN)), fc2.bias.copy_(torch.linspace(-0.1, 0.1, HIDDEN))
    h = embedding(ids)
    h = h + fc2(F.gelu(fc1(norm(h))))
    logits = h @ embedding.weight.t()
    ignored = target.masked_fill(loss_mask == 0, -100)
    F.cross_entropy(logits.view(-1, VOCAB), ignored.view(-1), ignore_index=-100).backward()
    params = [*embedding.parameters(), *norm.parameters(), *fc1.parameters(), *fc2.parameters()]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))


def _parallel_norms(tp):
    import deepspeed
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid
    from deepspeed.runtime.utils import clip_grad_norm_

    from megatron_lite.parallel import state
    from megatron_lite.parallel.grad_norm import global_grad_norm

    state.initialize(tp)
    model = _TinyParallelLM()
    model(*_data()).backward()
    ours = global_grad_norm(model.parameters())
    # DeepSpeed's own clipping path (ZeRO 0) with the pipeline grid as mpu reads our tags.
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    grid = PipelineParallelGrid(topology=state.get_topology())
    theirs = clip_grad_norm_(list(model.parameters()), max_norm=1e9, mpu=grid)
    return ours, theirs.reshape(())


@pytest.mark.parametrize("tp, world", [(1, 1), (2, 2), pytest.param(2, 4, marks=pytest.mark.slow)])
def test_global_grad_norm_at_tp_equals_dense_model_norm(tp, world):
    """(2, 4) is TP 2 x DP 2: the default group must be one replica's ranks, not the world."""
    dense = _dense_norm()
    for rank, (ours, theirs) in enumerate(run_distributed(_parallel_norms, world, tp)):
        assert_matches(ours, dense, f"rank {rank} global_grad_norm")
        assert_matches(theirs, dense, f"rank {rank} DeepSpeed clip_grad_norm_")


def test_global_grad_norm_skips_deepspeed_pipe_replicated_copies():
    from megatron_lite.parallel.grad_norm import global_grad_norm

    owner, copy = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    owner.grad, copy.grad = torch.full((3,), 2.0), torch.full((3,), 2.0)
    copy.ds_pipe_replicated = True
    assert_matches(global_grad_norm([owner, copy]), torch.linalg.vector_norm(owner.grad), "norm")
