"""Every DeepSpeed internal we use still exists in the installed DeepSpeed, in the shape we use it."""
import inspect
import re

import pytest
import torch

from megatron_lite.deepspeed_compat import hooks, optimizer_state, pipeline, startup

METHODS = [(path, spec) for path, spec in hooks.HOOKS if spec not in ("attribute", "module name")]
ATTRIBUTES = [path for path, spec in hooks.HOOKS if spec == "attribute"]
MODULE_NAMES = [path for path, spec in hooks.HOOKS if spec == "module name"]


@pytest.mark.parametrize("path, parameters", METHODS, ids=[p for p, _ in METHODS])
def test_method_hook_exists_with_its_parameters(path, parameters):
    method = hooks.resolve(path)
    assert hooks.parameter_names(method)[:len(parameters.split(", "))] == parameters.split(", ")


@pytest.mark.parametrize("path", MODULE_NAMES)
def test_module_name_hook_is_still_a_class_that_module_looks_up(path):
    """A name a module looks up at run time (engine_finds_experts swaps deepspeed.runtime.engine.MoE): it must
    still be a class there, and the module must still test instances against it."""
    module_path, name = path.rsplit(".", 1)
    module = hooks.resolve(module_path)
    assert inspect.isclass(getattr(module, name, None)), f"{path} is no longer a class in {module.__file__}"
    assert re.search(rf"isinstance\(\w+, {name}\)", inspect.getsource(module)), f"{module.__file__} no longer checks {name}"


@pytest.mark.parametrize("path", ATTRIBUTES)
def test_attribute_hook_is_still_set_by_its_class(path):
    """An instance attribute cannot be looked up on the class: its class's source must still set it
    (or define it as a property), so a rename in DeepSpeed fails here by name."""
    class_path, attribute = path.rsplit(".", 1)
    cls = hooks.resolve(class_path)
    source = inspect.getsource(inspect.getmodule(cls))
    assert re.search(rf"\b{attribute} = |def {attribute}\(", source), \
        f"{path} is no longer set in {inspect.getsourcefile(cls)}"


def test_installed_deepspeed_is_in_the_pinned_range():
    import deepspeed
    from packaging.version import Version

    assert Version("0.19") <= Version(deepspeed.__version__) < Version("0.20")


def test_loss_scale_reads_the_public_property_and_none_without_scaling():
    class Scaled:
        loss_scale = 1024

    assert optimizer_state.loss_scale(Scaled()) == 1024.0
    assert optimizer_state.loss_scale(object()) is None


def test_no_other_module_touches_deepspeed_internals():
    """Private DeepSpeed names appear only in the deepspeed_compat package."""
    import pathlib
    import re

    compat = pathlib.Path(hooks.__file__).parent
    package = compat.parent
    private = re.compile(r"\b(_partition_layers|_set_bounds|_synchronize_tied_weights|_topo|ds_pipe_replicated|"
                         r"cur_scale|loss_scale_config|_exec_schedule|_INSTRUCTION_MAP)\b")
    offenders = [str(p.relative_to(package)) for p in package.rglob("*.py")
                 if compat not in p.parents and private.search(p.read_text())]
    assert offenders == []


def test_hooks_is_the_one_list_of_what_the_package_relies_on():
    """Every hook's entry is in hooks.HOOKS, which the tests above check: no other module of the package
    defines (or imports) a HOOKS of its own, which no test would read."""
    import ast
    import pathlib

    compat = pathlib.Path(hooks.__file__).parent
    others = {}
    for path in sorted(compat.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                bound = [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                         if isinstance(t, ast.Name)]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound = [a.asname or a.name for a in node.names]
            else:
                continue
            if "HOOKS" in bound:
                others.setdefault(path.name, []).append(node.lineno)
    assert list(others) == ["hooks.py"] and len(others["hooks.py"]) == 1, others


@pytest.mark.parametrize("path, text", startup.STARTUP_PRINTS, ids=[p for p, _ in startup.STARTUP_PRINTS])
def test_startup_lines_quiet_prints_hides_are_still_printed_not_logged(path, text):
    """quiet_prints exists because these lines are print()ed: once DeepSpeed logs them instead (its
    log level then hides them) or drops them, this fails by name and the hook can go."""
    source = inspect.getsource(hooks.resolve(path))
    assert re.search(r"print\([^\n]*" + re.escape(text), source), f"{path} no longer prints {text!r}"


def _pipeline_module_output(log_level):
    import contextlib
    import io

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    from megatron_lite.parallel import state

    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    if not state.is_initialized():
        state.initialize(1, 1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), startup.quiet_prints(log_level):
        PipelineModule([LayerSpec(torch.nn.Linear, 2, 2)], topology=state.get_topology())
    return out.getvalue()


def test_quiet_prints_hides_deepspeeds_startup_prints_below_info():
    from tests.harness import run_distributed

    assert run_distributed(_pipeline_module_output, 1, "warning") == [""]
    shown = run_distributed(_pipeline_module_output, 1, "info")[0]
    assert "SEED_LAYERS=" in shown and "Using topology:" in shown


def test_set_log_level_sets_deepspeeds_logger_and_its_handler():
    import logging

    from deepspeed.utils.logging import logger

    before = logger.level
    try:
        startup.set_log_level("error")
        assert logger.level == logging.ERROR and all(h.level == logging.ERROR for h in logger.handlers)
    finally:
        logger.setLevel(before)
        for h in logger.handlers:
            h.setLevel(before)


def _two_steps(pp, dp, hooked):
    """(flattening all-reduces DeepSpeed ran, losses, parameters, optimizer state sizes) on this rank
    after 2 steps, with skip_gradient_all_reduce applied where the engine applies it, or never."""
    from megatron_lite.parallel import state
    from megatron_lite.training import engine as engine_module
    from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config

    config = tiny_config(pp=pp, dp=dp)
    state.initialize(1, pp)
    original = pipeline.skip_gradient_all_reduce
    if not hooked:
        engine_module.pipeline.skip_gradient_all_reduce = lambda engine: None
    try:
        engine = engine_module.Engine(config, with_scheduler=False)
    finally:
        engine_module.pipeline.skip_gradient_all_reduce = original
    calls = []
    fallback = engine.engine.buffered_allreduce_fallback
    engine.engine.buffered_allreduce_fallback = lambda *a, **k: (calls.append(1), fallback(*a, **k))[1]
    data = micro_batches(config, global_batches(config, 2), state.get_data_parallel_rank(), dp)
    losses = [engine.train_step(data).loss for _ in range(2)]
    params = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    moments = sorted(len(s) for s in engine.optimizer.state.values())
    state.destroy()
    return len(calls), losses, params, moments


def test_skip_gradient_all_reduce_at_dp1_trains_and_decays_exactly_as_the_all_reduce_did():
    from tests.harness import run_distributed

    hooked = run_distributed(_two_steps, 2, 2, 1, True)
    plain = run_distributed(_two_steps, 2, 2, 1, False)
    for (calls, losses, params, moments), (calls_plain, losses_plain, params_plain, moments_plain) in zip(hooked, plain):
        assert calls == 0 and calls_plain > 0
        assert losses == losses_plain and moments == moments_plain
        # Every parameter bit for bit, the last stage's unused position table (zero gradient, decayed) too.
        assert params.keys() == params_plain.keys()
        assert all(torch.equal(params[k], params_plain[k]) for k in params)
    # Where the data-parallel group has two ranks the all-reduce stays.
    assert all(calls > 0 for calls, *_ in run_distributed(_two_steps, 2, 1, 2, True))


def _bytes_between_steps(free_outputs):
    """Live tensor bytes on each rank after two steps at PP 2 (vocabulary 2048: the logits are large)."""
    import gc

    import torch.distributed as dist

    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine
    from tests.cost.engine_census import live_storage_bytes
    from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config

    config = tiny_config(1, 2, 1, ["--vocab-size", "2048", "--micro-batch-size", "2", "--global-batch-size", "8"])
    state.initialize(1, 2)
    engine = Engine(config, with_scheduler=False)
    if not free_outputs:
        engine.engine._INSTRUCTION_MAP = type(engine.engine)._INSTRUCTION_MAP
    data = micro_batches(config, global_batches(config, 2), 0, 1)
    engine.train_step(data)
    engine.train_step(data)
    gc.collect()
    return {"rank": dist.get_rank(), "bytes": live_storage_bytes(), "config": config}


@pytest.mark.slow  # in the fast tier, the last stage's measured peak (tests/cost/test_memory.py) depends on it
def test_free_last_stage_outputs_drops_the_logits_the_pipeline_engine_keeps_after_backward():
    from tests.harness import run_distributed, shutdown_pools

    shutdown_pools()
    kept = run_distributed(_bytes_between_steps, 2, False)
    shutdown_pools()
    freed = run_distributed(_bytes_between_steps, 2, True)
    shutdown_pools()
    config = kept[0]["config"]
    logits = 4 * config.batch.micro_batch_size * config.model.seq_length * config.model.padded_vocab_size
    assert freed[0]["bytes"] == kept[0]["bytes"], "the first stage keeps no logits"
    # Two pipe buffers on the last stage (num_pipe_buffers = 2), each holding one micro-batch's fp32 logits.
    assert kept[1]["bytes"] - freed[1]["bytes"] >= 2 * logits


def _zeroed_gradients_leave_weights_unchanged(extra):
    """Every parameter's accumulated gradient zeroed in before_gradient_reduction: with no weight decay,
    Adam then moves nothing, whatever optimizer DeepSpeed wraps around it."""
    import torch

    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine
    from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config

    config = tiny_config(1, 2, 1, ["--weight-decay", "0", "--global-batch-size", "4"] + list(extra))
    state.initialize(1, 2)
    engine = Engine(config, with_scheduler=False)
    params = list(engine.module.parameters())
    calls, order = [], []
    pipeline.time_pipeline_instructions(engine.engine, lambda name, seconds: order.append(name), lambda: None)

    def zero():
        calls.append(1)
        order.append("callback")
        # (the position table of the head's copy of the tied embedding module has no gradient)
        grads = [g for g in (pipeline.accumulated_gradient(engine.engine, p) for p in params) if g is not None]
        assert len(grads) >= len(params) - 1 and all(g.abs().sum() > 0 for g in grads)
        for g in grads:
            g.zero_()

    pipeline.before_gradient_reduction(engine.engine, zero)
    before = [p.detach().float().clone() for p in params]
    engine.train_step(micro_batches(config, global_batches(config, 1), 0, 1))
    after = [p.detach().float() for p in params]
    return {"calls": len(calls), "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
            "next": order[order.index("callback") + 1]}


@pytest.mark.parametrize("extra", [
    pytest.param((), id="fp32-zero0"), pytest.param(("--bf16",), id="bf16-zero0", marks=pytest.mark.slow),
    pytest.param(("--zero-stage", "1"), id="fp32-zero1", marks=pytest.mark.slow),
    pytest.param(("--bf16", "--zero-stage", "1"), id="bf16-zero1", marks=pytest.mark.slow),
    pytest.param(("--pipeline-schedule", "dualpipev"), id="dualpipev-fp32-zero0"),
    pytest.param(("--pipeline-schedule", "dualpipev", "--bf16", "--zero-stage", "1"), id="dualpipev-bf16-zero1",
                 marks=pytest.mark.slow)])
def test_before_gradient_reduction_sees_the_gradients_the_optimizer_steps_with(extra):
    from tests.harness import run_distributed

    for r in run_distributed(_zeroed_gradients_leave_weights_unchanged, 2, list(extra)):
        assert r["calls"] == 1 and r["next"] == "ReduceTiedGrads"
        assert r["unchanged"], "the optimizer stepped with gradients other than accumulated_gradient's"


def _timed_with_each_set_of_hooks():
    """The instructions timed in a step under the hooks taken before time_pipeline_instructions, and under those
    taken after it."""
    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine
    from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config

    config = tiny_config(1, 2, 1, ["--global-batch-size", "4"])
    state.initialize(1, 2)
    engine = Engine(config, with_scheduler=False)
    untimed = pipeline.instruction_hooks(engine.engine)
    ran = []
    pipeline.time_pipeline_instructions(engine.engine, lambda name, seconds: ran.append(name), lambda: None)
    timed = pipeline.instruction_hooks(engine.engine)
    out = {}
    for name, hooks in (("untimed", untimed), ("timed", timed), ("untimed again", untimed)):
        pipeline.use_instruction_hooks(engine.engine, hooks)
        ran.clear()
        engine.train_step(micro_batches(config, global_batches(config, 1), 0, 1))
        out[name] = sorted(set(ran))
    return out


def test_instruction_hooks_switch_the_timed_instructions_and_the_timed_loss_broadcast_together():
    from tests.harness import run_distributed

    for r in run_distributed(_timed_with_each_set_of_hooks, 2):
        assert r["untimed"] == [] and r["untimed again"] == [], "hooks taken before the timing still timed a step"
        assert {"ForwardPass", "BackwardPass", "OptimizerStep", "AggregateLoss"} <= set(r["timed"])


def _dualpipev_engine():
    """What each rank of a --pipeline-schedule dualpipev engine (PP 2, gas 4) holds, and the instructions it ran."""
    import torch.distributed as dist
    from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine

    from megatron_lite.cost.stages import stage_bounds
    from megatron_lite.deepspeed_compat import dualpipev
    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine
    from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config

    config = tiny_config(1, 2, 1, ["--pipeline-schedule", "dualpipev"])
    state.initialize(1, 2)
    engine = Engine(config, with_scheduler=False)
    ran = []
    pipeline.time_pipeline_instructions(engine.engine, lambda name, seconds: ran.append(name), lambda: None)
    engine.train_step(micro_batches(config, global_batches(config, 1), 0, 1))
    module = engine.module
    return {"rank": dist.get_rank(), "engine": isinstance(engine.engine, DualPipeVEngine),
            "dualpipev": dualpipev.is_dualpipev(engine.engine), "bounds": stage_bounds(config),
            "starts": [start for start, _ in dualpipev.stage_layer_functions(module)],
            "files": sorted(pipeline.layer_file_modules(module)), "tied": sorted(module.tied_modules),
            "copies": sum(pipeline.is_pipe_replicated_copy(p) for p in module.parameters()), "ran": set(ran)}


def test_a_dualpipev_rank_holds_its_stage_and_the_mirror_stage_and_times_every_instruction():
    from tests.harness import run_distributed

    ranks = run_distributed(_dualpipev_engine, 2)
    bounds = ranks[0]["bounds"]  # 2 x PP = 4 stages of the 7 specs: embedding, 4 layers, final norm, head
    assert len(bounds) == 5 and bounds[0] == 0 and bounds[-1] == 7
    first, second = ranks
    assert first["engine"] and first["dualpipev"] and second["engine"]
    assert first["starts"] == [0, bounds[3]] and second["starts"] == [bounds[1], bounds[2]]
    # Layer files are named by spec index under either schedule; the tied head (spec 6) has none of its own.
    assert first["files"] == list(range(bounds[0], bounds[1])) + list(range(bounds[3], 6))
    assert second["files"] == list(range(bounds[1], bounds[3]))
    # The tied embedding and head are one module on rank 0: no copy to all-reduce.
    assert first["tied"] == ["embedding"] and second["tied"] == [] and first["copies"] == second["copies"] == 0
    for r in ranks:
        assert {"ForwardPass", "BackwardPass", "CommitP2P", "OptimizerStep", "AggregateLoss"} <= r["ran"]
    assert "LoadMicroBatch" in first["ran"] and "LoadMicroBatch" not in second["ran"]  # rank 0 loads and ends


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_at_a_dualpipev_ranks_peak_stage_s_holds_2pp_minus_s_micro_batches_as_the_memory_estimate_books(pp):
    from megatron_lite.cost.memory import micro_batches_in_flight
    from megatron_lite.deepspeed_compat.dualpipev import instruction_streams
    from tests.model.gpt_layouts import tiny_config

    gas = 4 * pp
    config = tiny_config(1, pp, 1, ["--pipeline-schedule", "dualpipev", "--num-layers", str(2 * pp),
                                    "--global-batch-size", str(gas)])
    for rank, stream in enumerate(instruction_streams(pp, gas, "dualpipev")):
        live, peak = {}, (0, None)
        for kind, stage in stream:
            if kind in ("forward", "backward"):
                live[stage] = live.get(stage, 0) + (1 if kind == "forward" else -1)
                if sum(live.values()) > peak[0]:
                    peak = (sum(live.values()), dict(live))
        stages = (rank, 2 * pp - 1 - rank)
        assert peak[1] == {s: 2 * pp - s for s in stages}  # both at their most at once
        assert all(peak[1][s] == micro_batches_in_flight(config, s) for s in stages)


def _collective_on_a_deepspeed_group(timeout_seconds: float):
    """Rank 0 all-reduces over a group made as DeepSpeed makes its own (the pipeline grid's, ZeRO's); rank 1
    never joins but keeps the group open. Rank 0's (seconds waited, error)."""
    import datetime
    import time

    import deepspeed
    from deepspeed.comm import comm

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    startup.new_groups_time_out_after(datetime.timedelta(seconds=timeout_seconds))
    try:
        group = comm.new_group([0, 1])
        if torch.distributed.get_rank() == 1:
            time.sleep(timeout_seconds + 5)  # a stuck rank: there, silent
            return None
        start = time.monotonic()
        try:
            torch.distributed.all_reduce(torch.ones(1), group=group)
        except RuntimeError as e:
            return time.monotonic() - start, str(e)
        return time.monotonic() - start, "completed"
    finally:
        vars(comm.cdb).pop("new_group", None)  # the pool's later tasks get DeepSpeed's own


def test_deepspeeds_own_groups_give_up_on_a_collective_after_the_distributed_timeout():
    from tests.harness import run_distributed

    waited, error = run_distributed(_collective_on_a_deepspeed_group, 2, 2.0)[0]
    # without the hook the group has torch's 30 minutes and waits until rank 1 lets go of it (7 s)
    assert "Timed out" in error and 1.5 <= waited < 5, (waited, error)
