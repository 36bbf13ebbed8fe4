#!/bin/bash
# Submits preprocess_array.sbatch as an array of NUM_SHARDS tasks and merge_shards.sbatch as a job
# that starts only after every task succeeded (--dependency=afterok); if a task fails, the merge is
# cancelled rather than left pending. Settings of both scripts pass through the environment:
#   NUM_SHARDS=64 INPUT='corpus/*.jsonl.zst' TOKENIZER_MODEL=spm.model NAME=pile \
#       bash examples/slurm/submit_preprocess.sh
# Extra sbatch options for both jobs (partition, account, time) go in SBATCH_ARGS.
set -euo pipefail

NUM_SHARDS=${NUM_SHARDS:-8}
MAX_RUNNING=${MAX_RUNNING:-}                  # at most this many tasks at once (empty: no limit)
SBATCH_ARGS=${SBATCH_ARGS:-}

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export REPO=${REPO:-$(cd "$here/../.." && pwd)}
read -r -a sbatch_args <<< "$SBATCH_ARGS"
if ! [[ "$NUM_SHARDS" =~ ^[1-9][0-9]*$ ]]; then
    echo "submit_preprocess.sh: NUM_SHARDS=$NUM_SHARDS is not a positive integer" >&2
    exit 2
fi

array_job=$(sbatch --parsable "${sbatch_args[@]}" --array="0-$((NUM_SHARDS - 1))${MAX_RUNNING:+%$MAX_RUNNING}" \
    "$here/preprocess_array.sbatch")
array_job=${array_job%%;*}                    # --parsable prints "id" or "id;cluster"
merge_job=$(sbatch --parsable "${sbatch_args[@]}" --dependency="afterok:$array_job" --kill-on-invalid-dep=yes \
    "$here/merge_shards.sbatch")
merge_job=${merge_job%%;*}
echo "submitted array job $array_job ($NUM_SHARDS shards) and merge job $merge_job (after every shard succeeded)"
