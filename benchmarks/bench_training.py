"""Training throughput of our GPT against baselines measured in the same run.

1. single: TP = PP = DP = 1, our GPT through DeepSpeed's pipeline engine (each
   --attention-backend) vs a plain PyTorch GPT of the same dimensions (nn.Linear,
   scaled_dot_product_attention, AdamW), at each --seq-lengths, all three in one
   process, timed in interleaved rounds (the median of per-round ratios).
2. pipeline: PP = N vs DP = N (N processes, one thread each), same model and global
   batch, for each --pipeline-sizes and --pipeline-vocab-sizes, with the `cost` and
   the `profile` partition: measured PP/DP ratio, the bubble bound gas/(gas+PP-1),
   the efficiency predicted from stage costs measured on this machine, and each
   stage's time breakdown (forward, backward, blocked in recv, ...).

    python benchmarks/bench_training.py                 # both, CPU-sized model
    python benchmarks/bench_training.py --part single --seq-lengths 256 1024
    python benchmarks/bench_training.py --part pipeline --pipeline-sizes 2 --pipeline-vocab-sizes 2048
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from megatron_lite.tuning.measure_model import random_batches  # noqa: E402


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


def model_argv(args, tp=1, pp=1, micro=None, gas=None, dp=1, num_layers=None, seq=None, vocab=None,
               backend="auto", partition="cost"):
    micro = micro or args.micro_batch_size
    gas = gas or args.gas
    return ["--num-layers", str(num_layers or args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(seq or args.seq_length),
            "--vocab-size", str(vocab or args.vocab_size), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", str(micro), "--global-batch-size", str(micro * gas * dp),
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--clip-grad", "1.0", "--lr", "1e-4", "--attention-backend", backend,
            "--pipeline-partition-method", partition]


def time_steps(step, warmup, iters, rounds=2):
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
    """(seconds per optimizer step, details) of our engine in this process (inside an initialised world).
    details, for a pipeline: the stage split, each stage's measured fwd+bwd seconds per micro-batch,
    the predicted efficiency from them, and this rank's time breakdown over the timed steps."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.cost.stages import stage_costs
    from megatron_lite.cost.pipeline_efficiency import predicted_pipeline_efficiency
    from megatron_lite.parallel import state
    from megatron_lite.training import stage_timing
    from megatron_lite.training.engine import Engine
    from megatron_lite.training.model_setup import profiled_spec_costs

    config = parse_args(argv, world_size=world_size)[0]
    state.initialize(config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size)
    engine = Engine(config, with_scheduler=False)
    details = {}
    if config.parallel.pipeline_model_parallel_size > 1:
        measured = profiled_spec_costs(config)
        costs = stage_costs(measured, engine.module.parts, measured=True)
        details = {"layers_per_stage": engine.module.layers_per_stage, "stage_seconds": costs,
                   "predicted": predicted_pipeline_efficiency(costs, config.batch.gradient_accumulation_steps)}
    timer = stage_timing.StageTimer(engine.engine) if engine.pipelined else None
    data = random_batches(config, seed=state.get_data_parallel_rank())
    for _ in range(warmup):
        engine.train_step(data)
    if timer:
        timer.take(0.0)  # the timed steps only
    start = time.perf_counter()
    seconds = time_steps(lambda: engine.train_step(data), 0, iters, rounds=2)
    if timer:
        stages = stage_timing.gather_stages(timer.take(time.perf_counter() - start))
        details["breakdown"] = stage_timing.format_table(stages, 2 * iters) if stages else None
        # DP's gradient all-reduce, which the bubble x balance model leaves out (ms per step)
        details["reduce_ms"] = 1e3 * stages[0][1].get("reduce", 0.0) / (2 * iters) if stages else 0.0
    state.destroy()
    return seconds, details


def join_gloo_world(rank, world_size, port):
    """This process as `rank` of a gloo world on loopback, one thread."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def add_model_arguments(parser, seq_length: int, micro_batch_size: int) -> None:
    """The GPT the two-process benchmarks build: 4 layers, hidden 256, 8 heads, vocabulary 2048."""
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=seq_length)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=micro_batch_size)


def run_ranks(target, world_size, *args, timeout=3600):
    """target(rank, port, *args, results) on world_size spawned processes; what each put in results, in
    rank order (each puts one tuple that starts with its rank)."""
    from megatron_lite.training.distributed import free_port

    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    out = sorted(results.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join()
    return out


def _worker(rank, port, world_size, argv, warmup, iters, results):
    import torch.distributed as dist

    join_gloo_world(rank, world_size, port)
    seconds, details = _ours(argv, world_size, warmup, iters)
    results.put((rank, seconds, details))
    dist.destroy_process_group()


def run_world(argv, world_size, warmup, iters):
    """(seconds per step: the slowest rank's, rank 0's details)."""
    out = run_ranks(_worker, world_size, world_size, argv, warmup, iters, timeout=1800)
    return max(t for _, t, _ in out), out[0][2]


def _single_process_world():
    """A gloo world of one in this process, so that our engine and the plain model share it."""
    import torch.distributed as dist

    from megatron_lite.parallel import state
    from megatron_lite.training.distributed import free_port

    if not dist.is_initialized():
        join_gloo_world(0, 1, free_port())
        state.initialize(1, 1)


def bench_single(args):
    """Interleaved: each round times every model in turn for --iters steps, and the ratio is taken
    per round; the median over --rounds is reported. On a shared machine whole runs drift by 10%
    and more from one minute to the next, which timing the models one after another mistakes for
    a difference between them."""
    from statistics import median

    from megatron_lite.arguments import parse_args
    from megatron_lite.training.engine import Engine

    _single_process_world()
    print(f"\n## TP = PP = DP = 1 (one process, one thread), {args.num_layers} layers, hidden {args.hidden_size}, "
          f"micro batch {args.micro_batch_size}, vocabulary {args.vocab_size}; median of {args.rounds} interleaved "
          f"rounds of {args.iters} steps")
    # Page faults and system time are counters, steadier than the times: fresh pages the allocator
    # maps for large tensors (logits-sized at long sequences) cost a fault each 4 KiB.
    print("| seq | model | ms/step (median) | tokens/s | ratio to plain (median of rounds) | min-max of rounds "
          "| minor page faults/step | system s/step |\n|---|---|---|---|---|---|---|---|")
    for seq in args.seq_lengths:
        config = parse_args(model_argv(args, gas=1, seq=seq), world_size=1)[0]
        tokens_per_step = config.batch.global_batch_size * seq
        torch.manual_seed(0)
        plain = PlainGPT(config.model.padded_vocab_size, args.hidden_size, args.num_attention_heads,
                         config.model.ffn_hidden_size, args.num_layers, seq)
        optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-4)
        plain_data = random_batches(config)

        def plain_step():
            (tokens, _), (labels, _) = next(plain_data)
            loss = plain(tokens, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
            optimizer.step()

        steps = {"plain PyTorch GPT (SDPA)": plain_step}
        for backend in ("sdpa", "fused"):
            engine = Engine(parse_args(model_argv(args, gas=1, seq=seq, backend=backend), world_size=1)[0],
                            with_scheduler=False)
            data = random_batches(config)
            steps[f"megatron_lite, --attention-backend {backend}"] = (lambda e=engine, d=data: e.train_step(d))
        times = {name: [] for name in steps}
        faults = {name: [0, 0.0] for name in steps}
        for name, step in steps.items():
            for _ in range(args.warmup):
                step()
        for _ in range(args.rounds):
            for name, step in steps.items():
                before = resource.getrusage(resource.RUSAGE_SELF)
                times[name].append(time_steps(step, 0, args.iters, rounds=1))
                after = resource.getrusage(resource.RUSAGE_SELF)
                faults[name][0] += after.ru_minflt - before.ru_minflt
                faults[name][1] += after.ru_stime - before.ru_stime
        baseline = times["plain PyTorch GPT (SDPA)"]
        for name, seconds in times.items():
            ratios = [b / t for b, t in zip(baseline, seconds)]
            n = args.rounds * args.iters
            print(f"| {seq} | {name} | {median(seconds) * 1e3:.1f} | {tokens_per_step / median(seconds):.0f} | "
                  f"{median(ratios):.3f} | {min(ratios):.3f}-{max(ratios):.3f} | {faults[name][0] / n:.0f} "
                  f"| {faults[name][1] / n:.3f} |", flush=True)


def bench_pipeline(args):
    gas_pp, micro, layers = args.pipeline_gas, args.pipeline_micro_batch_size, args.pipeline_num_layers
    global_batch = micro * gas_pp
    print(f"\n## PP = N vs DP = N (N processes, one thread each), {layers} layers, hidden {args.hidden_size}, "
          f"seq {args.seq_length}, global batch {global_batch}, micro batch {micro}, gas {gas_pp} (PP)")
    rows, breakdowns = [], []
    for pp in args.pipeline_sizes:
        for vocab in args.pipeline_vocab_sizes:
            dp_argv = model_argv(args, micro=micro, gas=gas_pp // pp, dp=pp, num_layers=layers, vocab=vocab)
            t_dp, dp_details = run_world(dp_argv, pp, args.warmup, args.iters)
            breakdowns.append(f"DP {pp}, vocabulary {vocab}:\n{dp_details['breakdown']}")
            compute_dp = t_dp - dp_details["reduce_ms"] / 1e3
            for method in ("cost", "profile"):
                pp_argv = model_argv(args, pp=pp, micro=micro, gas=gas_pp, num_layers=layers, vocab=vocab,
                                     partition=method)
                t_pp, details = run_world(pp_argv, pp, args.warmup, args.iters)
                measured, bound = t_dp / t_pp, gas_pp / (gas_pp + pp - 1)
                # The model predicts PP against DP's compute alone: DP's gradient all-reduce (measured
                # in its breakdown) is taken out of its step time for that comparison.
                against_compute = compute_dp / t_pp
                rows.append(f"| {pp} | {vocab} | {method} | {','.join(map(str, details['layers_per_stage']))} | "
                            f"{t_dp * 1e3:.0f} | {dp_details['reduce_ms']:.0f} | {t_pp * 1e3:.0f} | {measured:.3f} | "
                            f"{against_compute:.3f} | {bound:.3f} | {details['predicted']:.3f} | "
                            f"{against_compute / details['predicted']:.3f} |")
                stages = " / ".join(f"{1e3 * t:.0f}" for t in details["stage_seconds"])
                breakdowns.append(f"PP {pp}, vocabulary {vocab}, {method} ({stages} ms fwd+bwd per micro-batch "
                                  f"and stage):\n{details['breakdown']}")
                print(rows[-1], flush=True)
    print("\n| PP | vocab | partition | layers per stage | DP ms/step | DP all-reduce ms | PP ms/step | PP/DP measured "
          "| PP/DP compute | bubble bound | predicted | compute/predicted |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\nPer-stage time breakdown (ms per step, rank 0's view of each stage's first rank):")
    print("\n\n".join(breakdowns))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("single", "pipeline", "all"), default="all")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=256, help="for the pipeline part")
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[256, 1024], help="for the single part")
    parser.add_argument("--vocab-size", type=int, default=4096, help="for the single part")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--gas", type=int, default=1, help="gradient accumulation for the single-process part")
    parser.add_argument("--pipeline-gas", type=int, default=16)
    parser.add_argument("--pipeline-micro-batch-size", type=int, default=4)
    parser.add_argument("--pipeline-num-layers", type=int, default=8,
                        help="layers for the PP/DP part: with few layers, whole layers cannot balance two stages")
    parser.add_argument("--pipeline-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--pipeline-vocab-sizes", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds for the single-process part")
    args = parser.parse_args()
    if args.part in ("single", "all"):
        bench_single(args)
    if args.part in ("pipeline", "all"):
        bench_pipeline(args)


if __name__ == "__main__":
    main()
