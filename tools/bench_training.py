"""Training throughput of our GPT against baselines measured in the same run.

1. TP = PP = DP = 1: our GPT through DeepSpeed's pipeline engine vs a plain PyTorch
   GPT of the same dimensions (nn.Linear, scaled_dot_product_attention, AdamW).
2. PP = 2 vs DP = 2 (two processes each, one thread each), same global batch,
   gas = 16 for the pipeline: measured pipeline efficiency beside the theory
   gas / (gas + PP - 1).

    python tools/bench_training.py                 # both, CPU-sized model
    python tools/bench_training.py --part single --hidden-size 512
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


class PlainBlock(nn.Module):
    def __init__(self, h, heads, ffn):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainGPT(nn.Module):
    def __init__(self, vocab, h, heads, ffn, layers, seq):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(PlainBlock(h, heads, ffn) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, tokens, labels):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def model_argv(args, tp=1, pp=1, micro=None, gas=None, dp=1, num_layers=None):
    micro = micro or args.micro_batch_size
    gas = gas or args.gas
    return ["--num-layers", str(num_layers or args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(args.seq_length),
            "--vocab-size", str(args.vocab_size), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", str(micro), "--global-batch-size", str(micro * gas * dp),
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--clip-grad", "1.0", "--lr", "1e-4"]


def random_batches(config, seed=0):
    g = torch.Generator().manual_seed(seed)
    micro, seq = config.batch.micro_batch_size, config.model.seq_length
    positions = torch.arange(seq).expand(micro, seq).contiguous()
    while True:
        sample = torch.randint(0, config.model.vocab_size, (micro, seq + 1), generator=g)
        yield (sample[:, :-1].contiguous(), positions), (sample[:, 1:].contiguous(), torch.ones(micro, seq))


def time_steps(step, warmup, iters, rounds=3):
    """Seconds per step: the best of `rounds` means over `iters` steps (the machine may be shared)."""
    for _ in range(warmup):
        step()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iters):
            step()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def _ours(argv, world_size, warmup, iters):
    """Seconds per optimizer step of our engine in this process (inside an initialised world)."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine

    config = parse_args(argv, world_size=world_size)[0]
    state.initialize(config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size)
    engine = Engine(config, with_scheduler=False)
    data = random_batches(config, seed=state.get_data_parallel_rank())
    seconds = time_steps(lambda: engine.train_step(data), warmup, iters)
    state.destroy()
    return seconds, config


def _worker(rank, world_size, port, argv, warmup, iters, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    seconds, _ = _ours(argv, world_size, warmup, iters)
    results.put((rank, seconds))
    dist.destroy_process_group()


def run_world(argv, world_size, warmup, iters):
    from megatron_lite.training.distributed import free_port

    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, argv, warmup, iters, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    times = [results.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    return max(t for _, t in times)


def bench_single(args):
    from megatron_lite.arguments import parse_args

    argv = model_argv(args, gas=1)
    config = parse_args(argv, world_size=1)[0]
    tokens_per_step = config.batch.global_batch_size * config.model.seq_length

    ours = run_world(argv, 1, args.warmup, args.iters)

    torch.manual_seed(0)
    plain = PlainGPT(config.model.padded_vocab_size, args.hidden_size, args.num_attention_heads,
                     config.model.ffn_hidden_size, args.num_layers, args.seq_length)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    data = random_batches(config)

    def plain_step():
        (tokens, _), (labels, _) = next(data)
        loss = plain(tokens, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        optimizer.step()

    torch.set_num_threads(1)
    baseline = time_steps(plain_step, args.warmup, args.iters)
    print(f"\n## TP = PP = DP = 1 (one process, one thread), {args.num_layers} layers, hidden {args.hidden_size}, "
          f"seq {args.seq_length}, micro batch {args.micro_batch_size}")
    print("| model | ms/step | tokens/s | ratio |\n|---|---|---|---|")
    print(f"| plain PyTorch GPT (SDPA) | {baseline * 1e3:.1f} | {tokens_per_step / baseline:.0f} | 1.00 |")
    print(f"| megatron_lite (DeepSpeed pipeline engine) | {ours * 1e3:.1f} | {tokens_per_step / ours:.0f} | "
          f"{baseline / ours:.2f} |")


def bench_pipeline(args):
    gas_pp, micro = args.pipeline_gas, args.pipeline_micro_batch_size
    global_batch = micro * gas_pp
    layers = args.pipeline_num_layers
    pp_argv = model_argv(args, pp=2, micro=micro, gas=gas_pp, num_layers=layers)
    dp_argv = model_argv(args, micro=micro, gas=gas_pp // 2, dp=2, num_layers=layers)
    tokens = global_batch * args.seq_length
    t_dp = run_world(dp_argv, 2, args.warmup, args.iters)
    t_pp = run_world(pp_argv, 2, args.warmup, args.iters)
    theory = gas_pp / (gas_pp + 2 - 1)
    print(f"\n## PP = 2 vs DP = 2 (two processes, one thread each), {layers} layers, global batch {global_batch}, "
          f"micro batch {micro}, gas {gas_pp} (PP) / {gas_pp // 2} (DP)")
    print("| layout | ms/step | tokens/s | ratio to DP=2 |\n|---|---|---|---|")
    print(f"| DP = 2 | {t_dp * 1e3:.1f} | {tokens / t_dp:.0f} | 1.00 |")
    print(f"| PP = 2 | {t_pp * 1e3:.1f} | {tokens / t_pp:.0f} | {t_dp / t_pp:.2f} |")
    print(f"pipeline efficiency: measured {t_dp / t_pp:.2f}, theory gas/(gas+PP-1) = {theory:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("single", "pipeline", "all"), default="all")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--gas", type=int, default=1, help="gradient accumulation for the single-process part")
    parser.add_argument("--pipeline-gas", type=int, default=16)
    parser.add_argument("--pipeline-micro-batch-size", type=int, default=4)
    parser.add_argument("--pipeline-num-layers", type=int, default=8,
                        help="layers for the PP/DP part: with few layers, whole layers cannot balance two stages")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    if args.part in ("single", "all"):
        bench_single(args)
    if args.part in ("pipeline", "all"):
        bench_pipeline(args)


if __name__ == "__main__":
    main()
