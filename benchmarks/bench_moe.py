"""What a Mixture-of-Experts step costs here, against transformers, against data parallelism, and per GEMM path.

    python benchmarks/bench_moe.py --part single [--rounds 5]     # ours vs transformers' MixtralForCausalLM
    python benchmarks/bench_moe.py --part ep [--rounds 5]         # EP 2 vs DP 2 on two processes, a2a share
    python benchmarks/bench_moe.py --part gemm [--rounds 5]       # the experts: per-expert loop vs alternatives

single: one training step (forward, backward, fused AdamW) of the same Mixtral-shaped model (4 layers, hidden
        256, 8 heads, 8 experts of 512, top-2, RMSNorm, RoPE, untied head, vocabulary 2048, seq 512, micro
        batch 2, fp32, load-balancing loss 0.02 on both) built by us (GPTModel, one process) and by
        transformers (MixtralForCausalLM, SDPA attention, its default experts path): each in a fresh
        interpreter per round, rounds interleaved (this VM drifts 10-40% within minutes). Printed: the median
        ms per step and transformers' time / ours per round.
ep:     two processes (gloo, one thread each) each holding two engines of one MoE GPT: ep2 (the experts split
        over the two ranks, tokens dispatched by all-to-all) and dp2 (every expert on both, gradients
        all-reduced), the same global batch; interleaved rounds; printed: ms per step, ep2/dp2, and the time
        ep2 spends in its all-to-alls (parallel/experts.py counts it).
gemm:   one MoE layer's experts on dispatched rows under balanced routing (T k rows, E experts), forward and
        backward: the per-expert loop (model/grouped_linear.py; what CUDA runs without --moe-grouped-gemm), one
        bmm over [E, T k / E, h] (what a padded path costs when routing is perfectly balanced, no padding), and
        torch._grouped_mm forward only (the CPU now trains through it: model/grouped_linear.py grouped_mm_linear).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

LAYERS, HIDDEN, HEADS, EXPERTS, TOPK, FFN, VOCAB, SEQ, MICRO = 4, 256, 8, 8, 2, 512, 2048, 512, 2
AUX = 0.02
OURS = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
        "--seq-length", str(SEQ), "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "128",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", str(MICRO),
        "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--position-embedding-type", "rope", "--num-experts", str(EXPERTS), "--moe-router-topk", str(TOPK),
        "--moe-ffn-hidden-size", str(FFN), "--ffn-hidden-size", str(FFN), "--moe-aux-loss-coeff", str(AUX),
        "--attention-backend", "sdpa", "--lr", "1e-4", "--seed", "3"]


def _tokens(vocab):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (MICRO, SEQ + 1), generator=g)


def _time_steps(step, steps: int):
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        step()
        if i >= 2:  # two warm-up steps: allocations, first-call dispatch
            times.append(time.perf_counter() - start)
    return times


def time_transformers_steps(model, vocab: int, steps: int):
    """Seconds of each of `steps` training steps (forward with labels, backward, fused AdamW) of a transformers
    causal LM, in this process, on one fixed micro-batch of _tokens(vocab)."""
    import torch

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = _tokens(vocab)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
        optimizer.step()
    return _time_steps(step, steps)


def time_our_steps(argv, vocab: int, steps: int):
    """Seconds of each of `steps` training steps (forward, backward, our AdamW) of GPTModel built from `argv`, in
    this process, on one fixed micro-batch of _tokens(vocab)."""
    import torch

    from megatron_lite.arguments import parse_args
    from megatron_lite.model import aux_loss
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed
    from megatron_lite.training.optimizer import build_optimizer

    config = parse_args(argv + ["--global-batch-size", str(MICRO)], world_size=1)[0]
    model = GPTModel(config).train()
    model_parallel_seed(config.training.seed, config.model.numbered_layers)
    optimizer = build_optimizer(model, config.optimizer)
    aux_loss.set_scale(1.0)
    tokens = _tokens(vocab)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    micro, seq = inputs.shape
    positions, mask = torch.arange(seq).expand(micro, seq), torch.ones(micro, seq)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(inputs, positions, labels, mask).backward()
        optimizer.step()
    return _time_steps(step, steps)


def child_ours(steps: int):
    return time_our_steps(OURS, VOCAB, steps)


def child_transformers(steps: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, num_key_value_heads=HEADS, num_local_experts=EXPERTS,
                           num_experts_per_tok=TOPK, max_position_embeddings=SEQ, output_router_logits=True,
                           router_aux_loss_coef=AUX, attn_implementation="sdpa", tie_word_embeddings=False)
    return time_transformers_steps(MixtralForCausalLM(config), VOCAB, steps)


def child_gemm(steps: int):
    import torch
    import torch.nn.functional as F

    tokens = MICRO * SEQ
    rows_per_expert = tokens * TOPK // EXPERTS
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(EXPERTS * rows_per_expert, HIDDEN, generator=g, requires_grad=True)
    w1 = (torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=g) * 0.02).requires_grad_()
    w2 = (torch.randn(EXPERTS, HIDDEN, FFN, generator=g) * 0.02).requires_grad_()
    counts = [rows_per_expert] * EXPERTS
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)

    def act(inner):
        gate, up = inner.chunk(2, dim=-1)
        return F.silu(gate) * up

    from megatron_lite.model.grouped_linear import grouped_linear

    def loop():  # what runs on CPU (model/moe.py): one GEMM per expert into one output
        grouped_linear(act(grouped_linear(rows, w1, counts)), w2, counts).sum().backward()

    def bmm():
        x = rows.view(EXPERTS, rows_per_expert, HIDDEN)  # balanced: no padding needed
        out = torch.bmm(act(torch.bmm(x, w1.transpose(1, 2))), w2.transpose(1, 2))
        out.sum().backward()

    def grouped_forward():
        with torch.no_grad():
            torch._grouped_mm(act(torch._grouped_mm(rows, w1.transpose(1, 2), offs=offsets)), w2.transpose(1, 2),
                              offs=offsets)

    def loop_forward():
        with torch.no_grad():
            grouped_linear(act(grouped_linear(rows, w1, counts)), w2, counts)

    return {name: statistics.median(_time_steps(fn, steps))
            for name, fn in (("loop", loop), ("bmm", bmm), ("loop forward", loop_forward),
                             ("grouped_mm forward", grouped_forward))}


CHILDREN = {"ours": child_ours, "transformers": child_transformers, "gemm": child_gemm}


def run_child_of(script: str, name: str, steps: int):
    """`script --child name steps` in a fresh interpreter: what its child printed last, as JSON."""
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS=os.environ.get("BENCH_THREADS", "2"))
    out = subprocess.run([sys.executable, os.path.abspath(script), "--child", name, str(steps)], env=env, cwd=REPO,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_child(name: str, steps: int):
    return run_child_of(__file__, name, steps)


def ours_against_transformers(script: str, rounds: int, steps: int, what: str) -> None:
    """`script`'s children "ours" and "transformers", each in a fresh interpreter per round, rounds interleaved;
    prints the median ms per step of each and transformers' time / ours per round, under the heading `what`."""
    seconds = {"ours": [], "transformers": []}
    for r in range(rounds):
        for name in (("ours", "transformers") if r % 2 == 0 else ("transformers", "ours")):
            seconds[name].append(statistics.median(run_child_of(script, name, steps)))
        print(f"round {r + 1}/{rounds}: ours {seconds['ours'][-1] * 1e3:.0f} ms, transformers "
              f"{seconds['transformers'][-1] * 1e3:.0f} ms", file=sys.stderr, flush=True)
    ratios = [t / o for t, o in zip(seconds["transformers"], seconds["ours"])]
    print(f"{what}, {rounds} interleaved rounds")
    print("| model | ms per step (median) |")
    print("|---|---|")
    for name in seconds:
        print(f"| {name} | {statistics.median(seconds[name]) * 1e3:.0f} |")
    print(f"transformers / ours: median {statistics.median(ratios):.3f}, rounds {min(ratios):.3f}..{max(ratios):.3f}")


def part_single(args) -> None:
    ours_against_transformers(__file__, args.rounds, args.steps,
                              f"one training step, Mixtral-shaped ({LAYERS} layers, hidden {HIDDEN}, {EXPERTS} experts of "
                              f"{FFN}, top-{TOPK}), seq {SEQ}, micro batch {MICRO}, fp32")


def _ep_worker(rank, port, args, results):
    import torch
    import torch.distributed as dist

    from bench_training import join_gloo_world
    from megatron_lite.arguments import parse_args
    from megatron_lite.parallel import experts, state
    from megatron_lite.training.engine import Engine

    join_gloo_world(rank, 2, port)
    variants = {"ep2": 2, "dp2": 1}
    engines, groups, data = {}, {}, {}
    for name, ep in variants.items():
        argv = OURS + ["--global-batch-size", str(MICRO * args.gas * 2), "--expert-model-parallel-size", str(ep),
                       "--zero-stage", "1"]
        config = parse_args(argv, world_size=2)[0]
        state.initialize(1, 1, expert_model_parallel_size=ep)
        groups[name] = state.current()
        engines[name] = Engine(config, with_scheduler=False)
        state.destroy()
        tokens = _tokens(VOCAB)
        batch = ((tokens[:, :-1], torch.arange(SEQ).expand(MICRO, SEQ)), (tokens[:, 1:], torch.ones(MICRO, SEQ)))
        data[name] = iter(lambda b=batch: b, None)
    for name in variants:
        state.activate(groups[name])
        engines[name].train_step(data[name])
    rounds, a2a = [], []
    for r in range(args.rounds):
        seconds = {}
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            state.activate(groups[name])
            dist.barrier()
            before, start = experts.seconds(), time.perf_counter()
            for _ in range(args.steps):
                engines[name].train_step(data[name])
            seconds[name] = (time.perf_counter() - start) / args.steps
            if name == "ep2":
                a2a.append((experts.seconds() - before) / args.steps)
        rounds.append(seconds)
    results.put((rank, rounds, a2a))
    dist.destroy_process_group()


def part_ep(args) -> None:
    from bench_training import run_ranks

    out = run_ranks(_ep_worker, 2, args)
    rounds = [{n: max(r[1][i][n] for r in out) for n in ("ep2", "dp2")} for i in range(args.rounds)]
    a2a = [max(r[2][i] for r in out) for i in range(args.rounds)]
    ratios = [r["ep2"] / r["dp2"] for r in rounds]
    ep2 = statistics.median(r["ep2"] for r in rounds)
    print(f"2 processes (gloo, 1 thread each), global batch {MICRO * args.gas * 2} (micro {MICRO}, seq {SEQ}), "
          f"{args.rounds} interleaved rounds of {args.steps} steps")
    print("| engine | ms per step (median) |")
    print("|---|---|")
    for n in ("ep2", "dp2"):
        print(f"| {n} | {statistics.median(r[n] for r in rounds) * 1e3:.0f} |")
    print(f"ep2 / dp2: median {statistics.median(ratios):.3f}, rounds {min(ratios):.3f}..{max(ratios):.3f}")
    print(f"ep2 all-to-alls: {statistics.median(a2a) * 1e3:.1f} ms per step ({statistics.median(a2a) / ep2:.1%} of it)")


def part_gemm(args) -> None:
    seconds = {}
    for r in range(args.rounds):
        for name, value in run_child("gemm", args.steps).items():
            seconds.setdefault(name, []).append(value)
    print(f"one MoE layer's experts, {MICRO * SEQ * TOPK} rows balanced over {EXPERTS} experts, hidden {HIDDEN}, "
          f"SwiGLU {FFN}, fp32, {args.rounds} rounds")
    print("| path | ms (median) | vs loop |")
    print("|---|---|---|")
    for name, values in seconds.items():
        base = statistics.median(seconds["loop forward" if "forward" in name else "loop"])
        print(f"| {name} | {statistics.median(values) * 1e3:.2f} | {statistics.median(values) / base:.3f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("single", "ep", "gemm"), default="single")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--gas", type=int, default=2, help="ep: micro-batches per step per rank")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child[0]](int(args.child[1]))))
        return 0
    {"single": part_single, "ep": part_ep, "gemm": part_gemm}[args.part](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
