"""Estimator accuracy on this machine: predicted vs measured bytes per pipeline stage.

Measured on CPU with gloo, per layout of the tiny sweep model:
  model states + buffers = every live tensor storage (counted once) just before the optimizer's
                           second step (tests/cost/engine_census.py);
  activations            = storages autograd saves for backward for one micro-batch, per stage
                           (saved_tensors_hooks; tests/cost/activation_census.py).
Prints one line per (layout, stage) with the ratio measured / predicted.

    OMP_NUM_THREADS=1 python benchmarks/bench_memory_estimate.py
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYOUTS = [(1, 1, 2, ()), (2, 1, 1, ()), (1, 2, 1, ()), (2, 2, 1, ()), (1, 1, 2, ("--zero-stage", "1")),
           (1, 2, 2, ("--zero-stage", "1")), (1, 1, 2, ("--zero-stage", "2")), (2, 1, 2, ("--zero-stage", "2"))]


def _activations(tp, pp, micro):
    from tests.model.gpt_layouts import tiny_config
    from tests.cost.activation_census import saved_bytes_per_stage

    return saved_bytes_per_stage(tiny_config(tp, pp, 1, ["--micro-batch-size", str(micro), "--global-batch-size",
                                                         str(4 * micro), "--hidden-dropout", "0.1",
                                                         "--attention-dropout", "0.1"]))


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    from megatron_lite.cost import memory
    from megatron_lite.deepspeed_config import deepspeed_config
    from tests.harness import run_distributed, shutdown_pools
    from tests.model.gpt_layouts import tiny_config
    from tests.cost.engine_census import engine_census

    start = time.time()
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        ds_json = os.path.join(tmp, "ds.json")
        with open(ds_json, "w") as f:
            json.dump({"zero_optimization": {"reduce_bucket_size": 2000}}, f)
        print(f"{'layout':<24} {'stage':>5} {'predicted states+buffers':>24} {'measured':>10} {'ratio':>6}")
        for tp, pp, dp, extra in LAYOUTS:
            shutdown_pools()
            results = run_distributed(engine_census, tp * pp * dp, tp, pp, dp, list(extra), ds_json)
            config = results[0]["config"]
            stages = memory.estimate(config, {"zero_optimization": {"stage": config.parallel.zero_stage,
                                                                    "reduce_bucket_size": 2000}}, device="cpu")
            name = f"tp{tp}_pp{pp}_dp{dp}_zero{config.parallel.zero_stage}"
            for stage in sorted({r["stage"] for r in results}):
                got = next(r["bytes"] for r in results if r["stage"] == stage)
                want = stages[stage].model_states + stages[stage].communication_buffers
                worst = max(worst, abs(got / want - 1))
                print(f"{name:<24} {stage:>5} {want:>24,} {got:>10,} {got / want:>6.3f}", flush=True)
        print(f"\n{'layout (dropout 0.1)':<24} {'stage':>5} {'predicted activations/mb':>24} {'measured':>10} {'ratio':>6}")
        for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
            for micro in (1, 2):
                shutdown_pools()
                measured = run_distributed(_activations, tp, tp, pp, micro)[0]
                config = tiny_config(tp, pp, 1, ["--micro-batch-size", str(micro), "--global-batch-size",
                                                 str(4 * micro), "--hidden-dropout", "0.1", "--attention-dropout", "0.1"])
                for stage, st in enumerate(memory.estimate(config, deepspeed_config(config), device="cpu")):
                    want, got = st.activations_per_micro_batch, measured[stage]
                    worst = max(worst, abs(got / want - 1))
                    print(f"{f'tp{tp}_pp{pp}_mb{micro}':<24} {stage:>5} {want:>24,} {got:>10,} {got / want:>6.3f}",
                          flush=True)
        shutdown_pools()
    print(f"bench_memory_estimate: worst |measured/predicted - 1| = {100 * worst:.1f}% in {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
