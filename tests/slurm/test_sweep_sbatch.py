"""examples/slurm/sweep_tp_pp.sbatch on the real two-node Slurm: the planned layouts run as job
steps across n1 and n2, a resubmission runs nothing new, and the report ranks them."""
import json
import re
import subprocess
import sys

import pytest

from tests.harness import REPO_ROOT
from tests.slurm.test_pretrain_sbatch import completed

pytestmark = pytest.mark.slow

SWEEP = "examples/slurm/sweep_tp_pp.sbatch"
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
         "--make-vocab-size-divisible-by", "16", "--global-batch-size", "8", "--hidden-dropout", "0",
         "--attention-dropout", "0"]


def plan_for_two_nodes(corpus, path):  # noqa: F811
    """One micro batch size: three layouts (CP 2, DP 2, PP 2), a job step over both nodes each. With two sizes,
    six steps ran what three check, at ~10 CPU-seconds a step."""
    _, tokenizer = corpus
    result = subprocess.run([sys.executable, "tools/tune_parallelism.py", "plan", "--nodes", "2", "--gpus-per-node", "1",
                             "--gpu-memory-gb", "8", "--device", "cpu", "--max-micro-batch", "1", *MODEL,
                             "--tokenizer-model", tokenizer, "--output", str(path)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.load(open(path))["candidates"]


def test_the_sweep_runs_every_planned_layout_across_both_nodes_resumes_and_reports(slurm_cluster, corpus,  # noqa: F811
                                                                                 tmp_path):
    candidates = plan_for_two_nodes(corpus, tmp_path / "plan.json")
    assert len(candidates) >= 2 and any("pp2" in c["name"] for c in candidates)
    prefix, tokenizer = corpus
    variables = dict(DATA_PATH=prefix, TOKENIZER_MODEL=tokenizer, GPUS_PER_NODE="1", GPU_REQUEST="",
                     FIXED_ARGS="--split 90,10,0 --num-workers 0 --lr 1e-3 --seed 3",
                     SWEEP_ARGS="--train-iters 4 --warmup-iters 1 --time-limit 120",
                     RESULTS=str(tmp_path / "sweep"), DATA_CACHE_PATH=str(tmp_path / "cache"))
    resources = ["--nodes", "2", "--ntasks-per-node", "1", "--cpus-per-task", "2", "--time", "15"]
    first = completed(slurm_cluster, slurm_cluster.submit(SWEEP, str(tmp_path / "first.out"), *resources,
                                                          script_args=[str(tmp_path / "plan.json")], **variables),
                      timeout=600)
    results = [json.loads(line) for line in open(tmp_path / "sweep" / "results.jsonl")]
    assert sorted(r["name"] for r in results) == sorted(c["name"] for c in candidates)
    assert all(r["status"] == "completed" for r in results), first[-4000:]
    for run in (tmp_path / "sweep").glob("0*_tp*"):
        # one task per node: a world of two is a job step over n1 and n2
        command = (run / "command.txt").read_text()
        assert command.startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 "), command
        assert len(re.findall(r"iteration\s+\d+/4 ", (run / "log.txt").read_text())) == 4
    assert f"sweep: {len(candidates)} completed" in first
    assert re.search(rf"report: {len(candidates)}/{len(candidates)} completed, best \S+ at", first)

    second = completed(slurm_cluster, slurm_cluster.submit(SWEEP, str(tmp_path / "second.out"), *resources,
                                                           script_args=[str(tmp_path / "plan.json")], **variables),
                       timeout=300)
    assert len(open(tmp_path / "sweep" / "results.jsonl").read().splitlines()) == len(results)
    assert f"sweep: {len(candidates)} skipped" in second
    # throughput, speed (predicted vs measured step), memory and pipeline efficiency
    assert (tmp_path / "sweep" / "report.md").exists() and len(list((tmp_path / "sweep").glob("*.png"))) == 4
