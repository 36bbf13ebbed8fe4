"""Bytes autograd keeps for backward on a real GPT, stage by stage (saved_tensors_hooks)."""
import contextlib

import torch

from megatron_lite.cost.stages import stage_bounds
from megatron_lite.model.gpt import GPTModel
from megatron_lite.model.recompute import run_stage
from megatron_lite.parallel.random import checkpoint as random_checkpoint
from tests.model.gpt_layouts import mtp_of


def _model_and_batch(config):
    """The whole GPT of the config on this TP and CP rank (groups made if none exist) in the config's
    precision, the storages of its parameters (never counted as activations), and one random
    micro-batch: (tokens, positions[, document ids][, the depths' tokens]) and (labels, loss mask[, the
    depths' labels and masks]) (with --mtp-num-layers: data/mtp.py's arrays), under context parallelism this
    CP rank's part of the sequence with the masks as loss weights, each in a storage of its own (as the
    sampler hands them over)."""
    from megatron_lite.data.context_parallel import context_parallel_part, mtp_context_parallel_part
    from megatron_lite.parallel import state
    from megatron_lite.parallel.context_parallel import cp_rank
    from megatron_lite.parallel.random import model_parallel_seed

    cp = config.parallel.context_parallel_size
    if not state.is_initialized():
        state.initialize(config.parallel.tensor_model_parallel_size, 1, context_parallel_size=cp,
                         expert_model_parallel_size=config.parallel.expert_model_parallel_size)
    model = GPTModel(config).train()
    if config.precision.dtype_name != "fp32":  # as the engine casts it
        model = model.to(torch.bfloat16 if config.precision.bf16 else torch.float16)
    model_parallel_seed(config.training.seed, config.model.numbered_layers)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    b, s = config.batch.micro_batch_size, config.model.seq_length
    tokens = torch.randint(0, config.model.vocab_size, (b, s))
    # the labels a storage of their own, as the sampler hands them over (the chunked output loss keeps them)
    arrays = (tokens, torch.arange(s).expand(b, s).contiguous(), tokens.clone(), torch.ones(b, s))
    ids = documents(config, b, s)
    mtp = mtp_of(config, arrays, ids[0] if ids else None)  # the depths' (tokens, labels, mask) [b, D, s], or ()
    if cp > 1:
        arrays = tuple(t.clone() for t in context_parallel_part(arrays, cp_rank(), cp))
        mtp = tuple(t.clone() for t in mtp_context_parallel_part(mtp, cp_rank(), cp)) if mtp else ()
    return model, params, arrays[:2] + ids + mtp[:1], arrays[2:] + mtp[1:]


DOCUMENTS_PER_SAMPLE = 8


def documents(config, b, s, per_sample=None):
    """(document ids [b, s] int32,) of `per_sample` (DOCUMENTS_PER_SAMPLE) documents in each sample when the
    model takes them (model/attention_mask.py), else ()."""
    per_sample = DOCUMENTS_PER_SAMPLE if per_sample is None else per_sample
    from megatron_lite.model.attention_options import needs_document_ids

    if not needs_document_ids(config.model):
        return ()
    g = torch.Generator().manual_seed(5)
    starts = torch.zeros(b, s, dtype=torch.int32)
    for row in starts:
        row[torch.randperm(s - 1, generator=g)[:per_sample - 1] + 1] = 1
    return (starts.cumsum(dim=1, dtype=torch.int32),)


def _detached(x):
    """What the pipeline engine hands the next stage: the hidden states as a leaf (with the document ids)."""
    if isinstance(x, tuple):
        return (x[0].detach().clone().requires_grad_(True),) + x[1:]
    return x.detach().clone().requires_grad_(True)


def saved_bytes_per_stage(config):
    """For each pipeline stage of the config: storages saved by autograd for one micro-batch,
    plus the inputs activation recompute keeps alive, plus a non-last stage's output (kept to send).
    Under sequence parallelism, the TP rank's own shard (every rank keeps the same amount); under
    context parallelism, this CP rank's (every rank keeps the same amount)."""
    model, params, inputs, labels_and_mask = _model_and_batch(config)
    bounds = stage_bounds(config, estimate=True)
    results, x = [], inputs
    for a, z in zip(bounds[:-1], bounds[1:]):
        if isinstance(x, torch.Tensor):  # what the pipeline engine hands the next stage
            x = x.detach().requires_grad_(True)
        elif isinstance(x[0], torch.Tensor) and x[0].is_floating_point():  # (hidden states, document ids)
            x = (x[0].detach().requires_grad_(True),) + x[1:]
        kept = {}

        def keep(t):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

        def pack(t):
            keep(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _keeping_checkpoint_inputs(keep):
            x = run_stage(model._forward_fns[a:z], x, config.model)
            if z == len(model._forward_fns):
                x = model.loss(x, labels_and_mask)
            else:
                for t in (x if isinstance(x, tuple) else (x,)):
                    keep(t)
        results.append(sum(kept.values()))
    return results


@contextlib.contextmanager
def _keeping_checkpoint_inputs(keep):
    """Count what activation recompute keeps alive: the inputs of every checkpointed function (a chunk's
    input under full recompute; q, k and v, views of the QKV output, under selective). What the
    function saves inside is its own business (torch's checkpoint hooks, innermost, replace ours)."""
    from megatron_lite.model import attention, recompute

    real = random_checkpoint

    def counted(function, *args, **options):
        for arg in args:
            # A chunk's input under full recompute may be (hidden states, document ids): the ids are the
            # stage's input, kept once per stage whatever recompute does (stage_output_bytes counts them).
            for t in (arg if isinstance(arg, tuple) else (arg,)):
                if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.dtype == torch.bool:
                    keep(t)
        return real(function, *args, **options)

    recompute.checkpoint, attention.checkpoint = counted, counted
    try:
        yield
    finally:
        recompute.checkpoint, attention.checkpoint = real, real


def saved_bytes_per_layer(config):
    """Bytes the first transformer layer keeps for one micro-batch (on this TP rank): what autograd saves
    plus what recompute keeps alive. Its input is the embedding's output in a storage of its own, as a
    later layer's input is (a sequence shard of the embedding at micro batch 1 is a view of the whole
    [1, s, h] output: the first stage's business, counted by saved_bytes_per_stage)."""
    model, params, inputs, _ = _model_and_batch(config)
    x = _detached(model._forward_fns[0](inputs))
    kept = {}

    def keep(t):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    with torch.autograd.graph.saved_tensors_hooks(lambda t: keep(t) or t, lambda t: t), \
            _keeping_checkpoint_inputs(keep):
        y = run_stage(model._forward_fns[1:2], x, config.model)
    (y[0] if isinstance(y, tuple) else y).sum().backward()  # recompute and backward run as in training (nothing more is counted)
    return sum(kept.values())


@contextlib.contextmanager
def forced_routing(balanced: bool = True):
    """MoE routers choose their experts by rule, not by score (the weights still come from the scores).
    balanced: copy j of this rank's token t goes to expert (t k + j) mod E, so each expert gets T k / E copies
    from every rank (when E divides T k): the routing the estimate books (cost/activations.py
    routed_copies). Otherwise every token goes to experts 0 .. k-1: all copies on the first EP rank, the
    worst case the estimate bounds."""
    from megatron_lite.model.router import TopKRouter

    def choose(router, scores):
        first = torch.arange(router.topk, device=scores.device).repeat(scores.shape[0], 1)  # [T, k], as topk gives
        if not balanced:
            return first
        t = torch.arange(scores.shape[0], device=scores.device)[:, None] * router.topk
        return (t + first) % router.num_experts

    real = TopKRouter._choose
    TopKRouter._choose = choose
    try:
        yield
    finally:
        TopKRouter._choose = real
