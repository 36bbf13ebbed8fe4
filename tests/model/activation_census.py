"""Bytes autograd keeps for backward on a real GPT, stage by stage (saved_tensors_hooks)."""
import torch

from megatron_lite.model.gpt import GPTModel, loss_fn
from megatron_lite.model.transformer import TransformerLayer
from megatron_lite.model.arithmetic import stage_bounds


def saved_bytes_per_stage(config):
    """For each pipeline stage of the config: storages saved by autograd for one micro-batch,
    plus the inputs activation recompute keeps alive, plus a non-last stage's output (kept to send)."""
    from megatron_lite.parallel import state

    if not state.is_initialized():
        state.initialize(config.parallel.tensor_model_parallel_size, 1)
    from megatron_lite.parallel.random import model_parallel_seed

    model = GPTModel(config).train()
    model_parallel_seed(config.training.seed, config.model.num_layers)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    b, s = config.batch.micro_batch_size, config.model.seq_length
    tokens = torch.randint(0, config.model.vocab_size, (b, s))
    positions = torch.arange(s).expand(b, s).contiguous()
    bounds = stage_bounds(config, estimate=True)
    results, x = [], (tokens, positions)
    for a, z in zip(bounds[:-1], bounds[1:]):
        if isinstance(x, torch.Tensor):  # what the pipeline engine hands the next stage
            x = x.detach().requires_grad_(True)
        kept = {}

        def keep(t):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

        def pack(t):
            keep(t)
            return t

        hooks = [mod.register_forward_pre_hook(lambda mod, args: keep(args[0]))
                 for mod in model.modules() if isinstance(mod, TransformerLayer) and mod.recompute]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for fn in model._forward_fns[a:z]:
                x = fn(x)
            if z == len(model._forward_fns):
                x = loss_fn(x, (tokens, torch.ones(b, s)))
            else:
                keep(x)
        for hk in hooks:
            hk.remove()
        results.append(sum(kept.values()))
    return results
