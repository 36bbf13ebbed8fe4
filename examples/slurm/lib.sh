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

open_fault_log() {  # CHECKPOINT_DIR: this attempt's fault log, where a run that ends on a fault says which and where
    # (megatron_lite/fault_log.py: the watchdog's hang, the numerical guard's NaN, the rerun's verdict); the step's
    # exit status cannot say it (under torchrun a rank's 42 reaches us as the agent's 1).
    MEGATRON_LITE_FAULT_LOG="$1/faults/job-$SLURM_JOB_ID-restart-${SLURM_RESTART_COUNT:-0}.jsonl"
    export MEGATRON_LITE_FAULT_LOG
    mkdir -p "$1/faults"
    rm -f "$MEGATRON_LITE_FAULT_LOG"
}

requeue_if_unfinished() {  # CHECKPOINT_DIR TRAIN_ITERS ITERATION_BEFORE
    local now
    now=$(latest_iteration "$1")
    if ((STEP_STATUS != 0)); then
        requeue_after_fault "$1" "$now" "$3"
        return
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

# What each fault's exit code asks of the scheduler (megatron_lite/exit_codes.py; docs/slurm.md):
#   42 hang (the watchdog), 16 a fault reproduced in place: again from the last checkpoint, without the node named
#   17 a fault not reproduced (transient), 18 NaN/Inf stopped before any update: requeued from the last checkpoint
#   anything else: the step failed; the job fails with its code
# After MAX_REQUEUES_WITHOUT_PROGRESS such restarts in a row without the checkpoint advancing: stop with 93.
requeue_after_fault() {  # CHECKPOINT_DIR ITERATION_NOW ITERATION_BEFORE
    local code=$STEP_STATUS hosts="" counter="$1/faults/requeues_without_progress" count=0
    if [[ -s ${MEGATRON_LITE_FAULT_LOG:-} ]]; then
        code=$("$PYTHON" -m megatron_lite.fault_log code "$MEGATRON_LITE_FAULT_LOG")
        hosts=$("$PYTHON" -m megatron_lite.fault_log hosts "$MEGATRON_LITE_FAULT_LOG")
    fi
    case $code in
        42 | 16 | 17 | 18) ;;
        *)
            note "training step failed (exit $STEP_STATUS) at checkpoint iteration $2"
            exit "$STEP_STATUS"
            ;;
    esac
    if (($2 > $3)); then
        count=0
    else
        count=$(($(cat "$counter" 2>/dev/null || echo 0) + 1))
    fi
    echo "$count" >"$counter"
    note "fault (exit $code${hosts:+ on $hosts}) at checkpoint iteration $2 (this attempt started at $3); $count restart(s) in a row without progress"
    if ((count >= MAX_REQUEUES_WITHOUT_PROGRESS)); then
        note "no progress over $count restarts after faults: not requeueing (exit 93); see $MEGATRON_LITE_FAULT_LOG"
        exit 93
    fi
    if [[ $REQUEUE != 1 ]]; then
        note "REQUEUE=$REQUEUE: resubmit this script to resume from $1"
        exit "$code"
    fi
    if [[ -n $hosts && ($code == 42 || $code == 16) ]]; then
        resubmit_excluding "$hosts"
        exit "$code"
    fi
    note "requeueing job $SLURM_JOB_ID after the fault (exit $code)"
    scontrol requeue "$SLURM_JOB_ID" || { note "scontrol requeue failed; resubmit this script to resume"; exit "$code"; }
}

# Slurm takes a job's excluded nodes only while it is pending, and `scontrol requeue` ends this script at once (the
# job is pending only after that), so a job cannot requeue itself without a node. It submits its successor instead:
# the same script, its #SBATCH lines, the environment it was given (sbatch exports it), and what `scontrol show
# job` says of this job's request (nodes, CPUs per task, time limit, partition, account, GPUs per node, output file,
# excluded nodes), plus HOSTS excluded. The successor resumes from the same CHECKPOINT_DIR and appends to the same
# output file.
resubmit_excluding() {  # HOSTS (comma-separated)
    local info script excluded output limit gres successor
    info=$(scontrol show job "$SLURM_JOB_ID")
    field() { { grep -o "\b$1=[^ ]*" <<<"$info" || true; } | head -n1 | cut -d= -f2-; }
    script=$(field Command)
    output=$(field StdOut)
    limit=$(field TimeLimit)
    gres=$(field TresPerNode)
    excluded=$(field ExcNodeList)
    [[ $excluded == "(null)" ]] && excluded=""
    excluded=${excluded:+$excluded,}$1
    local args=(--parsable --job-name "$SLURM_JOB_NAME" --nodes "$SLURM_JOB_NUM_NODES" --exclude "$excluded"
        --output "$output" --open-mode append)
    [[ -n ${SLURM_CPUS_PER_TASK:-} ]] && args+=(--cpus-per-task "$SLURM_CPUS_PER_TASK")
    [[ -n $limit && $limit != UNLIMITED ]] && args+=(--time "$limit")
    [[ -n ${SLURM_JOB_PARTITION:-} ]] && args+=(--partition "$SLURM_JOB_PARTITION")
    [[ -n ${SLURM_JOB_ACCOUNT:-} ]] && args+=(--account "$SLURM_JOB_ACCOUNT")
    [[ $gres =~ ^gres[/:](.+)$ ]] && args+=(--gres "${BASH_REMATCH[1]}")
    if successor=$(cd "$(field WorkDir)" && sbatch "${args[@]}" "$script"); then
        note "resubmitted as job $successor without node(s) $excluded, to resume from the last checkpoint"
    else
        note "could not resubmit without $excluded (sbatch failed); resubmit this script to resume"
    fi
}
