#!/usr/bin/env bash
# The quickstart: install what is needed (CPU torch first), turn Python's own standard library
# into a small JSONL corpus, train a SentencePiece tokenizer, preprocess to Megatron's .bin/.idx,
# then pretrain a small GPT on 2 CPU processes (pipeline-parallel over 2 stages) and print the
# loss falling. Leaves everything under ./quickstart (corpus, tokenizer, data, checkpoints, TensorBoard).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${QUICKSTART_DIR:-quickstart}
ITERS=${QUICKSTART_ITERS:-100}
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q --no-build-isolation -e .
mkdir -p "$OUT"

# A rerun keeps the data an earlier run made: the tools refuse to write over an output (--overwrite would).
[[ -f $OUT/corpus.jsonl ]] || python3 tools/make_corpus.py --output "$OUT/corpus.jsonl" --max-docs 1500
[[ -f $OUT/spm.model ]] || python3 tools/train_tokenizer.py --input "$OUT/corpus.jsonl" --vocab-size 2000 \
    --model-prefix "$OUT/spm"
[[ -f $OUT/corpus_text_document.idx ]] || python3 tools/preprocess_data.py --input "$OUT/corpus.jsonl" \
    --output-prefix "$OUT/corpus" --tokenizer-type SentencePieceTokenizer --tokenizer-model "$OUT/spm.model" \
    --append-eod --workers 2

OMP_NUM_THREADS=1 python3 -m torch.distributed.run --nproc_per_node 2 pretrain_gpt.py \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 4 --global-batch-size 32 --train-iters "$ITERS" \
    --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 15 --lr-decay-style cosine --clip-grad 1.0 \
    --hidden-dropout 0.0 --attention-dropout 0.0 \
    --data-path "$OUT/corpus_text_document" --tokenizer-type SentencePieceTokenizer \
    --tokenizer-model "$OUT/spm.model" --split 98,2,0 --num-workers 0 \
    --log-interval 10 --eval-interval 50 --eval-iters 4 \
    --save "$OUT/ckpt" --save-interval 50 --tensorboard-dir "$OUT/tb"
echo "quickstart done: checkpoints in $OUT/ckpt, TensorBoard logs in $OUT/tb (tensorboard --logdir $OUT/tb)"
