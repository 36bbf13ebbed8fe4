"""Every DeepSpeed internal we use still exists in the installed DeepSpeed, in the shape we use it."""
import inspect
import re

import pytest

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
                         r"cur_scale|loss_scale_config|_exec_schedule|_INSTRUCTION_MAP|pipeline_enable_backward_allreduce)\b")
    offenders = [str(p.relative_to(package)) for p in package.rglob("*.py")
                 if p.name != "deepspeed_compat.py" and private.search(p.read_text())]
    assert offenders == []


def _reductions_per_step(dp, zero_stage):
    """(gradient all-reduces the pipeline engine ran in 2 steps, losses) on this rank."""
    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine
    from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config

    config = tiny_config(dp=dp, extra=("--zero-stage", str(zero_stage)))
    state.initialize(1, 1)
    engine = Engine(config, with_scheduler=False)
    calls = []
    for name in ("buffered_allreduce_fallback", "allreduce_gradients"):
        method = getattr(engine.engine, name)
        setattr(engine.engine, name, lambda *a, _m=method, _n=name, **k: (calls.append(_n), _m(*a, **k))[1])
    data = micro_batches(config, global_batches(config, 2), state.get_data_parallel_rank(), dp)
    losses = [engine.train_step(data).loss for _ in range(2)]
    state.destroy()
    return calls, losses


def test_skip_gradient_all_reduce_leaves_out_the_identity_all_reduce_at_dp1_only():
    from tests.harness import run_distributed

    (calls_dp1, losses_dp1), = run_distributed(_reductions_per_step, 1, 1, 0)
    assert calls_dp1 == []
    # DP = 2 still reduces (the same global batch, so the same losses), and so does ZeRO 1 at DP = 1.
    (calls_dp2, losses_dp2), _ = run_distributed(_reductions_per_step, 2, 2, 0)
    assert calls_dp2 and losses_dp2 == pytest.approx(losses_dp1, rel=1e-5)
    (calls_zero1, _), = run_distributed(_reductions_per_step, 1, 1, 1)
    assert "allreduce_gradients" in calls_zero1
