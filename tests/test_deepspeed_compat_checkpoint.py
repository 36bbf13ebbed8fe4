"""The checkpoint hooks of deepspeed_compat against the installed DeepSpeed: a test per structure they read
and per thing they set, checked with DeepSpeed's own files and its public getters (deepspeed.utils)."""
import os

import pytest
import torch

from tests.harness import run_distributed
from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config

pytestmark = pytest.mark.slow


def _engine_after_a_step(extra, save=None):
    from megatron_lite.parallel import state
    from megatron_lite.training import checkpointing
    from megatron_lite.training.engine import Engine

    dp = torch.distributed.get_world_size()
    config = tiny_config(1, 1, dp, list(extra) + (["--save", save] if save else []))
    state.initialize(1, 1)
    engine = Engine(config)
    engine.train_step(micro_batches(config, global_batches(config, 1), state.get_data_parallel_rank(), dp))
    if save:
        checkpointing.save(engine, config, 1, 4, checkpointing.SaveFolder(lock=None, run_id="t"))
    return config, engine


def _files_written_and_read(folder):
    """Every file DeepSpeed wrote or read goes through the installed IO, under DeepSpeed's names."""
    from megatron_lite.checkpoint.format import layer_file, model_states_file, zero_optimizer_file
    from megatron_lite.deepspeed_compat import pipeline

    config, engine = _engine_after_a_step(["--zero-stage", "1"])
    written, read = [], []
    io = engine.io
    original_save, original_load = io.save, io.load
    io.save = lambda obj, path: (written.append(os.path.basename(path)), original_save(obj, path))[1]
    io.load = lambda path: (read.append(os.path.basename(path)), original_load(path))[1]
    rank = torch.distributed.get_rank()
    engine.save(folder, "tag")
    torch.distributed.barrier()
    on_disk = sorted(os.listdir(os.path.join(folder, "tag")))
    engine.load(folder, "tag")
    expected = {zero_optimizer_file(rank, 0, 0, 1, False)} | ({model_states_file(0, 0, 1)} |
                                                             {layer_file(s, 0) for s in range(6)} if rank == 0 else set())
    module_files = {f"layer_{s:02d}-model_00-model_states.pt" for s in pipeline.layer_file_modules(
        engine.module)}
    return sorted(written), sorted(expected), on_disk, sorted(set(read)), sorted(module_files)


def test_every_file_deepspeed_writes_and_reads_goes_through_our_io_under_the_names_format_gives(tmp_path):
    results = run_distributed(_files_written_and_read, 2, str(tmp_path))
    for rank, (written, expected, on_disk, read, module_files) in enumerate(results):
        assert written == expected, rank
        assert sorted(set(on_disk) - {"megatron_lite.json"}) == sorted(set(results[0][0]) | set(results[1][0]))
        # DeepSpeed's loader reads this DP rank's partition only
        assert set(module_files) <= set(read) and [f for f in read if "zero_pp_rank" in f] == \
            [f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]


def _partitions_put_together(folder, extra):
    """Each DP rank's partition file, read through partition_fragments, holds this rank's live fragments (as
    DeepSpeed's own fragment mapping places them); joined in DP order they are DeepSpeed's full parameter."""
    from deepspeed.utils import safe_get_full_fp32_param

    from megatron_lite.checkpoint.format import load_file, zero_optimizer_file
    from megatron_lite.deepspeed_compat import checkpoint_files, optimizer_state

    config, engine = _engine_after_a_step(extra, save=folder)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    tag = os.path.join(folder, "iter_0000001")
    bf16 = config.precision.bf16
    parts = [optimizer_state.partition_fragments(load_file(os.path.join(tag, zero_optimizer_file(d, 0, 0, 1, bf16))))
             for d in range(world)]
    optimizer = engine.engine.optimizer
    inner_state = optimizer.optimizer.state
    mismatched = []
    for name, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p)  # DeepSpeed's public getter (a collective over DP)
        joined = torch.cat([part.fragments[name]["fp32"] for part in parts if name in part.fragments])
        if not torch.equal(joined.view_as(full), full):
            mismatched.append(("joined", name))
        mapping = p._hp_mapping
        if mapping is None:
            continue
        mine = parts[rank].fragments[name]
        flat = next(f for f in inner_state if f.numel() >= mapping.hp_fragment_address.start + mine["fp32"].numel()
                    and f.data_ptr() <= mapping.hp_fragment.data_ptr() < f.data_ptr() + f.numel() * f.element_size())
        live = inner_state[flat]["exp_avg"].narrow(0, mapping.hp_fragment_address.start,
                                                   mapping.hp_fragment_address.numel)
        if not (torch.equal(mine["fp32"], mapping.hp_fragment) and torch.equal(mine["exp_avg"], live)):
            mismatched.append(("fragment", name))
    owner = [checkpoint_files.pipeline_parameter_owner(n) for n, _ in engine.module.named_parameters()]
    return mismatched, parts[0].steps, sorted({type(o).__name__ for o, _ in owner})


@pytest.mark.parametrize("extra", [["--zero-stage", "1"], ["--bf16", "--zero-stage", "0"], ["--bf16", "--zero-stage", "1"]],
                         ids=["zero1-fp32", "bf16-optimizer", "zero1-bf16"])
def test_partition_files_read_through_their_slice_mappings_give_deepspeeds_own_fragments(tmp_path, extra):
    for mismatched, steps, owners in run_distributed(_partitions_put_together, 2, str(tmp_path / "ckpt"), extra):
        assert mismatched == [] and set(steps.values()) == {1.0}
        assert owners == ["int", "str"]  # layers by spec index, the tied embedding by its key


def _set_then_read_back(extra):
    """set_optimizer_state, then DeepSpeed's public getters (or the torch optimizer) give back what was set."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from megatron_lite.deepspeed_compat import optimizer_state

    config, engine = _engine_after_a_step(extra)
    generator = torch.Generator().manual_seed(0)
    values = {p: {k: torch.randn(p.shape, generator=generator) for k in ("fp32", "exp_avg", "exp_avg_sq")}
              for _, p in engine.module.named_parameters()}
    optimizer_state.set_optimizer_state(engine.engine, values, 7.0)
    inner = engine.engine.optimizer
    bad = []
    for p, value in values.items():
        if hasattr(p, "_hp_mapping"):
            got = (safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg"),
                   safe_get_full_optimizer_state(p, "exp_avg_sq"))
        else:
            state = inner.state[p]
            got = (p.detach(), state["exp_avg"], state["exp_avg_sq"])
        want = (value["fp32"], value["exp_avg"], value["exp_avg_sq"])
        if not all(torch.equal(g.float(), w) for g, w in zip(got, want)):
            bad.append(tuple(p.shape))
        if not torch.equal(p.detach(), value["fp32"].to(p.dtype)):
            bad.append(("low-precision copy", tuple(p.shape)))
    states = getattr(inner, "optimizer", inner).state.values()
    steps = {float(s["step"]) for s in states}
    optimizer_state.set_step_counters(engine.engine, 7, 28, 1)
    counters = (engine.engine.global_steps, engine.engine.global_samples, optimizer_state.skipped_steps(engine.engine))
    return bad, steps, counters


@pytest.mark.parametrize("extra", [["--zero-stage", "0"], ["--zero-stage", "1"], ["--bf16", "--zero-stage", "0"],
                                   ["--bf16", "--zero-stage", "1"]],
                         ids=["torch-adamw", "zero1-fp32", "bf16-optimizer", "zero1-bf16"])
def test_set_optimizer_state_is_what_deepspeeds_public_getters_read_back(extra):
    for bad, steps, counters in run_distributed(_set_then_read_back, 2, extra):
        assert bad == [] and steps == {7.0} and counters == (7, 28, 1)


def _set_weights_keeps_moments(extra):
    """set_master_weights, then the public getters give the weights set and the moments of before."""
    from deepspeed.utils import safe_get_full_fp32_param

    from megatron_lite.deepspeed_compat import optimizer_state

    config, engine = _engine_after_a_step(extra)
    params = [p for _, p in engine.module.named_parameters()]
    lp = hasattr(params[0], "_hp_mapping")
    inner = engine.engine.optimizer
    states = getattr(inner, "optimizer", inner).state  # the torch optimizer's, over the flat fp32 partitions

    def moments():
        return [t.clone() for state in states.values() for k, t in sorted(state.items()) if k != "step"]
    before = moments()
    generator = torch.Generator().manual_seed(1)
    values = {p: {"fp32": torch.randn(p.shape, generator=generator)} for p in params}
    optimizer_state.set_master_weights(engine.engine, values)
    bad = []
    for p in params:
        master = safe_get_full_fp32_param(p) if lp else p.detach()
        if not torch.equal(master.float(), values[p]["fp32"]) or not torch.equal(p.detach(), values[p]["fp32"].to(p.dtype)):
            bad.append(("weight", tuple(p.shape)))
    after = moments()
    if not before or len(after) != len(before) or not all(torch.equal(a, b) for a, b in zip(after, before)):
        bad.append("moments changed")
    if not any(t.abs().sum() > 0 for t in before):
        bad.append("the step left no moments to keep")
    return bad


@pytest.mark.parametrize("extra", [["--zero-stage", "0"], ["--bf16", "--zero-stage", "1"]],
                         ids=["torch-adamw", "zero1-bf16"])
def test_set_master_weights_sets_weights_and_fp32_masters_and_leaves_the_moments(extra):
    for bad in run_distributed(_set_weights_keeps_moments, 2, extra):
        assert bad == []


def _loss_scaler_round_trip():
    from deepspeed.accelerator import get_accelerator

    from megatron_lite.deepspeed_compat import optimizer_state
    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine

    get_accelerator().is_fp16_supported = lambda: True  # as tests/training/test_fp16_loss_scale.py
    config = tiny_config(1, 1, 1, ("--fp16", "--zero-stage", "1", "--initial-loss-scale", "1024"))
    state.initialize(1, 1)
    engine = Engine(config)
    saved = optimizer_state.loss_scaler_state(engine.optimizer)
    optimizer_state.set_loss_scaler_state(engine.optimizer, dict(saved, cur_scale=256.0, cur_iter=9))
    return saved["cur_scale"], optimizer_state.loss_scale(engine.optimizer), \
        optimizer_state.loss_scaler_state(engine.optimizer)["cur_iter"]


def test_the_fp16_loss_scaler_state_is_read_and_set_by_its_attributes():
    before, after, iterations = run_distributed(_loss_scaler_round_trip, 1)[0]
    assert (before, after, iterations) == (1024.0, 256.0, 9)


def _partitions_cover_each_parameter(extra):
    """optimizer_partitions: each rank's fragments, put together over the partition's group, are every value
    of every parameter of every group exactly once, and each points at the flat buffer's own values."""
    from megatron_lite.deepspeed_compat import optimizer_state

    _, engine = _engine_after_a_step(extra)
    inner = optimizer_state.inner_optimizer(engine.optimizer)
    partitions = optimizer_state.optimizer_partitions(engine.optimizer)
    bad = []
    for index, partition in partitions.items():
        flat = inner.param_groups[index]["params"][0]
        for p in partition.params:
            seen = torch.zeros(p.numel())
            values = torch.zeros(p.numel())
            fragment = partition.fragments.get(id(p))
            if fragment is not None:
                start, count, at = fragment
                seen[start:start + count] += 1
                values[start:start + count] = flat.detach()[at:at + count].float().cpu()
            torch.distributed.all_reduce(seen, group=partition.group)
            torch.distributed.all_reduce(values, group=partition.group)
            if not torch.equal(seen, torch.ones_like(seen)):
                bad.append((index, tuple(p.shape), "coverage"))
            # the fp32 master's values are the parameter's (bf16: to its rounding)
            tolerance = 0 if p.dtype == torch.float32 else 1e-2
            if not torch.allclose(values, p.detach().float().flatten().cpu(), rtol=tolerance, atol=0):
                bad.append((index, tuple(p.shape), "values"))
    return bad, len(partitions)


def test_optimizer_partitions_put_together_over_their_group_are_every_parameter_once():
    """ZeRO 1's DeepSpeedZeroOptimizer; the bf16 optimizer's partitions are Muon's in
    tests/training/test_muon_parallel.py's bf16 run."""
    for bad, groups in run_distributed(_partitions_cover_each_parameter, 2, ["--zero-stage", "1"]):
        assert groups == 2 and not bad, bad
