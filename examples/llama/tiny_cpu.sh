#!/usr/bin/env bash
# A tiny Llama-shaped GPT on 2 CPU processes in about a minute: the quickstart's data (Python's standard
# library as a JSONL corpus, a SentencePiece tokenizer, Megatron's .bin/.idx; made once, reused after),
# then the Llama block - RMSNorm, SwiGLU, grouped-query attention, no biases, RoPE with Llama 3.1
# scaling, untied head - at TP 2 with sequence parallelism. 8 query heads share 2 key/value groups,
# as Llama 3's 32 share 8; each TP rank holds 4 query heads and their group. Prints the loss falling.
#
#   bash examples/llama/tiny_cpu.sh            # LLAMA_TINY_DIR (default llama_tiny), LLAMA_TINY_ITERS (60)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${LLAMA_TINY_DIR:-llama_tiny}
ITERS=${LLAMA_TINY_ITERS:-60}
bash examples/tiny_data.sh "$OUT"

# The shape of examples/llama/llama3_8b_flags.sh, scaled down: hidden 128, FFN 3.5 x hidden, 4 layers.
OMP_NUM_THREADS=1 python3 -m torch.distributed.run --nproc_per_node 2 pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel \
    --num-layers 4 --hidden-size 128 --num-attention-heads 8 --group-query-attention --num-query-groups 2 \
    --ffn-hidden-size 448 --swiglu --normalization RMSNorm --norm-epsilon 1e-5 --disable-bias-linear \
    --position-embedding-type rope --rotary-base 500000 --use-rope-scaling --rope-scaling-factor 8 \
    --untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0 \
    --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --train-iters "$ITERS" \
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 10 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 \
    --data-path "$OUT/corpus_text_document" --tokenizer-type SentencePieceTokenizer \
    --tokenizer-model "$OUT/spm.model" --split 98,2,0 --num-workers 0 \
    --log-interval 10 --eval-interval "$ITERS" --eval-iters 2 \
    --save "$OUT/ckpt" --save-interval "$ITERS"
echo "tiny_cpu.sh done: checkpoint in $OUT/ckpt"
