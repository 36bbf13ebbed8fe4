"""pretrain_gpt.py end to end on a tiny corpus made from Python's own sources: its main on warm ranks
(tests/entry_points.py), and through the real launchers where the launcher, a signal or a kill is the subject."""
import glob
import os
import re
import signal
import subprocess
import time

import pytest
import torch

from tests.entry_points import run_entry
from tests.harness import run_launcher, signal_process_tree, start_launcher

pytestmark = pytest.mark.slow

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "2", "--num-workers", "0",
         "--make-vocab-size-divisible-by", "16", "--seed", "5"]


def data_args(corpus):
    prefix, model = corpus
    return ["--data-path", prefix, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
            "--split", "90,10,0"]


def layout(tp, pp):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def pretrain(corpus, nproc, args, timeout=300, launcher=None):
    """pretrain_gpt.py on nproc ranks: warm ones, or fresh processes under `launcher` (torchrun, deepspeed)."""
    script = ["pretrain_gpt.py", *MODEL, *data_args(corpus), *args]
    if launcher is None:
        return run_entry(script, nproc, timeout=timeout)
    return run_launcher(script, nproc=nproc, timeout=timeout, launcher=launcher)


def losses_by_iteration(text):
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"iteration\s+(\d+)/\d+ .*?\| loss (\S+)", text)}


def _runs_a_few_steps_saves_and_evaluates(tp, pp, dp, corpus, tmp_path, launcher=None, extra=()):
    result = pretrain(corpus, tp * pp * dp, layout(tp, pp) + ["--train-iters", "4", "--eval-interval", "2",
                                                                "--save", str(tmp_path / "ckpt"), "--save-interval", "1",
                                                                "--keep-last", "2", *extra], launcher=launcher)
    assert result.returncode == 0, result.stdout + result.stderr
    losses = losses_by_iteration(result.stdout)
    assert sorted(losses) == [1, 2, 3, 4]
    assert "validation at iteration 2 | loss" in result.stdout
    assert "TFLOP/s/rank" in result.stdout and "tokens/s" in result.stdout
    assert open(tmp_path / "ckpt" / "latest").read() == "iter_0000004"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.is_dir()) == ["iter_0000003", "iter_0000004",
                                                                                  "metrics"]
    assert glob.glob(str(tmp_path / "ckpt" / "iter_0000004" / "layer_*-model_*-model_states.pt"))
    return result.stdout


# Packed documents apart and a window on every other layer, through the real data pipeline and two stages.
DOCUMENTS = ("--reset-attention-mask", "--reset-position-ids", "--position-embedding-type", "rope", "--window-size",
             "8", "--window-attn-skip-freq", "2")


# DeepSeek-V3's attention and Multi-Token Prediction: the depth's tokens, labels and masks made per document by the
# data pipeline (data/mtp.py), its loss on a line of its own and in metrics.jsonl.
DEEPSEEK = ("--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "8", "--qk-head-dim", "8",
            "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--qk-layernorm", "--mtp-num-layers", "1")


@pytest.mark.parametrize("tp, pp, dp, extra", [(2, 1, 1, ()), (1, 2, 1, ()), (1, 1, 2, ()), (1, 2, 1, DOCUMENTS),
                                               (1, 2, 1, DOCUMENTS + DEEPSEEK)],
                         ids=["2-1-1", "1-2-1", "1-1-2", "1-2-1-documents-and-window", "1-2-1-mla-mtp-documents"])
def test_pretrain_runs_a_few_steps_saves_keeps_the_last_two_and_evaluates(corpus, tp, pp, dp, extra, tmp_path):
    stdout = _runs_a_few_steps_saves_and_evaluates(tp, pp, dp, corpus, tmp_path, extra=extra)
    if "--mtp-num-layers" in extra:
        assert len(re.findall(r"mtp \| depth 1 loss \d+\.\d+", stdout)) == 4
        assert '"mtp/depth1_loss"' in open(tmp_path / "ckpt" / "metrics" / "metrics.jsonl").read()


def test_pretrain_runs_a_few_steps_through_torchrun(corpus, tmp_path):
    _runs_a_few_steps_saves_and_evaluates(1, 2, 1, corpus, tmp_path, launcher="torchrun")


@pytest.mark.parametrize("extra", [(), ("--position-embedding-type", "rope") + DEEPSEEK], ids=["gpt", "mla-mtp"])
def test_zero2_at_pp1_trains_evaluates_and_saves(corpus, tmp_path, extra):
    """ZeRO 2 trains GPTModel through DeepSpeed's engine without the pipeline: the depths' arrays as arguments."""
    result = pretrain(corpus, 2, layout(1, 1) + ["--zero-stage", "2", "--train-iters", "2", "--eval-interval", "2",
                                                 "--save", str(tmp_path / "ckpt"), *extra])
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(losses_by_iteration(result.stdout)) == [1, 2]
    assert "validation at iteration 2 | loss" in result.stdout
    assert open(tmp_path / "ckpt" / "latest").read() == "iter_0000002"
    assert ("mtp | depth 1 loss" in result.stdout) == bool(extra)


def test_pretrain_runs_under_the_deepspeed_launcher(corpus, tmp_path):
    result = pretrain(corpus, 2, layout(1, 2) + ["--train-iters", "2"], launcher="deepspeed")  # the launcher's env
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(losses_by_iteration(result.stdout)) == [1, 2]


def _final_weights(ckpt_dir):
    tag = open(os.path.join(ckpt_dir, "latest")).read()
    weights = {}
    for path in sorted(glob.glob(os.path.join(ckpt_dir, tag, "layer_*-model_states.pt"))):
        for name, tensor in torch.load(path, weights_only=False).items():
            weights[f"{os.path.basename(path)}:{name}"] = tensor
    return weights


def test_resume_continues_the_same_loss_curve_and_weights(corpus, tmp_path):
    # dropout stays on (default 0.1): an exact resume must restore every random generator too
    common = layout(1, 2) + ["--train-iters", "6", "--lr-decay-iters", "6"]
    straight = pretrain(corpus, 2, common + ["--save", str(tmp_path / "a")])
    assert straight.returncode == 0, straight.stderr
    first = pretrain(corpus, 2, common + ["--save", str(tmp_path / "b"), "--exit-interval", "3"])
    assert first.returncode == 0, first.stderr
    assert open(tmp_path / "b" / "latest").read() == "iter_0000003"
    second = pretrain(corpus, 2, common + ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")])
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout and "at iteration 3" in second.stdout

    expected = losses_by_iteration(straight.stdout)
    resumed = {**losses_by_iteration(first.stdout), **losses_by_iteration(second.stdout)}
    assert sorted(expected) == sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert resumed == expected
    a, b = _final_weights(tmp_path / "a"), _final_weights(tmp_path / "b")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _launch_background(corpus, nproc, args):
    return start_launcher(["pretrain_gpt.py", *MODEL, *data_args(corpus), *args], nproc, stderr=subprocess.STDOUT)


def _wait_for(predicate, proc, timeout=240.0, poll=0.001):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    return False


def test_sigkill_during_a_save_keeps_the_previous_checkpoint_loadable(corpus, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = layout(1, 2) + ["--train-iters", "40", "--save", str(ckpt), "--save-interval", "1"]
    proc = _launch_background(corpus, 2, args)
    try:
        assert _wait_for(lambda: (ckpt / "latest").exists(), proc), "no first checkpoint was written"
        # Catch a save in progress (its temporary folder exists): freeze every process at once,
        # and if the save is still unfinished, kill them all; otherwise let them go on to the next save.
        caught = False
        while not caught and _wait_for(lambda: any(p.name.startswith("tmp-") for p in ckpt.iterdir()), proc):
            signal_process_tree(proc.pid, signal.SIGSTOP)
            caught = any(p.name.startswith("tmp-") for p in ckpt.iterdir())
            signal_process_tree(proc.pid, signal.SIGKILL if caught else signal.SIGCONT)
        assert caught, "never caught a save in progress"
    finally:
        signal_process_tree(proc.pid, signal.SIGKILL)
        proc.communicate()
    tag = open(ckpt / "latest").read()
    assert (ckpt / tag / "megatron_lite.json").exists()
    assert any(p.name.startswith("tmp-") for p in ckpt.iterdir())
    saved_iteration = int(tag.split("_")[1])

    resumed = pretrain(corpus, 2, layout(1, 2) + ["--train-iters", str(saved_iteration + 2), "--save", str(ckpt),
                                                  "--load", str(ckpt), "--override-opt-param-scheduler"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"at iteration {saved_iteration}" in resumed.stdout
    assert sorted(losses_by_iteration(resumed.stdout)) == [saved_iteration + 1, saved_iteration + 2]


def test_sigterm_with_exit_signal_handler_saves_and_exits_0(corpus, tmp_path):
    import psutil

    ckpt = tmp_path / "ckpt"
    proc = _launch_background(corpus, 2, layout(1, 2) + ["--train-iters", "1000", "--save", str(ckpt),
                                                         "--exit-signal-handler"])
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.search(r"iteration\s+2/1000", line):
                break
        # What Slurm does before a time limit: signal every task.
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            signal_process_tree(proc.pid, signal.SIGKILL)
    out = "".join(lines) + out
    assert proc.returncode == 0, out
    assert "exit signal received" in out
    tag = open(ckpt / "latest").read()
    assert int(tag.split("_")[1]) < 1000


def test_tensorboard_events_hold_loss_lr_throughput_and_memory(corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    result = pretrain(corpus, 2, layout(2, 1) + ["--train-iters", "3", "--eval-interval", "3",
                                                 "--tensorboard-dir", str(tb)])
    assert result.returncode == 0, result.stderr
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/tokens_per_s", "train/samples_per_s", "train/tflops_per_rank",
                "train/mem_rss_gib", "train/grad_norm", "valid/loss", "valid/perplexity"):
        assert tag in tags, (tag, sorted(tags))
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]


def test_loading_under_another_layout_reshards_and_says_so_in_one_line(corpus, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert pretrain(corpus, 2, layout(1, 2) + ["--train-iters", "2", "--save", str(ckpt)]).returncode == 0
    result = pretrain(corpus, 2, layout(2, 1) + ["--train-iters", "4", "--load", str(ckpt), "--lr-decay-iters", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {ckpt} at iteration 2, 16 consumed samples; resharded TP 1 x PP 2 x DP 1 (ZeRO 0, fp32) " \
           f"-> TP 2 x PP 1 x DP 1 (ZeRO 0, fp32)" in result.stdout
    assert sorted(losses_by_iteration(result.stdout)) == [3, 4]


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_checkpoint(corpus, tmp_path):
    # An absurd learning rate overflows the fp32 weights within a few steps. The numerical guard (on by default)
    # finds it before the reduction, replays the step, sees it again and stops with 16 (training/rerun.py), the
    # weights saved are the step's start, the last good ones; without the guard the loop's own check stops the run.
    ckpt = tmp_path / "ckpt"
    absurd = layout(1, 2) + ["--train-iters", "20", "--lr", "1e30", "--min-lr", "1e30", "--save-interval", "1"]
    result = pretrain(corpus, 2, absurd + ["--save", str(ckpt)])
    assert result.returncode == 16, result.stdout[-2000:] + result.stderr[-2000:]
    match = re.search(r"error: NaN/Inf in the .* at iteration (\d+), before the gradient reduction.* it reproduced",
                      result.stderr)
    assert match, result.stderr[-2000:]
    assert open(ckpt / "latest").read() == f"iter_{int(match.group(1)) - 1:07d}"
    result = pretrain(corpus, 2, absurd + ["--save", str(tmp_path / "unguarded"),
                                           "--no-check-for-nan-in-loss-and-grad"])
    assert result.returncode != 0
    match = re.search(r"error: loss is (nan|inf) at iteration (\d+); stopping", result.stdout)
    assert match, result.stdout[-2000:]
    bad = int(match.group(2))
    assert open(tmp_path / "unguarded" / "latest").read() == f"iter_{bad - 1:07d}"


def test_a_split_without_training_documents_is_a_clear_error(corpus):
    result = pretrain(corpus, 1, layout(1, 1) + ["--train-iters", "2", "--split", "0,1,0"])
    assert result.returncode != 0
    assert "pretrain_gpt.py: error: --split 0,1,0 leaves no training documents" in result.stderr
    assert "megatron_lite/training" not in result.stderr


def consumed_and_batch_by_iteration(text):
    return {int(m.group(1)): (int(m.group(2)), int(m.group(3))) for m in
            re.finditer(r"iteration\s+(\d+)/\d+ \| consumed samples\s+(\d+) \| global batch\s+(\d+)", text)}


def test_batch_rampup_grows_the_logged_global_batch_and_resumes_mid_ramp_exactly(corpus, tmp_path):
    # micro 2 x DP 1 = 2 per micro-step; the batch goes 4 -> 8 after 16 samples (4 steps of 4).
    common = layout(1, 2) + ["--train-iters", "6", "--lr-decay-iters", "6", "--rampup-batch-size", "4", "4", "16"]
    straight = pretrain(corpus, 2, common + ["--save", str(tmp_path / "a")])
    assert straight.returncode == 0, straight.stdout + straight.stderr
    assert consumed_and_batch_by_iteration(straight.stdout) == {
        1: (4, 4), 2: (8, 4), 3: (12, 4), 4: (16, 4), 5: (24, 8), 6: (32, 8)}
    first = pretrain(corpus, 2, common + ["--save", str(tmp_path / "b"), "--exit-interval", "3"])
    second = pretrain(corpus, 2, common + ["--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")])
    assert first.returncode == 0 and second.returncode == 0, second.stdout + second.stderr
    assert "at iteration 3, 12 consumed samples" in second.stdout
    resumed = {**losses_by_iteration(first.stdout), **losses_by_iteration(second.stdout)}
    assert resumed == losses_by_iteration(straight.stdout)
    assert consumed_and_batch_by_iteration(second.stdout) == {4: (16, 4), 5: (24, 8), 6: (32, 8)}


def stage_tables(text):
    """Each 'time per stage' table as {stage: {column: ms}}."""
    tables = []
    for block in text.split("time per stage:\n")[1:]:
        lines = block.splitlines()
        columns = lines[0].split("(")[0].split()[1:]
        rows = {}
        for line in lines[1:]:
            cells = line.split()
            if len(cells) != len(columns) + 1 or not cells[0].isdigit():
                break
            rows[int(cells[0])] = dict(zip(columns, map(float, cells[1:])))
        tables.append(rows)
    return tables


@pytest.mark.parametrize("pp", [2, 3])
def test_timing_breakdown_accounts_for_each_stages_step_and_reaches_tensorboard(corpus, tmp_path, pp):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # Wider than MODEL: at hidden 32 a step takes about 40 ms, and the engine's own Python between
    # instructions (a few ms) once came to 11.6% of it in a full-suite run.
    result = pretrain(corpus, pp, layout(1, pp) + ["--num-layers", "3", "--hidden-size", "128", "--seq-length", "128",
                                                   "--train-iters", "4", "--log-interval", "2",
                                                   "--timing-breakdown", "--tensorboard-dir", str(tmp_path / "tb"),
                                                   "--eval-interval", "2"])
    assert result.returncode == 0, result.stdout + result.stderr
    tables = stage_tables(result.stdout)
    assert len(tables) == 2 and all(sorted(t) == list(range(pp)) for t in tables)
    for table in tables:
        for stage, row in table.items():
            instructions = sum(v for k, v in row.items() if k not in ("other", "step"))
            assert abs(instructions - row["step"]) <= 0.1 * row["step"], (stage, row)
            assert row["forward"] > 0 and row["backward"] > 0 and row["optimizer"] > 0
        assert table[0]["send"] > 0 and table[pp - 1]["recv"] > 0
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    tags = events.Tags()["scalars"]
    for stage in range(pp):
        for column in ("forward", "backward", "recv", "send", "optimizer", "step"):
            assert f"timing/stage{stage}/{column}" in tags


def test_dualpipev_trains_evaluates_saves_and_times_each_ranks_instructions(corpus, tmp_path):
    result = pretrain(corpus, 2, layout(1, 2) + ["--pipeline-schedule", "dualpipev", "--num-layers", "4",
                                                 "--hidden-size", "128", "--seq-length", "128", "--train-iters", "4",
                                                 "--log-interval", "2", "--timing-breakdown", "--eval-interval", "2",
                                                 "--save", str(tmp_path / "ckpt"), "--save-interval", "4"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(losses_by_iteration(result.stdout)) == [2, 4]
    assert "validation at iteration 2 | loss" in result.stdout
    assert "dualpipev: rank r holds stages r and 3 - r" in result.stdout  # the stage table
    assert re.search(r"memory stage 1: estimated [\d.]+ GiB", result.stdout)
    tables = stage_tables(result.stdout)
    assert len(tables) == 2 and all(sorted(t) == [0, 1] for t in tables)
    for table in tables:
        for rank, row in table.items():
            instructions = sum(v for k, v in row.items() if k not in ("other", "step"))
            assert abs(instructions - row["step"]) <= 0.1 * row["step"], (rank, row)
            assert row["forward"] > 0 and row["backward"] > 0 and row["recv"] > 0  # recv: CommitP2P's waits
    saved = tmp_path / "ckpt" / "iter_0000004"
    assert sorted(p.name for p in saved.glob("layer_*")) == [f"layer_{i:02d}-model_00-model_states.pt" for i in range(6)]
    import json
    metadata = json.loads((saved / "megatron_lite.json").read_text())
    assert metadata["pipeline_schedule"] == "dualpipev" and sum(metadata["layers_per_stage"]) == 4
    assert len(metadata["layers_per_stage"]) == 4


def test_a_profile_partitioned_run_resumes_with_the_stages_it_saved(corpus, tmp_path):
    import json

    common = layout(1, 2) + ["--num-layers", "3", "--pipeline-partition-method", "profile", "--train-iters", "3",
                             "--save", str(tmp_path / "ckpt")]
    first = pretrain(corpus, 2, common + ["--exit-interval", "2"])
    assert first.returncode == 0, first.stdout + first.stderr
    assert "pipeline stages (profile)" in first.stdout and "fwd+bwd ms" in first.stdout
    counts = json.load(open(tmp_path / "ckpt" / "iter_0000002" / "megatron_lite.json"))["layers_per_stage"]
    assert len(counts) == 2 and sum(counts) == 3
    second = pretrain(corpus, 2, common + ["--load", str(tmp_path / "ckpt")])
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"pipeline stages ({','.join(map(str, counts))})" in second.stdout


def _child_processes():
    import psutil

    return [" ".join(c.cmdline())[:80] for c in psutil.Process().children(recursive=True)]


def test_a_run_called_from_python_leaves_no_data_worker_running_when_it_returns(corpus):
    from tests.harness import run_distributed

    result = pretrain(corpus, 2, layout(1, 2) + ["--train-iters", "2", "--num-workers", "2"])
    assert result.returncode == 0, result.stderr[-2000:]
    # pretrain() returned in these very processes (warm ranks): its DataLoader workers are gone with it
    assert run_distributed(_child_processes, 2) == [[], []]

