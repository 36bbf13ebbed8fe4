# Shared by the examples/slurm/*.sbatch scripts (sourced, not run): input checks that fail in
# seconds with the variable's name, the rendezvous address, a training step that survives the
# batch shell being signalled, and requeueing an unfinished run.
# shellcheck shell=bash

fail() {  # one line in the job's output file, then exit 2 (bad input, nothing started)
    echo "${SCRIPT_NAME:-sbatch}: error: $*" >&2
    exit 2
}

note() {
    echo "${SCRIPT_NAME:-sbatch}: $*"
}

require_positive_int() {  # NAME VALUE
    [[ $2 =~ ^[1-9][0-9]*$ ]] || fail "$1='$2' must be a positive integer"
}

check_slurm_job() {
    [[ -n ${SLURM_JOB_ID:-} ]] || fail "not inside a Slurm job: submit with sbatch (SLURM_JOB_ID is not set)"
}

check_repo() {  # MEGATRON_LITE must be the checkout, on a filesystem every node sees
    [[ -f $MEGATRON_LITE/pretrain_gpt.py ]] ||
        fail "MEGATRON_LITE='$MEGATRON_LITE' holds no pretrain_gpt.py; set it to the megatron_lite checkout"
    command -v "$PYTHON" >/dev/null || fail "PYTHON='$PYTHON' is not a command on $(hostname -s)"
}

check_data() {  # DATA_PATH: a prefix, or a blend "W1 P1 W2 P2 ..."; the tokenizer file
    [[ -n $DATA_PATH ]] || fail "DATA_PATH is empty; set it to the prefix tools/preprocess_data.py wrote (e.g. data/corpus_text_document)"
    local word
    for word in $DATA_PATH; do
        [[ $word =~ ^[0-9.eE+-]+$ ]] && continue  # a blend weight
        [[ -f $word.idx && -f $word.bin ]] || fail "DATA_PATH: '$word.bin' / '$word.idx' not found"
    done
    if [[ $TOKENIZER_TYPE == SentencePieceTokenizer ]]; then
        [[ -f $TOKENIZER_MODEL ]] || fail "TOKENIZER_MODEL='$TOKENIZER_MODEL' is not a file (the .model of tools/train_tokenizer.py)"
    fi
}

check_layout() {  # GPUS_PER_NODE TP PP over SLURM_NNODES nodes
    require_positive_int GPUS_PER_NODE "$GPUS_PER_NODE"
    require_positive_int TP "$TP"
    require_positive_int PP "$PP"
    ((GPUS_PER_NODE % TP == 0)) ||
        fail "TP=$TP does not divide GPUS_PER_NODE=$GPUS_PER_NODE: tensor parallelism stays inside a node; use a TP that divides $GPUS_PER_NODE"
    local world=$((SLURM_NNODES * GPUS_PER_NODE))
    ((world % (TP * PP) == 0)) ||
        fail "TP=$TP x PP=$PP = $((TP * PP)) does not divide the $world ranks ($SLURM_NNODES nodes x GPUS_PER_NODE=$GPUS_PER_NODE)"
}

check_gpu_request() {  # a GPU request needs GPUs in the allocation: Slurm gives steps only what the job holds
    if [[ -n $GPU_REQUEST && -z ${SLURM_JOB_GPUS:-}${SLURM_GPUS_ON_NODE:-}${SLURM_GPUS_PER_NODE:-} ]]; then
        fail "GPU_REQUEST='$GPU_REQUEST' but this job holds no GPUs: submit with the same request (sbatch $GPU_REQUEST ...), or set GPU_REQUEST= (empty) on CPU nodes"
    fi
}

set_rendezvous() {  # MASTER_ADDR = the job's first node; a port from the job id (two jobs on a node differ)
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
    MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
    export MASTER_ADDR MASTER_PORT
}

latest_iteration() {  # DIR -> the iteration of DIR/latest, 0 without a checkpoint
    local tag
    tag=$(cat "$1/latest" 2>/dev/null || true)
    if [[ $tag =~ ^iter_([0-9]+)$ ]]; then
        echo $((10#${BASH_REMATCH[1]}))
    else
        echo 0
    fi
}

run_step() {  # srun ARGS...: the step in the background, so the batch shell can pass signals on
    # `scancel --batch -s USR1` and `--signal=B:USR1@T` signal only this shell; the trainers
    # (--exit-signal-handler) need it. Slurm's default (`scancel -s USR1`, `--signal=USR1@T`)
    # signals the step's processes directly.
    trap 'note "USR1 received: passing it to the training step"; scancel --signal=USR1 "$SLURM_JOB_ID"' USR1
    trap 'note "TERM received: passing it to the training step"; scancel --signal=TERM "$SLURM_JOB_ID"' TERM
    srun "$@" &
    local step=$!
    STEP_STATUS=0
    while :; do
        wait "$step" && STEP_STATUS=0 || STEP_STATUS=$?
        kill -0 "$step" 2>/dev/null || break  # still running: `wait` returned for a trapped signal
    done
    trap - USR1 TERM
}

requeue_if_unfinished() {  # CHECKPOINT_DIR TRAIN_ITERS ITERATION_BEFORE
    local now
    now=$(latest_iteration "$1")
    if ((STEP_STATUS != 0)); then
        note "training step failed (exit $STEP_STATUS) at checkpoint iteration $now"
        exit "$STEP_STATUS"
    fi
    if ((now >= $2)); then
        note "training done: $now of $2 iterations"
    elif [[ $REQUEUE == 1 ]] && ((now > $3)); then
        # stopped early on a signal (or --exit-interval) after saving: continue in a new run
        note "stopped at iteration $now of $2 with a checkpoint: requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID" || note "scontrol requeue failed; resubmit this script to resume"
    else
        note "stopped at iteration $now of $2; resubmit this script to resume from $1"
    fi
}
