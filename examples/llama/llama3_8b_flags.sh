# A Llama-3-8B-shaped model as pretrain_gpt.py flags, to source (not run): 32 layers, hidden 4096, 32 query
# heads sharing 8 key/value groups, SwiGLU FFN 14336, vocabulary 128256, sequence 8192, RoPE base 500000
# with Llama 3.1's scaling (factor 8), RMSNorm eps 1e-5, no biases, untied output head, no dropout, bf16.
# 8,030,261,248 parameters (cost/arithmetic.py `total_parameters`), as Llama 3 8B.
#
#   source examples/llama/llama3_8b_flags.sh
#   sbatch --nodes 2 examples/slurm/pretrain_gpt.sbatch        # sbatch passes MODEL_ARGS, TP, PP on
#   python3 tools/tune_parallelism.py plan --nodes 2 --gpus-per-node 8 --gpu-memory-gb 80 \
#       "${LLAMA3_8B_ARGS[@]}" --global-batch-size 128
#
# In a batch script of your own, source it before the line that reads MODEL_ARGS. --vocab-size must agree
# with the tokenizer (validation refuses a SentencePiece model of another size); tools/synthetic_data.py
# --vocab-size 128256 makes NullTokenizer data of this vocabulary for trying layouts.
# shellcheck shell=bash

LLAMA3_8B_ARGS=(
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32
    --group-query-attention --num-query-groups 8
    --swiglu --ffn-hidden-size 14336
    --normalization RMSNorm --norm-epsilon 1e-5
    --disable-bias-linear --untie-embeddings-and-output-weights
    --position-embedding-type rope --rotary-base 500000 --use-rope-scaling --rope-scaling-factor 8
    --seq-length 8192 --max-position-embeddings 8192 --vocab-size 128256
    --hidden-dropout 0 --attention-dropout 0
    --bf16
)
export MODEL_ARGS="${LLAMA3_8B_ARGS[*]}"
# The layout tools/tune_parallelism.py plan chose for 2 nodes x 8 GPUs x 80 GB (examples/llama/README.md);
# a value already in the environment wins.
export TP=${TP:-8} PP=${PP:-1}
