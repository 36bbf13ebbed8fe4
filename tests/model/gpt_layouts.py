"""Shared pieces of the GPT parity tests: a tiny config, synthetic batches, the dense reference."""
import torch

from megatron_lite.arguments import parse_args

TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--vocab-size", "128", "--make-vocab-size-divisible-by", "32", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
        "--clip-grad", "1.0", "--seed", "7"]


def tiny_config(tp=1, pp=1, dp=1, extra=()):
    argv = TINY + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *extra]
    return parse_args(argv, world_size=tp * pp * dp)[0]


def global_batches(config, steps, seed=0):
    """[steps, global_batch, seq + 1] token ids; labels are the tokens shifted by one."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.model.vocab_size, (steps, config.batch.global_batch_size,
                                                       config.model.seq_length + 1), generator=g)


def micro_batches(config, batches, dp_rank, dp):
    """Megatron's order: each micro-step takes the next micro x DP samples, rank r its r-th slice."""
    micro = config.batch.micro_batch_size
    seq = config.model.seq_length
    positions = torch.arange(seq).expand(micro, seq).contiguous()
    for step in batches:
        for m in range(config.batch.gradient_accumulation_steps):
            window = step[m * micro * dp:(m + 1) * micro * dp]
            sample = window[dp_rank * micro:(dp_rank + 1) * micro]
            yield (sample[:, :-1].contiguous(), positions), (sample[:, 1:].contiguous(), torch.ones(micro, seq))


def dense_losses(config, batches, micro_batch_size=None):
    """Single process, TP = PP = DP = 1, plain torch AdamW: the losses every layout must reproduce.

    By default each step is one forward over the whole global batch. With dropout, pass
    micro_batch_size: the step then runs micro-batches in order and accumulates their
    mean, so each layer's dropout stream draws the masks a DP = 1 pipeline draws.
    """
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.training.optimizer import build_optimizer

    model = GPTModel(config)
    model_parallel_seed(config.training.seed, config.model.num_layers)
    optimizer = build_optimizer(model, config.optimizer)
    seq = config.model.seq_length
    losses = []
    for step in batches:
        optimizer.zero_grad()
        chunks = step.split(micro_batch_size or len(step))
        total = 0.0
        for chunk in chunks:
            tokens, labels = chunk[:, :-1], chunk[:, 1:]
            positions = torch.arange(seq).expand_as(tokens)
            loss = model(tokens, positions, labels, torch.ones(labels.shape)) / len(chunks)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.clip_grad)
        optimizer.step()
        losses.append(total)
    return losses
