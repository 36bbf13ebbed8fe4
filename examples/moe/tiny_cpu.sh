#!/usr/bin/env bash
# A tiny Mixture-of-Experts GPT on 2 CPU processes in about a minute: the quickstart's data (made once, reused
# after), then a Llama-style block whose MLP is 8 routed experts (top-2, renormalised as Mixtral) beside a shared
# expert (as DeepSeek and Qwen2-MoE), the first layer dense, load-balancing and z-losses on, the experts split
# over the two ranks (--expert-model-parallel-size 2, taken out of data parallelism) with ZeRO 1. Prints the loss
# falling and, per log line, each MoE layer's max/mean expert load, the router losses and the dropped fraction.
#
#   bash examples/moe/tiny_cpu.sh            # MOE_TINY_DIR (default moe_tiny), MOE_TINY_ITERS (60)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${MOE_TINY_DIR:-moe_tiny}
ITERS=${MOE_TINY_ITERS:-60}
bash examples/tiny_data.sh "$OUT"

OMP_NUM_THREADS=1 python3 -m torch.distributed.run --nproc_per_node 2 pretrain_gpt.py \
    --expert-model-parallel-size 2 --zero-stage 1 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 352 --swiglu \
    --normalization RMSNorm --disable-bias-linear --position-embedding-type rope \
    --untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0 \
    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 128 --moe-shared-expert-intermediate-size 128 \
    --moe-layer-freq "([0]*1+[1]*3)" --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 \
    --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --train-iters "$ITERS" \
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 10 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 \
    --data-path "$OUT/corpus_text_document" --tokenizer-type SentencePieceTokenizer \
    --tokenizer-model "$OUT/spm.model" --split 98,2,0 --num-workers 0 \
    --log-interval 10 --eval-interval "$ITERS" --eval-iters 2 \
    --save "$OUT/ckpt" --save-interval "$ITERS"
echo "tiny_cpu.sh done: checkpoint in $OUT/ckpt"
