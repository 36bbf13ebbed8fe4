"""Activation bytes of one transformer layer per micro-batch: measured, estimated, and Korthikanti et al.'s formula.

For TP 1 / 2 / 4, sequence parallelism off / on and recompute none / selective / full, one row each:
  measured   what autograd saves for the first layer of a real GPT on each TP rank, plus what recompute
             keeps alive (saved_tensors_hooks; tests/cost/activation_census.py), rank 0's (every rank
             measures the same)
  estimate   cost/activations.py
  paper      Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
             for GPT-2's block, evaluated for this run's element sizes: e bytes per activation (the
             paper's 2-byte terms; 4 in fp32) and k per dropout-mask element (the paper's 1 byte; on CPU
             torch keeps the mask in the activation's dtype, so k = e here):
               t = 1:          sbh (16e + 2k) + (2e + k) a s^2 b
               TP t:           sbh (4e + 2k + 12e/t) + (2e + k) a s^2 b / t
               TP t + SP:      sbh (16e + 2k) / t + (2e + k) a s^2 b / t
               selective:      the same without the a s^2 b term
               full:           the layer's input only, 2 sbh in the paper: e sbh (/ t with SP)
             (with e = 2, k = 1: sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)), sbh(34/t + 5as/(ht)), sbh 34/t)
Our GPT-2 layer keeps the LayerNorms' mean and rstd besides (16 bs, / t with SP), which the paper leaves out.
--block llama measures the Llama block instead (SwiGLU, RMSNorm, 2 key/value groups for the 4 heads: at TP 4
two ranks share each group, no biases, RoPE), which the paper's formula does not describe.
The model: 4 layers, hidden 64, 4 heads, seq 32, micro batch 2, dropout 0.1, fp32, --attention-backend fused
(the paper's attention: the s x s softmax output, dropout mask and output are kept).

    OMP_NUM_THREADS=1 python benchmarks/activation_table.py [--block llama] [--backend sdpa] [--micro-batch-size 1] [--bf16]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RECOMPUTE = {"none": [], "selective": ["--recompute-granularity", "selective"],
             "full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1"]}


def layer_config(tp, sp, recompute, backend="fused", block="gpt2", micro=2, bf16=False):
    from tests.model.gpt_layouts import tiny_config
    from tests.model.test_llama_parallel import LLAMA

    extra = ["--micro-batch-size", str(micro), "--global-batch-size", "8", "--hidden-dropout", "0.1",
             "--attention-dropout", "0.1", "--attention-backend", backend] + RECOMPUTE[recompute]
    extra += ["--sequence-parallel"] if sp else []
    extra += (["--bf16"] if bf16 else []) + (list(LLAMA) if block == "llama" else [])
    return tiny_config(tp, 1, 1, extra)


def paper_bytes(config, k: int) -> int:
    """Korthikanti et al.'s per-layer formula with e-byte activations and k-byte dropout masks."""
    m, t, sp = config.model, config.parallel.tensor_model_parallel_size, config.parallel.sequence_parallel
    e = 4 if config.precision.dtype_name == "fp32" else 2
    b, s, h, a = config.batch.micro_batch_size, m.seq_length, m.hidden_size, m.num_attention_heads
    sbh, scores = s * b * h, a * s * s * b
    if m.recompute_granularity == "full":
        return e * sbh // (t if sp else 1)
    linear = (16 * e + 2 * k) * sbh // t if sp else (4 * e + 2 * k) * sbh + 12 * e * sbh // t
    attention = 0 if m.recompute_granularity == "selective" else (2 * e + k) * scores // t
    return linear + attention


def _census(tp, configs):
    from megatron_lite.parallel import state
    from tests.cost.activation_census import saved_bytes_per_layer

    state.initialize(tp, 1)
    return [saved_bytes_per_layer(config) for config in configs]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="One layer's saved activations per micro-batch: census, estimate, "
                                                 "paper, for TP 1/2/4 x SP x recompute.")
    parser.add_argument("--block", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--backend", choices=("fused", "sdpa"), default="fused", help="--attention-backend")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args(argv)

    from megatron_lite.cost import activations
    from tests.harness import run_distributed, shutdown_pools

    gpt2 = args.block == "gpt2"
    print(f"{args.block} block, --attention-backend {args.backend}, micro batch {args.micro_batch_size}, "
          f"{'bf16' if args.bf16 else 'fp32'}, CPU")
    print(f"{'TP':>2} {'SP':>3} {'recompute':>9} {'measured':>10} {'estimate':>10} {'meas/est':>8} "
          f"{'paper (k=e)':>12} {'meas/paper':>10} {'paper (k=1)':>12}")
    worst, count = 0.0, 0
    for tp in (1, 2, 4):
        rows = [(sp, rc) for sp in ((False,) if tp == 1 else (False, True)) for rc in RECOMPUTE]
        configs = [layer_config(tp, sp, rc, args.backend, args.block, args.micro_batch_size, args.bf16)
                   for sp, rc in rows]
        measured = run_distributed(_census, tp, tp, configs)[0]
        shutdown_pools()
        for (sp, recompute), config, got in zip(rows, configs, measured):
            want = activations.stage_layer_bytes(config, 1, "cpu")[0]
            worst, count = max(worst, abs(got / want - 1)), count + 1
            e = 4 if config.precision.dtype_name == "fp32" else 2
            paper = (f"{paper_bytes(config, k=e):>12,} {got / paper_bytes(config, k=e):>10.3f} "
                     f"{paper_bytes(config, k=1):>12,}" if gpt2 else f"{'-':>12} {'-':>10} {'-':>12}")
            print(f"{tp:>2} {'on' if sp else 'off':>3} {recompute:>9} {got:>10,} {want:>10,} {got / want:>8.3f} "
                  f"{paper}", flush=True)
    print(f"activation_table: {count} rows, worst |measured/estimate - 1| = {100 * worst:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
