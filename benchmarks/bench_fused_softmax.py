"""Benchmark FusedScaleMaskSoftmax's kernels against torch eager and against a memory floor.

For scores [batch, heads, s, s] it times, in one run:
  kernel   FusedScaleMaskSoftmax forward, and forward + backward;
  eager    scale, masked_fill, softmax (and autograd backward), the unfused torch code;
  copy     scores.clone(): reads and writes the bytes the forward must, the floor for it
           (fresh output included: on some machines its page faults cost more than the bytes);
           forward + backward writes two such outputs, so its floor is two copies.
and prints, per configuration, the times and the ratios eager / kernel and kernel / floor.
Each time is the fastest of --repeats runs after a warm-up, to dodge noise from other load.

Options add, for the GPU check (scripts/gpu_check.sh):
  --compile    the eager code under torch.compile (forward + backward);
  --attention  whole attention, forward + backward: q k^T -> this softmax -> @ v (what
               --attention-backend fused runs) against torch's scaled_dot_product_attention
               (--attention-backend sdpa; is_causal, or a boolean mask for padding), head dim
               --head-dim; the faster one is the row's "winner";
  --json PATH  every row as JSON (tools exchange data, not log text). A configuration that fails
               (out of memory, say) is recorded with its error and the table goes on.

  python benchmarks/bench_fused_softmax.py                          # the full table
  python benchmarks/bench_fused_softmax.py --seq 1024 --dtype fp32 --mask causal --threads 2
  python benchmarks/bench_fused_softmax.py --device cuda --dtype fp16 bf16 --seq 512 1024 2048 4096 8192 \
      --batch 1 --compile --attention --json softmax.json
"""
import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from megatron_lite.model.fused_softmax import FusedScaleMaskSoftmax, kernel_available

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4, help="batch size b")
    parser.add_argument("--heads", type=int, default=16, help="attention heads np")
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048], help="sequence lengths (sq = sk)")
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"], help="score dtypes")
    parser.add_argument("--mask", nargs="+", choices=["causal", "padding"], default=["causal", "padding"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement; the fastest counts")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--compile", action="store_true", help="also time the eager code under torch.compile")
    parser.add_argument("--attention", action="store_true", help="also time whole attention: fused path vs SDPA")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension for --attention")
    parser.add_argument("--json", default=None, help="write every row as JSON here")
    return parser.parse_args(argv)


def fastest_ms(fn, repeats, device):
    """The fastest of `repeats` runs of fn() after one warm-up, in milliseconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def make_inputs(args, seq, dtype, mask_type, device):
    """Scores, their gradient and the mask; padding hides a random tail of keys per sequence."""
    generator = torch.Generator().manual_seed(seq)
    shape = (args.batch, args.heads, seq, seq)
    scores = torch.randn(shape, generator=generator).to(device, dtype)
    grad = torch.randn(shape, generator=generator).to(device, dtype)
    if mask_type == "causal":
        eager_mask = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
        return scores, grad, None, eager_mask
    lengths = torch.randint(seq // 2, seq + 1, (args.batch,), generator=generator)
    mask = (torch.arange(seq) >= lengths[:, None]).view(args.batch, 1, 1, seq).expand(-1, -1, seq, -1)
    mask = mask.contiguous().to(device)
    return scores, grad, mask, mask


def measure(args, seq, dtype, mask_type, device):
    scores, grad, mask, eager_mask = make_inputs(args, seq, dtype, mask_type, device)
    scale = 1.0 / 8.0
    fused = FusedScaleMaskSoftmax(mask_type, scale=scale)
    if not kernel_available(scores):
        raise SystemExit(f"no compiled kernel for {dtype} on {device}: build megatron_lite._C first")
    leaf = scores.detach().requires_grad_(True)

    def eager_forward(x):
        return torch.softmax((x * scale).masked_fill(eager_mask, float("-inf")), dim=-1)

    def backward(forward):
        leaf.grad = None
        forward(leaf).backward(grad)

    with torch.no_grad():
        row = {
            "copy": fastest_ms(lambda: scores.clone(), args.repeats, device),
            "kernel_fwd": fastest_ms(lambda: fused(scores, mask), args.repeats, device),
            "eager_fwd": fastest_ms(lambda: eager_forward(scores), args.repeats, device),
        }
    row["kernel_fwd_bwd"] = fastest_ms(lambda: backward(lambda x: fused(x, mask)), args.repeats, device)
    row["eager_fwd_bwd"] = fastest_ms(lambda: backward(eager_forward), args.repeats, device)
    # Bytes a forward moves at least (read the scores, write the probabilities), over the copy's time.
    row["copy_gb_per_s"] = 2 * scores.numel() * scores.element_size() / (row["copy"] * 1e-3) / 1e9
    if args.compile:
        # Dynamic shapes: one compilation serves every length (a recompile per length would also
        # reach dynamo's recompile limit, after which it silently runs eager).
        compiled = torch.compile(eager_forward, dynamic=True)
        row["compiled_fwd_bwd"] = fastest_ms(lambda: backward(compiled), args.repeats, device)
    del scores, grad, leaf
    if args.attention:
        row.update(measure_attention(args, seq, dtype, mask_type, mask, fused, device))
    return row


def measure_attention(args, seq, dtype, mask_type, mask, fused, device):
    """Forward + backward of whole attention [b, np, s, d]: our fused path and torch's SDPA."""
    generator = torch.Generator().manual_seed(seq + 1)
    shape = (args.batch, args.heads, seq, args.head_dim)
    q, k, v, grad = (torch.randn(shape, generator=generator).to(device, dtype).requires_grad_(i < 3)
                     for i in range(4))
    scale = args.head_dim ** -0.5
    fused.scale = scale
    keep = None if mask is None else ~mask  # SDPA's boolean mask: True = attend

    def fused_path():
        return torch.matmul(fused(torch.matmul(q, k.transpose(-2, -1)), mask), v)

    def sdpa_path():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=keep is None, scale=scale)

    def fwd_bwd(path):
        for t in (q, k, v):
            t.grad = None
        path().backward(grad)

    out = {"attention_fused_fwd_bwd": fastest_ms(lambda: fwd_bwd(fused_path), args.repeats, device),
           "attention_sdpa_fwd_bwd": fastest_ms(lambda: fwd_bwd(sdpa_path), args.repeats, device)}
    out["attention_winner"] = "fused" if out["attention_fused_fwd_bwd"] < out["attention_sdpa_fwd_bwd"] else "sdpa"
    return out


def main(argv=None):
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.compile:  # every dtype x mask compiles once; keep them all
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    header = (
        "| s | dtype | mask | copy ms | fwd ms | fwd / copy | eager fwd ms | fwd speedup "
        "| fwd+bwd ms | fwd+bwd / 2 copies | eager fwd+bwd ms | fwd+bwd speedup |"
    )
    if args.compile:
        header += " compiled fwd+bwd ms |"
    if args.attention:
        header += " attention fused ms | attention SDPA ms | winner |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    configs = [(s, d, m) for s in args.seq for d in args.dtype for m in args.mask]
    speedups, rows = [], []
    for i, (seq, dtype_name, mask_type) in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] s={seq} {dtype_name} {mask_type} ...", file=sys.stderr, flush=True)
        key = {"seq": seq, "dtype": dtype_name, "mask": mask_type, "batch": args.batch, "heads": args.heads,
               "device": str(device)}
        try:
            r = measure(args, seq, DTYPES[dtype_name], mask_type, device)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # out of memory, a missing kernel: record, go on
            rows.append({**key, "error": (str(e).splitlines() or [type(e).__name__])[0]})
            lines.append(f"| {seq} | {dtype_name} | {mask_type} | failed: {rows[-1]['error'][:100]} |")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        rows.append({**key, **r})
        speedups.append(r["eager_fwd_bwd"] / r["kernel_fwd_bwd"])
        line = (
            f"| {seq} | {dtype_name} | {mask_type} | {r['copy']:.2f} | {r['kernel_fwd']:.2f} "
            f"| {r['kernel_fwd'] / r['copy']:.2f}x | {r['eager_fwd']:.2f} | {r['eager_fwd'] / r['kernel_fwd']:.2f}x "
            f"| {r['kernel_fwd_bwd']:.2f} | {r['kernel_fwd_bwd'] / (2 * r['copy']):.2f}x | {r['eager_fwd_bwd']:.2f} "
            f"| {speedups[-1]:.2f}x |"
        )
        if args.compile:
            line += f" {r['compiled_fwd_bwd']:.2f} |"
        if args.attention:
            line += (f" {r['attention_fused_fwd_bwd']:.2f} | {r['attention_sdpa_fwd_bwd']:.2f} "
                     f"| {r['attention_winner']} |")
        lines.append(line)
        print(line, file=sys.stderr, flush=True)
        if args.json:  # after every row: a run stopped early still leaves what it measured
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    print(f"b={args.batch} heads={args.heads} device={device} threads={torch.get_num_threads()} "
          f"fastest of {args.repeats} runs")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if speedups:
        print(f"summary: {len(configs)} configurations, {len(configs) - len(speedups)} failed, fwd+bwd speedup "
              f"over eager {min(speedups):.2f}x to {max(speedups):.2f}x")
    else:
        print(f"summary: all {len(configs)} configurations failed")
        sys.exit(1)


if __name__ == "__main__":
    main()
