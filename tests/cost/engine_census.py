"""Bytes a real DeepSpeed engine holds: every live tensor's storage, counted once, taken just
before the optimizer's second step (gradients reduced, optimizer states and master copies
allocated by the first step, activations freed; DeepSpeed's ZeRO 1/2 optimizer steps its parameter
groups one by one, so this is the last group's step), and between steps after it."""
import gc
from contextlib import contextmanager

import torch

from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config


# A CPU generator's state (torch.get_rng_state(): a uint8 tensor of this many bytes). The RNG trackers and
# DeepSpeed keep a dozen of them (14 x 5,056 bytes measured on a tiny TP 2 x PP 2 engine, 2% of its model
# states); on a GPU machine they are host memory, and the estimate books device memory, so they are not counted.
CPU_RNG_STATE_BYTES = torch.get_rng_state().numel()


def _is_cpu_rng_state(t: torch.Tensor) -> bool:
    return t.dtype == torch.uint8 and t.device.type == "cpu" and t.dim() == 1 and t.numel() == CPU_RNG_STATE_BYTES


def live_storage_bytes():
    seen = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta and not _is_cpu_rng_state(obj):
                # A .grad set from C++ (autograd) may have no Python object of its own to find.
                for t in (obj, obj.grad) if obj.is_leaf else (obj,):
                    if t is not None:
                        storage = t.untyped_storage()
                        seen[storage.data_ptr()] = storage.nbytes()
        except Exception:  # noqa: BLE001 - objects that only look like tensors
            continue
    return sum(seen.values())


@contextmanager
def imports_frozen():
    """Python's collections skip the objects this process held on entry (torch's and DeepSpeed's modules, which a
    pool worker inherits from its fork server), as gc.freeze() leaves them: DeepSpeed's see_memory_usage collects
    six times while it builds a bf16 engine, 0.2 s each over that heap (half of rank 0's CPU, measured).
    Count with collected_live_bytes in here: gc.get_objects, which live_storage_bytes walks, skips frozen objects."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def collected_live_bytes():
    """live_storage_bytes after a full collection, every object unfrozen for both (then frozen again)."""
    gc.unfreeze()
    gc.collect()
    try:
        return live_storage_bytes()
    finally:
        gc.freeze()


def _innermost_optimizer(optimizer):
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) or \
            hasattr(getattr(optimizer, "optimizer", None), "step"):
        optimizer = optimizer.optimizer
    return optimizer


def engine_census(tp, pp, dp, extra, ds_json):
    with imports_frozen():
        return _engine_census(tp, pp, dp, extra, ds_json)


def _engine_census(tp, pp, dp, extra, ds_json):
    import torch.distributed as dist

    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine

    # hidden 128: model states large next to the few activation-sized buffers the engine keeps between steps
    config = tiny_config(tp, pp, dp, ("--hidden-size", "128") + tuple(extra) + ("--deepspeed-config", ds_json))
    state.initialize(tp, pp, expert_model_parallel_size=config.parallel.expert_model_parallel_size)
    engine = Engine(config, with_scheduler=False)
    data = micro_batches(config, global_batches(config, 2), state.get_data_parallel_rank(), dp)
    engine.train_step(data)
    inner = _innermost_optimizer(engine.optimizer)
    taken = {}
    real_step = inner.step

    def step(*args, **kwargs):
        taken["bytes"] = collected_live_bytes()
        return real_step(*args, **kwargs)

    inner.step = step
    engine.train_step(data)
    between = collected_live_bytes()
    stage = state.get_pipeline_model_parallel_rank()
    return {"rank": dist.get_rank(), "stage": stage, "bytes": taken["bytes"], "between": between, "config": config}
