"""Benchmark FusedScaleMaskSoftmax's kernels against torch eager and against a memory floor.

For scores [batch, heads, s, s] it times, in one run:
  kernel   FusedScaleMaskSoftmax forward, and forward + backward;
  eager    scale, masked_fill, softmax (and autograd backward), the unfused torch code;
  copy     scores.clone(): reads and writes the bytes the forward must, the floor for it
           (fresh output included: on some machines its page faults cost more than the bytes);
           forward + backward writes two such outputs, so its floor is two copies.
and prints, per configuration, the times and the ratios eager / kernel and kernel / floor.
Each time is the fastest of --repeats runs after a warm-up, to dodge noise from other load.

  python tools/bench_fused_softmax.py                          # the full table
  python tools/bench_fused_softmax.py --seq 1024 --dtype fp32 --mask causal --threads 2
"""
import argparse
import sys
import time

import torch

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
    return row


def main(argv=None):
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    header = (
        "| s | dtype | mask | copy ms | fwd ms | fwd / copy | eager fwd ms | fwd speedup "
        "| fwd+bwd ms | fwd+bwd / 2 copies | eager fwd+bwd ms | fwd+bwd speedup |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    configs = [(s, d, m) for s in args.seq for d in args.dtype for m in args.mask]
    speedups = []
    for i, (seq, dtype_name, mask_type) in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] s={seq} {dtype_name} {mask_type} ...", file=sys.stderr, flush=True)
        r = measure(args, seq, DTYPES[dtype_name], mask_type, device)
        speedups.append(r["eager_fwd_bwd"] / r["kernel_fwd_bwd"])
        lines.append(
            f"| {seq} | {dtype_name} | {mask_type} | {r['copy']:.1f} | {r['kernel_fwd']:.1f} "
            f"| {r['kernel_fwd'] / r['copy']:.2f}x | {r['eager_fwd']:.1f} | {r['eager_fwd'] / r['kernel_fwd']:.2f}x "
            f"| {r['kernel_fwd_bwd']:.1f} | {r['kernel_fwd_bwd'] / (2 * r['copy']):.2f}x | {r['eager_fwd_bwd']:.1f} "
            f"| {speedups[-1]:.2f}x |"
        )
    print(f"b={args.batch} heads={args.heads} device={device} threads={torch.get_num_threads()} "
          f"fastest of {args.repeats} runs")
    print("\n".join(lines))
    print(f"summary: {len(configs)} configurations, fwd+bwd speedup over eager "
          f"{min(speedups):.2f}x to {max(speedups):.2f}x")


if __name__ == "__main__":
    main()
