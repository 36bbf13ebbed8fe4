"""scripts/gpu_check.sh: its dry run on the CPU (so the GPU check cannot rot between GPU sessions),
its budgets, and how it reads a training run's numbers from its metrics records."""
import json
import os
import subprocess
import sys
import time

import pytest

from tests.harness import REPO_ROOT

from benchmarks.gpu_check import context as gpu_check_context
from benchmarks.gpu_check import run as gpu_check
from benchmarks.gpu_check import steps as gpu_check_steps


@pytest.mark.slow
def test_dry_run_passes_every_step_and_writes_a_report_with_the_summary_table_first(tmp_path):
    report = tmp_path / "report"
    env = {**{k: v for k, v in os.environ.items() if k != "OUT"}, "PYTHON": sys.executable}
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--work-dir", str(tmp_path / "work"),
                           "--report-dir", str(report)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((report / "gpu_check.json").read_text())["results"]
    assert [r["step"] for r in results] == [key for key, *_ in gpu_check_steps.STEPS]
    assert {r["step"]: r["status"] for r in results} == {"env": "pass", "install": "skip", "build": "pass",
                                                          "a": "pass", "b": "pass", "calibrate": "pass", "c": "pass",
                                                          "d": "pass", "moe": "pass", "mla": "pass",
                                                          "gptoss": "pass", "compile": "pass"}
    markdown = (report / "gpu_check.md").read_text()
    table_start = markdown.index("| step | what | status |")
    assert all(markdown.index(f"\n## {key}:") > table_start for key in ("a", "b", "c", "d"))
    c = {r["step"]: r for r in results}["c"]["numbers"]
    assert c["full"]["tokens_per_s"] > 0  # c ran with full recompute too
    # The plan priced the measured run from the calibrate step's profile and from the constants.
    assert set(c["predicted_over_measured"]) == {"calibrated", "constants"}
    assert all(isinstance(v, float) and v > 0 for v in c["predicted_over_measured"].values())
    assert "passed" in (report / "gpu_check_tests.log").read_text()  # the whole pytest output is kept
    assert {r["step"]: r for r in results}["moe"]["numbers"]["loop"]["tokens_per_s"] > 0
    assert {r["step"]: r for r in results}["mla"]["numbers"]["mla-moe-mtp"]["tokens_per_s"] > 0
    assert {r["step"]: r for r in results}["gptoss"]["numbers"]["sdpa"]["tokens_per_s"] > 0
    compiled = {r["step"]: r for r in results}["compile"]["numbers"]
    assert compiled["dense compiled"]["tokens_per_s"] > 0 and compiled["dense compiled_over_eager"] > 0


def test_each_failing_tests_traceback_is_written_when_it_fails_not_at_the_end(tmp_path):
    """A pytest run the GPU check kills at its budget never prints its summary: the plugin writes each failure
    as its report arrives, so a run killed after the failure has it on disk."""
    (tmp_path / "test_two.py").write_text(
        "import time\n"
        "def test_fails():\n    assert 1 + 1 == 3, 'the reason'\n"
        "def test_hangs():\n    time.sleep(60)\n")
    log = tmp_path / "failures.log"
    env = {**os.environ, "MEGATRON_LITE_FAILURE_LOG": str(log), "PYTHONPATH": REPO_ROOT}
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                            "benchmarks.gpu_check.immediate_failures", str(tmp_path / "test_two.py")],
                           cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not log.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert run.poll() is None, "pytest ended: the hanging test did not hang"
    finally:
        run.kill()
        run.wait()
    text = log.read_text()
    assert "test_two.py::test_fails (call)" in text and "the reason" in text and "test_hangs" not in text


def test_a_step_out_of_time_is_recorded_and_the_next_step_still_runs(tmp_path):
    ctx = gpu_check_context.Context(dry_run=True, work_dir=str(tmp_path))

    def sleeper(c):
        c.run(["sleep", "30"])
        return "pass", "", "", {}

    def quick(c):
        said = gpu_check_context.last_line(c.run(["echo", "fine"], check=True).output)
        return "pass", said, "", {"said": said}

    slow = gpu_check.run_step(ctx, "x", "sleeps past its budget", 1.0, sleeper)
    fast = gpu_check.run_step(ctx, "y", "echoes", 30.0, quick)
    assert slow.status == "timeout" and slow.seconds < 10 and fast.status == "pass" and fast.summary == "fine"
    gpu_check.write_report([slow, fast], str(tmp_path / "r"), "header", ctx.log)
    assert "| x | sleeps past its budget | timeout |" in (tmp_path / "r" / "gpu_check.md").read_text()


def test_training_numbers_read_the_metrics_records_pretrain_gpt_writes(tmp_path):
    from megatron_lite.training.records import FILE_NAME, RecordWriter, read_records

    writer = RecordWriter(str(tmp_path))
    writer.write("start", iteration=0, train_iters=30)
    writer.write("interval", iteration=30, iterations=10, seconds=8.1, loss=7.25, ms_per_iteration=812.5,
                 tokens_per_s=40330.0, tflops_per_rank=367.2, mfu=0.371, mem_allocated_gib=30.1, mem_peak_gib=61.25)
    writer.write("stage_memory", stages=[{"stage": 0, "estimated_bytes": 58.1 * 2**30,
                                          "measured_peak_bytes": 61.25 * 2**30}], measured="torch.cuda")
    writer.close()
    parsed = gpu_check_steps.training_numbers(read_records(str(tmp_path / FILE_NAME)))
    assert parsed["iterations"] == [{"iteration": 30, "loss": 7.25, "ms_per_iteration": 812.5,
                                     "tokens_per_s": 40330.0, "tflops": 367.2, "mfu_percent": pytest.approx(37.1),
                                     "mem_peak_gib": 61.25}]
    assert parsed["memory"] == [{"stage": 0, "estimated_gib": pytest.approx(58.1), "measured_gib": 61.25}]


def test_device_factories_put_new_tensors_on_the_test_device_and_keep_cpu_generator_draws():
    """tests/device.py, checked with the meta device (no GPU here): a factory call without a device
    lands on the test device; one drawing from a CPU generator draws the CPU's values and moves them;
    an explicit device is kept."""
    import torch

    from tests.device import DeviceFactories

    expected = torch.randn(3, generator=torch.Generator().manual_seed(5))
    with DeviceFactories("meta"):
        made = torch.zeros(2, 2)
        drawn = torch.randn(3, generator=torch.Generator().manual_seed(5))
        kept = torch.ones(2, device="cpu")
        layer = torch.nn.Linear(4, 4)
    assert made.device.type == "meta" and layer.weight.device.type == "meta"
    assert drawn.device.type == "meta" and drawn.shape == expected.shape
    assert kept.device.type == "cpu"
    with DeviceFactories("cpu"):
        assert torch.equal(torch.randn(3, generator=torch.Generator().manual_seed(5)), expected)


def test_a_cpu_generator_draw_asked_for_with_requires_grad_is_a_leaf_on_the_test_device():
    """Moved to the test device, such a tensor must still collect its own .grad (the GPU check's
    context-parallel attention tests read x.grad, which was None: the leaf had stayed on the CPU)."""
    import torch

    from tests.device import DeviceFactories

    with DeviceFactories("meta"):
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(5), requires_grad=True)
    assert x.device.type == "meta" and x.is_leaf and x.requires_grad


def test_a_step_budget_for_an_unknown_step_or_without_seconds_is_refused_naming_the_flag(capsys):
    for bad in ("x=10", "a=soon"):
        with pytest.raises(SystemExit) as e:
            gpu_check.main(["--dry-run", "--steps", "env", "--budget", bad])
        assert e.value.code == 2 and f"--budget {bad}" in capsys.readouterr().err
