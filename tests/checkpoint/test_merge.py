"""convert_checkpoint.py merge: one fp32 state dict of the dense GPTModel, equal to the sharded model."""
import json

import pytest
import torch

from tests.checkpoint.conftest import run_tool
from tests.harness import run_distributed

pytestmark = pytest.mark.slow


def _batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, 32), generator=g)
    return tokens, torch.arange(32).unsqueeze(0).expand(2, 32).contiguous()


def _sharded_logits(ckpt, tokens, position_ids):
    """Logits [b, s, V] of the checkpoint loaded at its own layout by DeepSpeed's pipeline engine."""
    import torch.distributed as dist

    from megatron_lite.checkpoint.reader import CheckpointReader
    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine

    reader = CheckpointReader(ckpt)
    config = reader.config.replace(batch__global_batch_size=2, batch__gradient_accumulation_steps=1,
                                   batch__micro_batch_size=2, batch__rampup_batch_size=None)
    state.initialize(reader.tp, reader.pp)
    engine = Engine(config, with_scheduler=False)
    engine.engine.load_checkpoint(ckpt, tag=reader.tag, load_module_only=True, load_optimizer_states=False,
                                  load_lr_scheduler_states=False)
    batch = ((tokens, position_ids), (torch.zeros_like(tokens), torch.ones(tokens.shape)))
    _, logits = engine.engine.eval_batch(iter([batch]), return_logits=True)
    if not state.is_pipeline_last_stage():
        return None
    parts = [torch.empty_like(logits) for _ in range(reader.tp)]
    dist.all_gather(parts, logits.contiguous(), group=state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def test_merge_of_tp2_pp2_checkpoint_gives_the_sharded_logits(run22, tmp_path):
    from megatron_lite.config import Config
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    out = tmp_path / "model.pt"
    result = run_tool("tools/convert_checkpoint.py", "merge", "--load", run22["ckpt"], "--output", str(out))
    assert "merged" in result.stdout and "TP=2, PP=2" in result.stdout
    saved = torch.load(out, weights_only=True)
    config = Config.from_dict(json.loads(saved["config_json"]))
    assert config.parallel.tensor_model_parallel_size == 1 and saved["iteration"] == 4
    assert all(t.dtype == torch.float32 for t in saved["model"].values())
    model = GPTModel(config)
    model.load_state_dict(saved["model"], strict=True)
    model.eval()
    model_parallel_seed(1, config.model.num_layers)
    tokens, positions = _batch(config.model.vocab_size)
    with torch.no_grad():
        dense = model(tokens, positions)

    results = run_distributed(_sharded_logits, 4, run22["ckpt"], tokens, positions)
    sharded = [r for r in results if r is not None]
    assert len(sharded) == 2  # the two TP ranks of the last stage
    for logits in sharded:
        assert logits.shape == dense.shape
        rel = ((logits - dense).abs().max() / dense.abs().max()).item()
        assert rel <= 1e-5, rel


def test_strip_vocab_padding_drops_only_the_padded_rows(run22, tmp_path):
    from megatron_lite.checkpoint.dense import load_dense_model

    run_tool("tools/convert_checkpoint.py", "merge", "--load", run22["ckpt"], "--output", str(tmp_path / "full.pt"))
    run_tool("tools/convert_checkpoint.py", "merge", "--load", run22["ckpt"], "--output", str(tmp_path / "strip.pt"),
             "--strip-vocab-padding")
    full_config, full = load_dense_model(str(tmp_path / "full.pt"))
    config, stripped = load_dense_model(str(tmp_path / "strip.pt"))
    vocab = full_config.model.vocab_size
    assert full_config.model.padded_vocab_size == 512 and config.model.padded_vocab_size == vocab == 400
    tokens, positions = _batch(vocab, seed=1)
    with torch.no_grad():
        a, b = full(tokens, positions), stripped(tokens, positions)
    assert b.shape[-1] == vocab
    assert torch.equal(a[..., :vocab], b)
