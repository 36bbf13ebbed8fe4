"""The peak bytes of tensor storage a real DeepSpeed engine holds during a training step, per rank.

CPU has no allocator statistics, so the peak is put together from two measurements of a step:
the storages alive when it starts (every tensor reachable from Python, counted once, as
engine_census.py counts them; between steps autograd holds nothing) plus the highest running sum
of the storages the step's operators create, each counted until it dies (a dispatch mode sees
every operator's output; a weak reference says when a storage is gone, whichever thread let go of
it last: torch's profiler misses frees on gloo's threads, which made its numbers vary by 10% from
run to run under sequence parallelism). Storages that already existed (views, in-place results)
are not new. Memory an operator uses only inside itself is not seen.
Steps 3 and 4 are measured: by then the optimizer states exist and the pipe buffers have their
steady shape.
"""
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.cost.engine_census import collected_live_bytes, imports_frozen
from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config


class StoragePeak(TorchDispatchMode):
    """Running sum of the bytes of the storages created by operators while active, and its peak."""

    def __init__(self):
        super().__init__()
        self.alive = {}  # storage address -> (weak reference, bytes)
        self.total = 0
        self.peak = 0
        self.mark = 0  # the highest running sum since the last take_mark (a phase's peak)

    def collect(self) -> None:
        for key in [key for key, (ref, _) in self.alive.items() if ref.expired()]:
            self.total -= self.alive.pop(key)[1]

    def restart_peak(self) -> int:
        """Start a new peak from here; returns the running sum now."""
        self.collect()
        self.peak = self.total
        return self.total

    def take_mark(self) -> int:
        """The highest running sum since the last call; starts the next phase's from here."""
        self.collect()
        mark, self.mark = max(self.mark, self.total), self.total
        return mark

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.collect()
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage._cdata not in inputs and storage._cdata not in self.alive:
                    self.alive[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.total += storage.nbytes()
        self.peak = max(self.peak, self.total)
        self.mark = max(self.mark, self.total)
        return out


def engine_peak(tp, pp, dp, extra, ds_json, free_last_stage_outputs=True, cp=1, phases=False):
    """This rank's peak over steps 3 and 4 (the higher of the two), and the bytes alive between steps.
    cp: --context-parallel-size (the world is TP x CP x PP x DP). phases: also each pipeline instruction's
    peak (ForwardPass, BackwardPass, ReduceGrads, OptimizerStep, ...) over those steps, as bytes alive
    (the step's start included), under "phases"."""
    with imports_frozen():
        return _engine_peak(tp, pp, dp, extra, ds_json, free_last_stage_outputs, cp, phases)


def _engine_peak(tp, pp, dp, extra, ds_json, free_last_stage_outputs, cp, phases):
    import torch.distributed as dist

    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine

    config = tiny_config(tp, pp, dp, tuple(extra) + ("--deepspeed-config", ds_json), cp=cp)
    state.initialize(tp, pp, context_parallel_size=cp)
    engine = Engine(config, with_scheduler=False)
    if not free_last_stage_outputs:  # DeepSpeed's own instructions, as without deepspeed_compat's hook
        engine.engine._INSTRUCTION_MAP = type(engine.engine)._INSTRUCTION_MAP
    data = micro_batches(config, global_batches(config, 4), state.get_data_parallel_rank(), dp,
                         cp=(state.get_context_parallel_rank(), cp))
    engine.train_step(data)
    peaks, alive, phase_peaks, measuring, start_of_step = [], [], {}, [False], [0]
    tracker = StoragePeak()

    def record(name, seconds):
        """After each phase: its highest total, as bytes alive (the step's start included)."""
        mark = tracker.take_mark()
        if measuring[0]:
            phase_peaks[name] = max(phase_peaks.get(name, 0), alive[-1] + mark - start_of_step[0])

    if phases and engine.pipelined:
        from megatron_lite.deepspeed_compat import pipeline

        pipeline.time_pipeline_instructions(engine.engine, record, lambda: None)
    elif phases:  # ZeRO 2/3 at PP 1: DeepSpeed's plain engine, called forward, backward, step per micro-batch
        def after(name, method):
            def run(*args, **kwargs):
                result = method(*args, **kwargs)
                record(name, 0.0)
                return result
            return run

        ds = engine.engine
        ds.forward, ds.backward, ds.step = (after("ForwardPass", ds.forward), after("BackwardPass", ds.backward),
                                            after("OptimizerStep", ds.step))
    with tracker:
        engine.train_step(data)
        for _ in range(2):
            alive.append(collected_live_bytes())
            start = tracker.restart_peak()
            if phases:
                start_of_step[0], measuring[0] = start, True
                tracker.take_mark()
            engine.train_step(data)
            peaks.append(alive[-1] + tracker.peak - start)
    return {"rank": dist.get_rank(), "stage": state.get_pipeline_model_parallel_rank(), "config": config,
            "between_steps": alive[-1], "peak": max(peaks), "phases": phase_peaks}
