"""Shared pieces of the GPT parity tests: a tiny config, synthetic batches, the dense reference."""
import torch

from megatron_lite.arguments import parse_args

TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--vocab-size", "128", "--make-vocab-size-divisible-by", "32", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
        "--clip-grad", "1.0", "--seed", "7"]


def tiny_config(tp=1, pp=1, dp=1, extra=(), cp=1):
    argv = TINY + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                   "--context-parallel-size", str(cp), *extra]
    return parse_args(argv, world_size=tp * pp * dp * cp)[0]


def global_batches(config, steps, seed=0):
    """[steps, global_batch, seq + 1] token ids; labels are the tokens shifted by one."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.model.vocab_size, (steps, config.batch.global_batch_size,
                                                       config.model.seq_length + 1), generator=g)


def documents_of(config, tokens, eod):
    """(position ids, document ids or None) of token rows [n, seq] as the dataset makes them
    (data/documents.py): positions restart after `eod` with --reset-position-ids, and the document ids
    come along when the model needs them (model/attention_mask.py)."""
    from megatron_lite.data.documents import document_ids, positions_in_documents
    from megatron_lite.model.attention_options import needs_document_ids

    m = config.model
    if eod is None or not (m.reset_position_ids or needs_document_ids(m)):
        return torch.arange(tokens.shape[1]).expand_as(tokens).contiguous(), None
    # The data pipeline finds documents in the CPU batch; under MEGATRON_LITE_TEST_DEVICE=cuda the test's tokens
    # are on the GPU, and numpy() of them failed the GPU check's document-masking tests.
    ids = torch.stack([torch.from_numpy(document_ids(row.numpy(), eod)) for row in tokens.cpu()])
    positions = (torch.stack([torch.from_numpy(positions_in_documents(row.numpy())) for row in ids])
                 if m.reset_position_ids else torch.arange(tokens.shape[1]).expand_as(tokens).contiguous())
    return positions.to(tokens.device), ids.to(tokens.device) if needs_document_ids(m) else None


def micro_batches(config, batches, dp_rank, dp, cp=(0, 1), loss_mask=None, eod=None):
    """Megatron's order: each micro-step takes the next micro x DP samples, rank r its r-th slice; a
    context-parallel rank (cp = (rank, size)) its part of their sequences. loss_mask(labels) -> mask
    (default: every token counts). eod: the end-of-document token, for --reset-attention-mask and
    --reset-position-ids (the document ids stay whole under CP, as data/sampler.py keeps them)."""
    from megatron_lite.data.context_parallel import context_parallel_part, mtp_context_parallel_part

    micro = config.batch.micro_batch_size
    seq = config.model.seq_length
    for step in batches:
        for m in range(config.batch.gradient_accumulation_steps):
            window = step[m * micro * dp:(m + 1) * micro * dp]
            sample = window[dp_rank * micro:(dp_rank + 1) * micro]
            labels = sample[:, 1:].contiguous()
            tokens = sample[:, :-1].contiguous()
            positions, documents = documents_of(config, tokens, eod)
            arrays = (tokens, positions, labels, torch.ones(micro, seq) if loss_mask is None else loss_mask(labels))
            mtp = mtp_of(config, arrays, documents)
            if cp[1] > 1:
                arrays = context_parallel_part(arrays, *cp)
                mtp = mtp_context_parallel_part(mtp, *cp) if mtp else ()
            yield ((arrays[0], arrays[1], *([] if documents is None else [documents]), *mtp[:1]),
                   (arrays[2], arrays[3], *mtp[1:]))


def mtp_of(config, arrays, documents):
    """Multi-Token Prediction's (tokens, labels, mask) of a micro-batch's whole sequences (data/mtp.py), or ()."""
    from megatron_lite.data.mtp import mtp_arrays

    depths = config.model.mtp_num_layers
    tokens, _, labels, mask = arrays
    return mtp_arrays(tokens, labels, mask, documents, depths) if depths else ()


def dense_losses(config, batches, micro_batch_size=None, loss_mask=None, eod=None, weights=None, norms=None,
                 after_step=None):
    """Single process, TP = PP = DP = 1, plain torch AdamW: the losses every layout must reproduce.

    By default each step is one forward over the whole global batch. With dropout, pass
    micro_batch_size: the step then runs micro-batches in order and accumulates their
    mean, so each layer's dropout stream draws the masks a DP = 1 pipeline draws.
    weights: a dict to fill with the trained model's state dict; norms: a list to fill with each step's
    gradient norm before clipping; after_step(model) is called after each step.
    """
    from megatron_lite.model import aux_loss
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.training.expert_balance import update_expert_biases
    from megatron_lite.training.optimizer import build_optimizer

    model = GPTModel(config)
    model_parallel_seed(config.training.seed, config.model.numbered_layers)
    optimizer = build_optimizer(model, config.optimizer)
    losses = []
    for step in batches:
        optimizer.zero_grad()
        chunks = step.split(micro_batch_size or len(step))
        aux_loss.set_scale(1.0 / len(chunks))  # MoE router losses: averaged over micro-batches like the loss
        total = 0.0
        for chunk in chunks:
            tokens, labels = chunk[:, :-1], chunk[:, 1:]
            positions, documents = documents_of(config, tokens, eod)
            mask = torch.ones(labels.shape) if loss_mask is None else loss_mask(labels)
            mtp = mtp_of(config, (tokens, positions, labels, mask), documents)
            loss = model(tokens, positions, labels, mask, document_ids=documents, mtp=mtp or None) / len(chunks)
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.clip_grad)
        update_expert_biases(model, sequence_parallel=False)
        optimizer.step()
        losses.append(total)
        if norms is not None:
            norms.append(float(norm))
        if after_step is not None:
            after_step(model)
    if weights is not None:
        weights.update({name: t.detach().clone() for name, t in model.state_dict().items()})
    return losses
