#!/usr/bin/env bash
# The tiny CPU examples' data, made once in OUT and reused after: Python's standard library as a JSONL corpus,
# a SentencePiece tokenizer, Megatron's .bin/.idx. A rerun keeps what an earlier (maybe interrupted) run made;
# the tools refuse to overwrite.
#
#   bash examples/tiny_data.sh OUT [MAX_DOCS]       # run from the repository root
set -euo pipefail
OUT=$1
MAX_DOCS=${2:-600}
mkdir -p "$OUT"
[[ -f $OUT/corpus.jsonl ]] || python3 tools/make_corpus.py --output "$OUT/corpus.jsonl" --max-docs "$MAX_DOCS"
[[ -f $OUT/spm.model ]] || python3 tools/train_tokenizer.py --input "$OUT/corpus.jsonl" --vocab-size 2000 \
    --model-prefix "$OUT/spm"
if [[ ! -f $OUT/corpus_text_document.idx ]]; then
    python3 tools/preprocess_data.py --input "$OUT/corpus.jsonl" --output-prefix "$OUT/corpus" \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model "$OUT/spm.model" --append-eod --workers 2
fi
