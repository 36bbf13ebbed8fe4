"""The measured hardware profile: `tune_parallelism.py calibrate` writes it, `plan --profile` prices layouts with it.

One small calibration (two gloo processes, a few seconds) serves the module; the planner's prediction for a
tiny two-stage layout is checked against a real engine step of that layout on this machine."""
import json
import time

import pytest

from megatron_lite.config import ConfigError
from megatron_lite.tuning import calibration, recipe
from megatron_lite.tuning.measure import fit_latency_bandwidth
from tests.harness import run_distributed
from tools import tune_parallelism

MODEL = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
         "--vocab-size", "2048", "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "4"]
TINY_LAYOUT = "tp1_cp1_pp2_dp1_mb4"  # two stages at gas 1: the bubble and the send/recv are in the prediction


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("calibration") / "profile.json")
    rc = tune_parallelism.main(["calibrate", "--output", path, "--device", "cpu", "--gemm-tokens", "128", "512",
                                "--gemm-hidden", "256", "--copy-megabytes", "16", "--message-bytes", "4096", "65536",
                                "1048576", "--iters", "3", "--min-seconds", "0.1"])
    assert rc == 0
    return path


def test_calibrate_on_cpu_writes_a_profile_with_positive_values_and_sane_fits(profile_path):
    p = calibration.load(profile_path)
    assert (p.device, p.backend, p.dtype, p.threads) == ("cpu", "gloo", "float32", 1)
    assert [g.tokens for g in p.gemm] == [128, 512] and all(g.flops_per_s > 1e8 for g in p.gemm)
    assert p.memory_gbps > 0.1
    assert set(p.collectives) == set(calibration.COLLECTIVES)
    for name, fits in p.collectives.items():
        fit = fits[2]
        assert fit.latency_s >= 0 and fit.bandwidth_gbps > 0, name
        # The stored fit is the fit of the stored measurements (how well it explains them depends on the
        # machine's load: not test material; test_fit_recovers_latency_and_bandwidth checks the fitting).
        assert all(t > 0 for t in fit.seconds) and len(fit.sizes_bytes) == len(fit.seconds) >= 2, name
        latency, gbps = fit_latency_bandwidth(fit.sizes_bytes, fit.seconds)
        assert (latency, gbps) == pytest.approx((fit.latency_s, fit.bandwidth_gbps), rel=1e-9), name


def test_fit_recovers_latency_and_bandwidth():
    sizes = [1e3, 1e5, 1e6, 1e7]
    latency, gbps = fit_latency_bandwidth(sizes, [50e-6 + s / 2e9 for s in sizes])
    assert latency == pytest.approx(50e-6, rel=1e-6) and gbps == pytest.approx(2.0, rel=1e-6)


def test_gemm_rate_is_interpolated_in_log_tokens_and_clamped():
    p = calibration.Profile("cpu", "x", "gloo", "2", "now", "float32", 1,
                            [calibration.GemmPoint(100, 8, 8, 1e9), calibration.GemmPoint(10000, 8, 8, 3e9)], 1.0, {})
    assert p.gemm_flops_per_s(1000) == pytest.approx(2e9)
    assert p.gemm_flops_per_s(10) == 1e9 and p.gemm_flops_per_s(1e6) == 3e9


def _rewrite(profile_path, tmp_path, change):
    with open(profile_path) as f:
        d = json.load(f)
    change(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    return str(path)


def test_a_missing_or_malformed_profile_is_refused_naming_the_file_and_the_field(profile_path, tmp_path):
    with pytest.raises(ConfigError, match=r"^--profile .*nowhere.json: no such file; write one with"):
        calibration.load(str(tmp_path / "nowhere.json"))
    (tmp_path / "text.json").write_text("import os")
    with pytest.raises(ConfigError, match=r"text.json: not JSON"):
        calibration.load(str(tmp_path / "text.json"))
    (tmp_path / "bytes.json").write_bytes(bytes([0x91, 0x00, 0xff]) * 8)  # was a UnicodeDecodeError traceback
    with pytest.raises(ConfigError, match=r"^--profile .*bytes.json: not UTF-8 text \(byte 0x91 at offset 0\)"):
        calibration.load(str(tmp_path / "bytes.json"))
    bad = _rewrite(profile_path, tmp_path, lambda d: d.pop("memory_gbps"))
    with pytest.raises(ConfigError, match=r"bad.json: field 'memory_gbps' is missing"):
        calibration.load(bad)
    bad = _rewrite(profile_path, tmp_path, lambda d: d["collectives"]["all_to_all"]["2"].update(bandwidth_gbps=-1))
    with pytest.raises(ConfigError, match=r"bad.json: field 'collectives.all_to_all.2.bandwidth_gbps' is -1, "
                                          r"expected a positive number"):
        calibration.load(bad)
    bad = _rewrite(profile_path, tmp_path, lambda d: d["gemm"][1].update(flops_per_s="fast"))
    with pytest.raises(ConfigError, match=r"field 'gemm\[1\].flops_per_s' is 'fast'"):
        calibration.load(bad)


def test_plan_with_a_profile_from_another_device_type_is_one_line_error(profile_path, capsys):
    rc = tune_parallelism.main(["plan", "--nodes", "1", "--gpus-per-node", "2", "--gpu-memory-gb", "8",
                                "--profile", profile_path, *MODEL])  # --device defaults to cuda
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert f"profile {profile_path} was measured on cpu" in err and "--device cuda" in err


def test_a_one_device_profile_plans_one_rank_and_refuses_a_group_naming_what_to_measure(profile_path, tmp_path,
                                                                                      capsys):
    # `calibrate --world-size 1` (one GPU: NCCL takes one rank per GPU) measures compute and memory only.
    one = _rewrite(profile_path, tmp_path, lambda d: d.update(collectives={n: {} for n in calibration.COLLECTIVES}))
    rc = tune_parallelism.main(["plan", "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "8",
                                "--device", "cpu", "--profile", one, *MODEL])
    assert rc == 0 and "tp1_cp1_pp1_dp1" in capsys.readouterr().out
    rc = tune_parallelism.main(["plan", "--nodes", "1", "--gpus-per-node", "2", "--gpu-memory-gb", "8",
                                "--device", "cpu", "--profile", one, *MODEL])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "no all_reduce measurements (calibrated with --world-size 1)" in err and "--world-size 2" in err


def _measured_step_seconds(argv, steps):
    from megatron_lite.arguments import parse_args
    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine
    from megatron_lite.tuning.measure_model import random_batches

    config = parse_args(argv, world_size=2)[0]
    state.initialize(config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size)
    engine = Engine(config, with_scheduler=False)
    data = random_batches(config)
    engine.train_step(data)  # warm-up
    best = float("inf")
    for _ in range(steps):
        start = time.perf_counter()
        engine.train_step(data)
        best = min(best, time.perf_counter() - start)
    return best


def test_plan_with_a_profile_predicts_a_tiny_layouts_step_within_5x_of_a_real_step(profile_path, tmp_path):
    profile = calibration.load(profile_path)
    kw = dict(nodes=1, gpus_per_node=2, gpu_memory_gb=8, max_micro_batch=4, device="cpu", workdir=str(tmp_path),
              max_context_parallel=1, order="throughput")
    measured_plan = recipe.plan(MODEL, profile=profile, **kw)
    constant_plan = recipe.plan(MODEL, **kw)
    assert [c.rank for c in measured_plan.candidates] == list(range(1, len(measured_plan.candidates) + 1))
    assert measured_plan.cluster["profile"]["device"] == "cpu" and "profile" not in constant_plan.cluster
    predicted = {c.layout: c.predicted_step_seconds for c in measured_plan.candidates}
    constant = {c.layout: c.predicted_step_seconds for c in constant_plan.candidates}
    assert predicted.keys() == constant.keys() and TINY_LAYOUT in predicted
    # The constants (312 TFLOP/s, 150 GB/s) are three orders of magnitude too fast for a CPU.
    assert all(predicted[k] > 10 * constant[k] for k in predicted)
    candidate = next(c for c in measured_plan.candidates if c.layout == TINY_LAYOUT)
    seconds = run_distributed(_measured_step_seconds, 2, candidate.pretrain_argv, 3)
    measured = max(seconds)
    assert 0.2 < predicted[TINY_LAYOUT] / measured < 5, (predicted[TINY_LAYOUT], measured)
