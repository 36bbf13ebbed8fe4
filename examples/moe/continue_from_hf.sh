#!/usr/bin/env bash
# Continued pretraining of a Hugging Face Mixture-of-Experts model: import it at PP 2 x EP 2, train it further on
# 4 CPU processes (PP 2 x DP 2, the experts split over the 2 data-parallel ranks), export it back, and load the
# result in transformers, whose logits must be ours.
#
#   HF_MODEL=/path/to/a/MixtralForCausalLM/folder bash examples/moe/continue_from_hf.sh
#   bash examples/moe/continue_from_hf.sh     # no HF_MODEL: makes a small random Mixtral to stand in for one
#
# HF_MODEL is a folder as save_pretrained writes it: a MixtralForCausalLM, Qwen2MoeForCausalLM or
# Qwen3MoeForCausalLM (config.json, model.safetensors or its shards) with its tokenizer, which tokenizes the data:
# tokenizer.model (SentencePiece, as Mixtral ships it) where there is one, else tokenizer.json. Every pipeline
# stage must hold a layer with experts (Mixtral has them in every layer). Needs transformers
# (pip install 'megatron_lite[hf]') only for the last step and for the stand-in model.
# CONTINUE_DIR (default continue_moe) holds everything it writes; CONTINUE_ITERS (default 20) steps.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${CONTINUE_DIR:-continue_moe}
ITERS=${CONTINUE_ITERS:-20}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1

[[ -f $OUT/corpus.jsonl ]] || python3 tools/make_corpus.py --output "$OUT/corpus.jsonl" --max-docs 400
if [[ -z ${HF_MODEL:-} ]]; then
    HF_MODEL=$OUT/stand_in
    if [[ ! -f $HF_MODEL/config.json ]]; then
        # A SentencePiece tokenizer of the corpus, then a random Mixtral over its vocabulary (4 experts, top 2,
        # grouped-query attention, an untied head), saved as a hub model is, tokenizer.model beside it.
        [[ -f $OUT/spm.model ]] || python3 tools/train_tokenizer.py --input "$OUT/corpus.jsonl" --vocab-size 2000 \
            --model-prefix "$OUT/spm"
        python3 - "$OUT/spm.model" "$HF_MODEL" <<'EOF'
import shutil, sys, sentencepiece, torch, transformers
source, folder = sys.argv[1], sys.argv[2]
vocab = sentencepiece.SentencePieceProcessor(model_file=source).vocab_size()
config = transformers.MixtralConfig(
    vocab_size=vocab, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=4096,
    rope_theta=1000000.0, tie_word_embeddings=False, router_aux_loss_coef=0.01)
torch.manual_seed(0)
transformers.MixtralForCausalLM(config).save_pretrained(folder)
shutil.copy(source, f"{folder}/tokenizer.model")
EOF
    fi
fi
if [[ -f $HF_MODEL/tokenizer.model ]]; then
    TOKENIZER=(--tokenizer-type SentencePieceTokenizer --tokenizer-model "$HF_MODEL/tokenizer.model")
else
    TOKENIZER=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_MODEL")
fi

# 1. The data, tokenized with the model's own tokenizer.
if [[ ! -f $OUT/corpus_text_document.idx ]]; then
    python3 tools/preprocess_data.py --input "$OUT/corpus.jsonl" --output-prefix "$OUT/corpus" "${TOKENIZER[@]}" \
        --append-eod --workers 2
fi

# 2. Import: our checkpoint at iteration 0, cut for PP 2 with the experts split in 2 (EP 2), recording the
#    model's tokenizer, which must have the model's vocabulary.
rm -rf "$OUT/imported" "$OUT/ckpt" "$OUT/exported"
python3 tools/convert_checkpoint.py import-hf --input "$HF_MODEL" --output "$OUT/imported" \
    --target-tensor-model-parallel-size 1 --target-pipeline-model-parallel-size 2 \
    --target-expert-model-parallel-size 2 "${TOKENIZER[@]}"

# 3. Train further on PP 2 x DP 2, EP 2 taken out of DP: the model flags, experts and router included, and the
#    tokenizer come from the checkpoint (--use-checkpoint-args); the router's aux-loss coefficient and
#    --seq-length are this run's. EP > 1 saves its optimizer under ZeRO 1. It starts at iteration 0 with a
#    fresh optimizer.
python3 -m torch.distributed.run --nproc_per_node 4 pretrain_gpt.py \
    --load "$OUT/imported" --use-checkpoint-args --save "$OUT/ckpt" --save-interval "$ITERS" \
    --pipeline-model-parallel-size 2 --expert-model-parallel-size 2 --zero-stage 1 --moe-aux-loss-coeff 0.01 \
    --seq-length 128 --micro-batch-size 2 --global-batch-size 8 --train-iters "$ITERS" \
    --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 4 --hidden-dropout 0 --attention-dropout 0 \
    --data-path "$OUT/corpus_text_document" --split 98,2,0 --num-workers 0 --log-interval 5 \
    --eval-interval "$ITERS" --eval-iters 2

# 4. Export (with the tokenizer's files), load it in transformers and compare its logits with our model's.
python3 tools/convert_checkpoint.py export-hf --load "$OUT/ckpt" --output "$OUT/exported"
python3 - "$OUT/exported" "$OUT/ckpt" <<'EOF'
import sys, torch, transformers
from megatron_lite.checkpoint.dense import load_dense_model
from megatron_lite.data.tokenizer import build_tokenizer
folder, ckpt = sys.argv[1], sys.argv[2]
model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()  # its architecture from config.json
config, ours = load_dense_model(ckpt)
d = config.data
tokenizer = build_tokenizer(d.tokenizer_type, d.tokenizer_model, config.model.vocab_size, d.vocab_file, d.merge_file)
ids = torch.tensor([tokenizer.tokenize("def main():\n    return")])
with torch.no_grad():
    theirs = model(ids).logits
    mine = ours(ids, torch.arange(ids.shape[1]).expand_as(ids))[..., :config.model.vocab_size]  # padding cut
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
difference = ((theirs - mine).norm() / theirs.norm()).item()
assert difference <= 1e-5, f"transformers' logits differ from ours by {difference:.2e} (relative)"
print(f"transformers loaded {folder} as {type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} "
      f"parameters; logits equal ours (relative difference {difference:.1e}); greedy continuation: "
      f"{tokenizer.detokenize(out[0].tolist())!r}")
EOF
echo "continue_from_hf.sh done: trained checkpoint in $OUT/ckpt, Hugging Face model in $OUT/exported"
