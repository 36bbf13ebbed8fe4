"""examples/slurm/pretrain_gpt*.sbatch on a real two-node Slurm (tests/slurm/cluster.sh).

The scripts run as users submit them; only their variables (tiny model, CPU, gloo, a tiny
corpus made with the project's tools) and the sbatch resources of the test nodes differ.
Pipeline parallel 2 over two nodes with one rank each: PP spans the nodes, as on a cluster.
"""
import re

import pytest

from tests.training.test_pretrain_e2e import losses_by_iteration

pytestmark = pytest.mark.slow

TORCHRUN, PER_RANK = "examples/slurm/pretrain_gpt.sbatch", "examples/slurm/pretrain_gpt_srun.sbatch"
SWEEP = "examples/slurm/sweep_tp_pp.sbatch"
RESOURCES = ["--nodes", "2", "--cpus-per-task", "2", "--time", "10"]
MODEL = "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --make-vocab-size-divisible-by 16"
# --lr-decay-iters fixed: the schedule must not follow --train-iters, or a resubmission with more
# iterations would continue on another curve than one run straight through.
TRAINING = ("--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 2 --log-interval 1 "
            "--eval-interval 1000 --eval-iters 2 --seed 5 --split 90,10,0 --lr-decay-iters 6")


def variables(corpus, checkpoint_dir, train_iters, num_workers=0, **extra):  # noqa: F811
    """The jobs' variables. Data workers (a spawned interpreter each, ~2 CPU-seconds) only where a test
    signals them: the USR1 tests."""
    prefix, tokenizer = corpus
    env = dict(DATA_PATH=prefix, TOKENIZER_MODEL=tokenizer, GPUS_PER_NODE="1", GPU_REQUEST="", TP="1", PP="2",
               MODEL_ARGS=MODEL, TRAINING_ARGS=f"{TRAINING} --num-workers {num_workers}",
               TRAIN_ITERS=str(train_iters), CHECKPOINT_DIR=str(checkpoint_dir))
    env.update(extra)
    return env


def completed(cluster, job, timeout=240):
    info = cluster.wait(job, timeout)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job.log()[-4000:] + cluster.daemon_logs()
    return job.log()


def per_rank_sbatch(resources):
    """The srun-per-rank script takes its ranks per node from --ntasks-per-node."""
    return [*resources, "--ntasks-per-node", "1"]


def test_torchrun_job_trains_on_n1_and_n2_and_a_resubmission_resumes_where_it_stopped(slurm_cluster, corpus,  # noqa: F811
                                                                                    tmp_path):
    ckpt = tmp_path / "ckpt"
    first = completed(slurm_cluster, slurm_cluster.submit(TORCHRUN, str(tmp_path / "first.out"), *RESOURCES,
                                                          **variables(corpus, ckpt, 4)))
    assert re.search(r"task \d on n1: torchrun agent", first) and re.search(r"task \d on n2: torchrun agent", first)
    losses = losses_by_iteration(first)
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1], first
    assert open(ckpt / "latest").read() == "iter_0000004"
    assert "training done: 4 of 4 iterations" in first

    # the same script, more iterations: it loads its own --save folder
    second = completed(slurm_cluster, slurm_cluster.submit(TORCHRUN, str(tmp_path / "second.out"), *RESOURCES,
                                                           **variables(corpus, ckpt, 6)))
    assert f"resumed from {ckpt} at iteration 4" in second
    assert sorted(losses_by_iteration(second)) == [5, 6]  # no step repeated
    assert open(ckpt / "latest").read() == "iter_0000006"

    # one Slurm task per rank, no torchrun, from scratch: the same six losses
    per_rank = completed(slurm_cluster, slurm_cluster.submit(PER_RANK, str(tmp_path / "per_rank.out"),
                                                             *per_rank_sbatch(RESOURCES),
                                                             **variables(corpus, tmp_path / "ckpt_srun", 6)))
    assert re.search(r"rank \d on n1", per_rank) and re.search(r"rank \d on n2", per_rank)
    torchrun_losses = {**losses, **losses_by_iteration(second)}
    assert losses_by_iteration(per_rank) == pytest.approx(torchrun_losses, rel=1e-6)


def test_usr1_to_the_job_step_saves_exits_0_and_the_requeued_job_resumes(slurm_cluster, corpus, tmp_path):  # noqa: F811
    ckpt = tmp_path / "ckpt"
    job = slurm_cluster.submit(TORCHRUN, str(tmp_path / "job.out"), *RESOURCES,
                               **variables(corpus, ckpt, 60, num_workers=1))
    slurm_cluster.wait_for_output(job, r"iteration\s+3/60")
    # what --signal=USR1@T does before the time limit: every process of the step, data workers included
    slurm_cluster.command("scancel", "--signal=USR1", job.id)
    slurm_cluster.wait(job, until=lambda i: i.get("Restarts") == "1" and i.get("JobState") == "PENDING")
    log = job.log()
    assert "exit signal received" in log and "killed by signal" not in log, log[-4000:]
    saved = int(open(ckpt / "latest").read().split("_")[1])
    assert 3 <= saved < 60
    assert f"stopped at iteration {saved} of 60 with a checkpoint: requeueing job {job.id}" in log
    assert "training step failed" not in log

    # Slurm holds a requeued job back until its old credential has expired (Reason=BeginTime; the
    # test cluster's cred_expire is 10 s). Released earlier with StartTime=now, the job failed with
    # "Killing non-startable batch job: Job credential revoked" whenever the nodes were quick.
    log = completed(slurm_cluster, job)
    assert "(restart 1)" in log and f"resumed from {ckpt} at iteration {saved}" in log
    second_run = log[log.index("(restart 1)"):]
    assert sorted(losses_by_iteration(second_run)) == list(range(saved + 1, 61))
    assert open(ckpt / "latest").read() == "iter_0000060"


def test_usr1_to_the_batch_shell_reaches_the_ranks_which_save_and_exit_0(slurm_cluster, corpus, tmp_path):  # noqa: F811
    ckpt = tmp_path / "ckpt"
    job = slurm_cluster.submit(PER_RANK, str(tmp_path / "job.out"), *per_rank_sbatch(RESOURCES),
                               **variables(corpus, ckpt, 60, num_workers=1))
    slurm_cluster.wait_for_output(job, r"iteration\s+3/60")
    # what `--signal=B:USR1@T` does: only the batch shell, which passes it on to the step
    slurm_cluster.command("scancel", "--batch", "--signal=USR1", job.id)
    slurm_cluster.wait(job, until=lambda i: i.get("Restarts") == "1" and i.get("JobState") == "PENDING")
    slurm_cluster.command("scancel", job.id)
    log = job.log()
    assert "USR1 received: passing it to the training step" in log, log[-4000:]
    assert "exit signal received" in log and "killed by signal" not in log, log[-4000:]
    saved = int(open(ckpt / "latest").read().split("_")[1])
    assert f"stopped at iteration {saved} of 60 with a checkpoint: requeueing job {job.id}" in log


@pytest.mark.parametrize("script, bad, message", [
    (TORCHRUN, dict(DATA_PATH=""), "error: DATA_PATH is empty"),
    (TORCHRUN, dict(GPUS_PER_NODE="3", TP="2"), "error: TP=2 does not divide GPUS_PER_NODE=3"),
    (PER_RANK, dict(DATA_PATH="/nonexistent/corpus"), "error: DATA_PATH: '/nonexistent/corpus.bin'"),
    (PER_RANK, dict(GPU_REQUEST="--gpus-per-node=1"), "error: GPU_REQUEST='--gpus-per-node=1' but this job holds no GPUs"),
    (SWEEP, dict(), "error: PLAN is empty: give the plan as the script's argument"),
], ids=["no-data-path", "tp-not-dividing-gpus-per-node", "missing-data-files", "gpus-requested-on-cpu-nodes",
        "sweep-without-plan"])
def test_bad_input_fails_in_seconds_naming_the_variable(slurm_cluster, corpus, tmp_path, script, bad, message):  # noqa: F811
    job = slurm_cluster.submit(script, str(tmp_path / "job.out"), *per_rank_sbatch(RESOURCES),
                               **variables(corpus, tmp_path / "ckpt", 4, **bad))
    info = slurm_cluster.wait(job, timeout=30)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), job.log()
    assert message in job.log()
    assert "torchrun agent" not in job.log() and "rank 0 on" not in job.log()  # nothing was launched


def test_a_bf16_zero1_job_resubmitted_on_one_node_fewer_resumes_and_trains(slurm_cluster, corpus, tmp_path):  # noqa: F811
    """Two nodes (DP 2), then the same script on one node (DP 1): the checkpoint's ZeRO-1 partitions of bf16
    training move to the smaller allocation with their Adam moments, as a requeue onto fewer nodes needs."""
    ckpt = tmp_path / "ckpt"
    flags = dict(PP="1", EXTRA_ARGS="--bf16 --zero-stage 1")
    first = completed(slurm_cluster, slurm_cluster.submit(TORCHRUN, str(tmp_path / "first.out"), *RESOURCES,
                                                          **variables(corpus, ckpt, 4, **flags)))
    assert sorted(losses_by_iteration(first)) == [1, 2, 3, 4]
    one_node = ["--nodes", "1", *RESOURCES[2:]]
    second = completed(slurm_cluster, slurm_cluster.submit(TORCHRUN, str(tmp_path / "second.out"), *one_node,
                                                           **variables(corpus, ckpt, 6, **flags)))
    assert f"resumed from {ckpt} at iteration 4" in second
    assert "resharded TP 1 x PP 1 x DP 2 (ZeRO 1, bf16) -> TP 1 x PP 1 x DP 1 (ZeRO 1, bf16): fp32 weights, Adam " \
           "moments and step" in second
    losses = losses_by_iteration(second)
    assert sorted(losses) == [5, 6] and all(loss < losses_by_iteration(first)[1] for loss in losses.values())
    assert open(ckpt / "latest").read() == "iter_0000006"
