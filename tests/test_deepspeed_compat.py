"""Every DeepSpeed internal we use still exists in the installed DeepSpeed, in the shape we use it."""
import inspect
import re

import pytest
import torch

from megatron_lite import deepspeed_compat

METHODS = [(path, spec) for path, spec in deepspeed_compat.HOOKS if spec != "attribute"]
ATTRIBUTES = [path for path, spec in deepspeed_compat.HOOKS if spec == "attribute"]


@pytest.mark.parametrize("path, parameters", METHODS, ids=[p for p, _ in METHODS])
def test_method_hook_exists_with_its_parameters(path, parameters):
    method = deepspeed_compat.resolve(path)
    assert deepspeed_compat.parameter_names(method)[:len(parameters.split(", "))] == parameters.split(", ")


@pytest.mark.parametrize("path", ATTRIBUTES)
def test_attribute_hook_is_still_set_by_its_class(path):
    """An instance attribute cannot be looked up on the class: its class's source must still set it
    (or define it as a property), so a rename in DeepSpeed fails here by name."""
    class_path, attribute = path.rsplit(".", 1)
    cls = deepspeed_compat.resolve(class_path)
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

    assert deepspeed_compat.loss_scale(Scaled()) == 1024.0
    assert deepspeed_compat.loss_scale(object()) is None


def test_no_other_module_touches_deepspeed_internals():
    """Private DeepSpeed names appear only in deepspeed_compat.py."""
    import pathlib
    import re

    package = pathlib.Path(deepspeed_compat.__file__).parent
    private = re.compile(r"\b(_partition_layers|_set_bounds|_synchronize_tied_weights|_topo|ds_pipe_replicated|"
                         r"cur_scale|loss_scale_config|_exec_schedule|_INSTRUCTION_MAP)\b")
    offenders = [str(p.relative_to(package)) for p in package.rglob("*.py")
                 if p.name != "deepspeed_compat.py" and private.search(p.read_text())]
    assert offenders == []


@pytest.mark.parametrize("path, text", deepspeed_compat.STARTUP_PRINTS, ids=[p for p, _ in deepspeed_compat.STARTUP_PRINTS])
def test_startup_lines_quiet_prints_hides_are_still_printed_not_logged(path, text):
    """quiet_prints exists because these lines are print()ed: once DeepSpeed logs them instead (its
    log level then hides them) or drops them, this fails by name and the hook can go."""
    source = inspect.getsource(deepspeed_compat.resolve(path))
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
    with contextlib.redirect_stdout(out), deepspeed_compat.quiet_prints(log_level):
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
        deepspeed_compat.set_log_level("error")
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
    original = deepspeed_compat.skip_gradient_all_reduce
    if not hooked:
        engine_module.deepspeed_compat.skip_gradient_all_reduce = lambda engine: None
    try:
        engine = engine_module.Engine(config, with_scheduler=False)
    finally:
        engine_module.deepspeed_compat.skip_gradient_all_reduce = original
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
