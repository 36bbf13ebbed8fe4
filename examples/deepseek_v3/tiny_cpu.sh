#!/usr/bin/env bash
# A tiny DeepSeek-V3-shaped GPT on 2 CPU processes in about a minute: the quickstart's data (made once, reused
# after), then Multi-head Latent Attention (a 96-wide query latent and a 64-wide key/value latent, each with its
# RMSNorm; heads of 32 + 16 rotary dimensions for queries and keys, 32 for values) and, after one dense layer,
# DeepSeek-V3's MoE (8 routed experts top-2 by sigmoid scores with a load-balancing expert bias, 2 groups of
# which the best 1 is searched, routed weights renormalised then times 2.5, a shared expert) and one Multi-Token
# Prediction depth (its loss weighted 0.3, DeepSeek-V3's first 10T tokens; logged on its own line), at TP 2 with
# sequence parallelism: the down projections whole on both ranks, the up projections split by head.
# Plain RoPE: DeepSeek-V3 pretrained at 4K without YaRN (its factor 40 came with the context extension; add
# --position-embedding-type yarn --rotary-scaling-factor 40 --yarn-original-max-position-embeddings 4096
# --mscale 1 --mscale-all-dim 1 for that stage).
#
#   bash examples/deepseek_v3/tiny_cpu.sh   # DSV3_TINY_DIR (default dsv3_tiny), DSV3_TINY_ITERS (40)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${DSV3_TINY_DIR:-dsv3_tiny}
ITERS=${DSV3_TINY_ITERS:-40}
bash examples/tiny_data.sh "$OUT"

OMP_NUM_THREADS=1 python3 -m torch.distributed.run --nproc_per_node 2 pretrain_gpt.py \
    --tensor-model-parallel-size 2 --sequence-parallel --zero-stage 1 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 352 --swiglu \
    --normalization RMSNorm --norm-epsilon 1e-6 --disable-bias-linear --position-embedding-type rope \
    --untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0 \
    --multi-latent-attention --q-lora-rank 96 --kv-lora-rank 64 --qk-head-dim 32 --qk-pos-emb-head-dim 16 \
    --v-head-dim 32 --qk-layernorm \
    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 128 --moe-shared-expert-intermediate-size 128 \
    --moe-layer-freq "([0]*1+[1]*3)" --moe-router-score-function sigmoid --moe-router-enable-expert-bias \
    --moe-router-topk-scaling-factor 2.5 --moe-router-num-groups 2 --moe-router-group-topk 1 \
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.3 \
    --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --train-iters "$ITERS" \
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 10 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 \
    --data-path "$OUT/corpus_text_document" --tokenizer-type SentencePieceTokenizer \
    --tokenizer-model "$OUT/spm.model" --split 98,2,0 --num-workers 0 \
    --log-interval 10 --eval-interval "$ITERS" --eval-iters 2 \
    --save "$OUT/ckpt" --save-interval "$ITERS"
echo "tiny_cpu.sh done: checkpoint in $OUT/ckpt"
