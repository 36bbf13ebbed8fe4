import pytest

from tests.harness import run_distributed


def _groups_and_sums(tp, pp):
    import torch
    import torch.distributed as dist

    from megatron_lite.parallel import state

    state.initialize(tp, pp)
    topo = state.get_topology()
    rank = dist.get_rank()
    sums = {}
    for name, group in (("tp", state.get_tensor_model_parallel_group()), ("dp", state.get_data_parallel_group()),
                        ("pp", state.get_pipeline_model_parallel_group()), ("model", state.get_model_parallel_group())):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        sums[name] = t.item()
    return {
        "tp": state.get_tensor_model_parallel_ranks(), "dp": state.get_data_parallel_ranks(),
        "pp": state.get_pipeline_model_parallel_ranks(), "model": state.get_model_parallel_ranks(),
        "sums": sums, "coord": topo.get_coord(rank)._asdict(),
        "sizes": (state.get_tensor_model_parallel_world_size(), state.get_pipeline_model_parallel_world_size(),
                  state.get_data_parallel_world_size()),
        "ranks": (state.get_tensor_model_parallel_rank(), state.get_pipeline_model_parallel_rank(),
                  state.get_data_parallel_rank()),
        "expected_comm": {axis: topo.get_axis_comm_lists(axis) for axis in ("model", "data", "pipe")},
    }


@pytest.mark.parametrize("tp, pp, dp", [(2, 1, 2)] + [  # world 8 in the full suite only (not in --fast)
    pytest.param(*layout, marks=pytest.mark.slow) for layout in [(2, 2, 2), (4, 2, 1), (1, 1, 8)]])
def test_groups_match_deepspeed_topology_and_all_reduce_sums(tp, pp, dp):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    world = tp * pp * dp
    results = run_distributed(_groups_and_sums, world, tp, pp)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)

    def members(axis, rank):
        return next(m for m in topo.get_axis_comm_lists(axis) if rank in m)

    for rank, r in enumerate(results):
        assert r["tp"] == members("model", rank)
        assert r["dp"] == members("data", rank)
        assert r["pp"] == members("pipe", rank)
        coord = topo.get_coord(rank)
        assert r["model"] == topo.filter_match(data=coord.data)
        assert r["sizes"] == (tp, pp, dp)
        assert r["ranks"] == (coord.model, coord.pipe, coord.data)
        for name, group_members in (("tp", r["tp"]), ("dp", r["dp"]), ("pp", r["pp"]), ("model", r["model"])):
            assert r["sums"][name] == sum(group_members), (rank, name)
    # Rank order pipe, data, model: TP ranks adjacent, PP outermost.
    assert results[0]["tp"] == list(range(tp))
    assert results[0]["pp"] == [s * tp * dp for s in range(pp)]
