#!/usr/bin/env bash
# Continued pretraining of a Hugging Face Llama model: import it at TP 2 x PP 2, train it further on 4 CPU
# processes, export it back, and load the result in transformers.
#
#   HF_MODEL=/path/to/a/LlamaForCausalLM/folder bash examples/llama/continue_from_hf.sh
#   bash examples/llama/continue_from_hf.sh     # no HF_MODEL: makes a small random Llama to stand in for one
#
# HF_MODEL is a folder as save_pretrained writes it (config.json, model.safetensors or its shards, and the
# tokenizer's tokenizer.json), e.g. a downloaded Llama 3.2 1B. Its tokenizer tokenizes the data. Needs
# transformers (pip install 'megatron_lite[hf]') only for the last step and for the stand-in model.
# CONTINUE_DIR (default continue_hf) holds everything it writes; CONTINUE_ITERS (default 20) steps.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${CONTINUE_DIR:-continue_hf}
ITERS=${CONTINUE_ITERS:-20}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1

if [[ -z ${HF_MODEL:-} ]]; then
    HF_MODEL=$OUT/stand_in
    if [[ ! -f $HF_MODEL/config.json ]]; then
        # A corpus and a byte-level BPE tokenizer.json, then a random Llama with grouped-query attention,
        # SwiGLU, RMSNorm and Llama 3.1 RoPE scaling over that vocabulary, saved as a hub model is.
        [[ -f $OUT/corpus.jsonl ]] || python3 tools/make_corpus.py --output "$OUT/corpus.jsonl" --max-docs 400
        [[ -f $OUT/tokenizer/tokenizer.json ]] || python3 tools/train_tokenizer.py --input "$OUT/corpus.jsonl" \
            --model-type byte-level-bpe --vocab-size 2000 --model-prefix "$OUT/tokenizer"
        python3 - "$OUT/tokenizer" "$HF_MODEL" <<'EOF'
import shutil, sys, tokenizers, torch, transformers
source, folder = sys.argv[1], sys.argv[2]
vocab = tokenizers.Tokenizer.from_file(f"{source}/tokenizer.json").get_vocab_size()
config = transformers.LlamaConfig(
    vocab_size=vocab, hidden_size=128, intermediate_size=448, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, max_position_embeddings=16384, rope_theta=500000.0, tie_word_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192})
torch.manual_seed(0)
transformers.LlamaForCausalLM(config).save_pretrained(folder)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f"{source}/{name}", folder)
EOF
    fi
fi
[[ -f $OUT/corpus.jsonl ]] || python3 tools/make_corpus.py --output "$OUT/corpus.jsonl" --max-docs 400

# 1. The data, tokenized with the model's own tokenizer.
if [[ ! -f $OUT/corpus_text_document.idx ]]; then
    python3 tools/preprocess_data.py --input "$OUT/corpus.jsonl" --output-prefix "$OUT/corpus" \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_MODEL" --append-eod --workers 2
fi

# 2. Import: our checkpoint at iteration 0, cut for TP 2 x PP 2, recording the model's tokenizer (a folder:
#    HuggingFaceTokenizer), which must have the model's vocabulary.
rm -rf "$OUT/imported" "$OUT/ckpt" "$OUT/exported"
python3 tools/convert_checkpoint.py import-hf --input "$HF_MODEL" --output "$OUT/imported" \
    --target-tensor-model-parallel-size 2 --target-pipeline-model-parallel-size 2 --tokenizer-model "$HF_MODEL"

# 3. Train further: the model flags and the tokenizer come from the checkpoint (--use-checkpoint-args); it
#    starts at iteration 0 with a fresh optimizer. --seq-length is this run's choice.
python3 -m torch.distributed.run --nproc_per_node 4 pretrain_gpt.py \
    --load "$OUT/imported" --use-checkpoint-args --save "$OUT/ckpt" --save-interval "$ITERS" \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
    --seq-length 128 --micro-batch-size 2 --global-batch-size 8 --train-iters "$ITERS" \
    --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 4 --hidden-dropout 0 --attention-dropout 0 \
    --data-path "$OUT/corpus_text_document" --split 98,2,0 --num-workers 0 --log-interval 5 \
    --eval-interval "$ITERS" --eval-iters 2

# 4. Export (with the tokenizer's files) and load it in transformers.
python3 tools/convert_checkpoint.py export-hf --load "$OUT/ckpt" --output "$OUT/exported"
python3 - "$OUT/exported" <<'EOF'
import sys, torch, transformers
folder = sys.argv[1]
model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
ids = tokenizer("def main():\n    return", return_tensors="pt")
with torch.no_grad():
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
print(f"transformers loaded {folder}: {sum(p.numel() for p in model.parameters()):,} parameters; greedy "
      f"continuation: {tokenizer.decode(out[0])!r}")
EOF
echo "continue_from_hf.sh done: trained checkpoint in $OUT/ckpt, Hugging Face model in $OUT/exported"
