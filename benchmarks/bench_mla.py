"""One training step of a small DeepSeek-V3-shaped model (Multi-head Latent Attention + DeepSeek's MoE), ours
against transformers' DeepseekV3ForCausalLM of the same shape.

    python benchmarks/bench_mla.py [--rounds 5] [--steps 3]              # ours vs transformers, one training step
    python benchmarks/bench_mla.py --part core [--rounds 5] [--steps 10]  # the attention core: values padded or not

The model: 4 layers (the first dense, ffn 512; then 8 routed experts of 256, top-2 by sigmoid scores with the
expert bias, 2 groups of which 1 is searched, routed scaling 2.5, one shared expert of 256), hidden 256, 8 heads,
query latent 128 and key/value latent 64 with their RMSNorms, heads of 32 + 16 rotary dimensions and values of 32,
vocabulary 2048, untied head; seq 512, micro batch 2, fp32, SDPA attention, fused AdamW. Ours is GPTModel in one
process (no process group), theirs DeepseekV3ForCausalLM with its default experts path. Each variant runs in a
fresh interpreter per round, rounds interleaved (this VM drifts 10-40% within minutes); printed: the median ms per
step and transformers' time / ours per round (the issue's target: >= 1.0).

core: SDPA forward and backward at the model's attention shape (b 2, 8 heads, s 512, queries and keys 48 wide,
values 32), causal, fp32: the values as they are (CPU's flash kernel refuses them: the math path, [b, n, s, s]
kept) against padded to 48 and the output sliced (the flash kernel; what model/attention.py does), rounds
interleaved in this process; printed: ms per call and math / padded.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from bench_moe import _time_steps, ours_against_transformers, time_our_steps, time_transformers_steps

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, MICRO = 4, 256, 8, 2048, 512, 2
DENSE_FFN, EXPERTS, TOPK, MOE_FFN = 512, 8, 2, 256
Q_LORA, KV_LORA, NOPE, ROPE, V = 128, 64, 32, 16, 32
OURS = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
        "--seq-length", str(SEQ), "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "128",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", str(MICRO),
        "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
        "--multi-latent-attention", "--q-lora-rank", str(Q_LORA), "--kv-lora-rank", str(KV_LORA),
        "--qk-head-dim", str(NOPE), "--qk-pos-emb-head-dim", str(ROPE), "--v-head-dim", str(V), "--qk-layernorm",
        "--ffn-hidden-size", str(DENSE_FFN), "--num-experts", str(EXPERTS), "--moe-router-topk", str(TOPK),
        "--moe-ffn-hidden-size", str(MOE_FFN), "--moe-shared-expert-intermediate-size", str(MOE_FFN),
        "--moe-layer-freq", f"([0]*1+[1]*{LAYERS - 1})", "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor", "2.5",
        "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
        "--attention-backend", "sdpa", "--lr", "1e-4", "--seed", "3"]


def child_ours(steps: int):
    return time_our_steps(OURS, VOCAB, steps)


def child_transformers(steps: int):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=DENSE_FFN, moe_intermediate_size=MOE_FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=1,
        n_routed_experts=EXPERTS, num_experts_per_tok=TOPK, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA,
        qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=V, max_position_embeddings=SEQ,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_dropout=0.0, attn_implementation="sdpa")
    return time_transformers_steps(DeepseekV3ForCausalLM(config), VOCAB, steps)


CHILDREN = {"ours": child_ours, "transformers": child_transformers}


def part_core(args) -> None:
    import torch
    import torch.nn.functional as F

    qk, v = NOPE + ROPE, V
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(MICRO, HEADS, SEQ, qk, generator=g, requires_grad=True) for _ in range(2))
    values = torch.randn(MICRO, HEADS, SEQ, v, generator=g, requires_grad=True)

    def call(padded):
        vv = F.pad(values, (0, qk - v)) if padded else values
        out = F.scaled_dot_product_attention(q, k, vv, is_causal=True)
        (out[..., :v] if padded else out).sum().backward()

    seconds = {"math": [], "padded": []}
    for r in range(args.rounds):
        for name in (("math", "padded") if r % 2 == 0 else ("padded", "math")):
            seconds[name].append(statistics.median(_time_steps(lambda: call(name == "padded"), args.steps)))
    ratios = [a / b for a, b in zip(seconds["math"], seconds["padded"])]
    print(f"attention core forward + backward, b {MICRO}, {HEADS} heads, s {SEQ}, q/k {qk} wide, v {v}, causal, fp32, "
          f"{args.rounds} interleaved rounds")
    print(f"math (values as they are) {statistics.median(seconds['math']) * 1e3:.1f} ms, padded (flash) "
          f"{statistics.median(seconds['padded']) * 1e3:.1f} ms; math / padded: median {statistics.median(ratios):.2f}, "
          f"rounds {min(ratios):.2f}..{max(ratios):.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("step", "core"), default="step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child[0]](int(args.child[1]))))
        return 0
    if args.part == "core":
        part_core(args)
        return 0
    ours_against_transformers(__file__, args.rounds, args.steps,
                              f"one training step, DeepSeek-V3-shaped ({LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, "
                              f"MLA latents {Q_LORA}/{KV_LORA}, heads {NOPE}+{ROPE}/{V}, {EXPERTS} experts of {MOE_FFN} "
                              f"top-{TOPK} + shared), seq {SEQ}, micro batch {MICRO}, fp32")
    return 0


if __name__ == "__main__":
    sys.exit(main())
