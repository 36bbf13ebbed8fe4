import pytest

import os
import subprocess
import sys

from tests.harness import REPO_ROOT

BAD = ["--zero-stage", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4"]
MESSAGE = "pipeline parallelism needs each stage's full gradients for gradient accumulation"


def _launch(argv, **env):
    full_env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "SLURM_NTASKS", "SLURM_PROCID")}
    full_env.update(env)
    return subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"), *argv], env=full_env,
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_bad_flag_combination_exits_2_with_message_and_no_traceback():
    proc = _launch(BAD, WORLD_SIZE="2")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert MESSAGE in out and "--zero-stage 2" in out
    assert "Traceback" not in out


def test_bad_flag_combination_at_world_size_8_exits_2_on_every_rank_and_rank0_reports():
    # What torchrun / srun give each of 8 processes: the same flags, RANK 0..7, WORLD_SIZE 8.
    procs = [_launch(BAD + ["--tensor-model-parallel-size", "2"], WORLD_SIZE="8", RANK=str(r), LOCAL_RANK=str(r))
             for r in range(8)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [2] * 8
    assert MESSAGE in outs[0]
    assert all(out == "" for out in outs[1:]), "only rank 0 should print the error"
    assert not any("Traceback" in out for out in outs)


def test_query_groups_that_do_not_fit_tp_exit_2_with_one_line_before_any_collective():
    proc = _launch(["--tensor-model-parallel-size", "2", "--hidden-size", "96", "--num-attention-heads", "6",
                    "--group-query-attention", "--num-query-groups", "3"], WORLD_SIZE="2")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in out
    errors = [line for line in out.splitlines() if "--num-query-groups 3" in line]
    assert len(errors) == 1 and "Use --num-query-groups 1 or 2" in errors[0], out


def test_a_context_parallel_size_the_heads_do_not_split_into_exits_2_with_one_line_before_any_collective():
    proc = _launch(["--context-parallel-size", "4", "--hidden-size", "96", "--num-attention-heads", "6"],
                   WORLD_SIZE="4")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in out
    errors = [line for line in out.splitlines() if "--context-parallel-size 4" in line]
    assert len(errors) == 1 and "Use --context-parallel-size 1 or 2" in errors[0], out


@pytest.mark.parametrize("argv, world, line", [
    (["--kv-channels", "0"], "1", "--kv-channels: must be at least 1, got 0; e.g. 1"),
    (["--position-embedding-type", "rope", "--kv-channels", "23"], "1",
     "--position-embedding-type rope needs an even head dimension (RoPE turns pairs of it); --kv-channels 23. "
     "Use --kv-channels 24"),
    (["--qk-layernorm", "--tensor-model-parallel-size", "2", "--zero-stage", "2"], "2",
     "--qk-layernorm at --tensor-model-parallel-size 2 with --zero-stage 2"),
    (["--multi-latent-attention", "--position-embedding-type", "rope", "--group-query-attention",
      "--num-query-groups", "2"], "1", "--multi-latent-attention with --group-query-attention, --num-query-groups 2"),
], ids=["kv-channels-0", "odd-head-dim-with-rope", "qk-layernorm-at-tp2-zero2", "mla-with-gqa"])
def test_a_head_width_or_qk_norm_that_cannot_work_exits_2_with_one_line_before_any_collective(argv, world, line):
    proc = _launch(argv, WORLD_SIZE=world)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in out
    errors = [text for text in out.splitlines() if line in text]
    assert len(errors) == 1, out


def test_unknown_flag_exits_2_with_usage():
    proc = _launch(["--tensor-parallel-size", "2"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "unrecognized arguments: --tensor-parallel-size" in out and "Traceback" not in out


def test_help_exits_0():
    proc = _launch(["--help"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "--tensor-model-parallel-size" in out


def test_training_without_data_path_exits_2_naming_the_flag():
    proc = _launch(["--train-iters", "1"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "--data-path is required to train" in out and "Traceback" not in out


def test_deepspeed_contradiction_and_empty_split_exit_2_on_both_ranks_before_any_rendezvous(tmp_path):
    import json

    import numpy as np

    from megatron_lite.data.indexed_dataset import IndexedDatasetWriter
    from tests.harness import free_port

    prefix = str(tmp_path / "tiny_text_document")
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for i in range(20):
            writer.add_document(list(range(i, i + 40)))
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8}))
    argv = ["--data-path", prefix, "--vocab-size", "100", "--split", "0,50,50", "--micro-batch-size", "2",
            "--deepspeed-config", str(ds_json), "--train-iters", "2"]
    # Rank 1 alone would wait for rank 0's store if it tried to rendezvous; both must exit at once.
    env = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    alone = _launch(argv, RANK="1", LOCAL_RANK="1", **env)
    out, _ = alone.communicate(timeout=60)
    # Without a rank 0 to say it (megatron_lite/refusal.py), rank 1 says it itself after waiting for rank 0's line.
    assert alone.returncode == 2 and out.startswith("pretrain_gpt.py: error: 2 problems:"), out
    assert out.rstrip().endswith("(rank 1)")
    procs = [_launch(argv, RANK=str(r), LOCAL_RANK=str(r), **env) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    assert outs[0].startswith("pretrain_gpt.py: error: 2 problems:")
    assert '"train_micro_batch_size_per_gpu" is 8 but the command-line flags give 2' in outs[0]
    assert f"--split 0,50,50 leaves no training documents in {prefix}" in outs[0]
    assert outs[1] == "" and "Traceback" not in outs[0]


def test_fp16_on_a_device_without_fp16_kernels_exits_2_naming_the_flag(tmp_path):
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():
        pytest.skip("this device trains in fp16")
    import numpy as np

    from megatron_lite.data.indexed_dataset import IndexedDatasetWriter

    prefix = str(tmp_path / "tiny_text_document")
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_document(list(range(60)))
    proc = _launch(["--data-path", prefix, "--vocab-size", "100", "--split", "1,0,0", "--fp16", "--zero-stage", "1"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "--fp16: this cpu device has no fp16 kernels" in out and "Traceback" not in out


def test_sequence_parallel_at_tp1_exits_2_before_any_rendezvous_naming_the_flag():
    proc = _launch(["--sequence-parallel"], WORLD_SIZE="2", RANK="0")  # alone: a rendezvous would wait
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "--sequence-parallel splits the sequence" in out
    assert "--tensor-model-parallel-size 2" in out and "Traceback" not in out


def test_a_missing_tokenizer_model_beside_data_with_a_sidecar_exits_2_with_one_line_naming_it(tmp_path):
    # The data's sidecar records its tokenizer's hash; checking it once hashed the missing file (a traceback).
    import numpy as np

    from megatron_lite.data.indexed_dataset import IndexedDatasetWriter
    from megatron_lite.data.sidecar import write_sidecar

    prefix = str(tmp_path / "tiny_text_document")
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_document(list(range(60)))
    write_sidecar(prefix, {"tokenizer": {"type": "SentencePieceTokenizer", "model_sha256": "0" * 64}})
    missing = tmp_path / "missing.model"
    proc = _launch(["--data-path", prefix, "--tokenizer-model", str(missing), "--split", "1,0,0"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in out, out
    assert [line for line in out.splitlines() if line.strip()] == [
        f"pretrain_gpt.py: error: --tokenizer-model {missing}: no such file; train one with tools/train_tokenizer.py "
        f"or point at an existing .model file, Hugging Face tokenizer folder or tokenizer.json"]


def test_dualpipev_with_too_few_micro_batches_exits_2_with_one_line_before_any_collective():
    proc = _launch(["--pipeline-schedule", "dualpipev", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
                    "--micro-batch-size", "1", "--global-batch-size", "2"], WORLD_SIZE="2")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in out
    errors = [line for line in out.splitlines() if "--pipeline-schedule dualpipev needs at least" in line]
    assert len(errors) == 1 and "use --global-batch-size of 4 or more, or --pipeline-schedule 1f1b" in errors[0], out
