import time

import pytest

from tests.harness import DistributedTestError, run_distributed, run_launcher


def _rank_and_world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _fails_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    return "ok"


def _rank_zero_waits_forever_in_a_collective():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    return "returned"


def test_run_distributed_returns_results_in_rank_order():
    assert run_distributed(_rank_and_world, 2) == [(0, 2), (1, 2)]


def test_a_failing_rank_reports_its_traceback():
    with pytest.raises(DistributedTestError, match=r"(?s)--- rank 1 ---.*ValueError: rank one is broken"):
        run_distributed(_fails_on_rank_one, 2)
    # the pool is rebuilt after a failure
    assert run_distributed(_rank_and_world, 2) == [(0, 2), (1, 2)]


@pytest.mark.slow
def test_a_hang_fails_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"ranks \[0\] did not finish within 5s"):
        run_distributed(_rank_zero_waits_forever_in_a_collective, 2, timeout=5)
    assert time.monotonic() - start < 30


def test_run_launcher_starts_a_script_under_torch_distributed_run(tmp_path):
    script = tmp_path / "show_rank.py"
    # One os.write per line: print() writes its arguments piece by piece, so two ranks sharing the
    # launcher's stdout could interleave them ("rankrank 0 of 2 ...", seen once in CI).
    script.write_text("import os\nos.write(1, f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} "
                      "local {os.environ['LOCAL_RANK']}\\n\".encode())\n")
    result = run_launcher([str(script)], nproc=2, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "rank 0 of 2 local 0" in result.stdout and "rank 1 of 2 local 1" in result.stdout


def _creates_a_group_and_counts_groups():
    import os

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    dist.new_group([0, 1])
    return os.getpid(), len(distributed_c10d._world.pg_map)


def test_a_task_starts_with_only_the_default_group_left_by_the_one_before():
    first = run_distributed(_creates_a_group_and_counts_groups, 2)
    second = run_distributed(_creates_a_group_and_counts_groups, 2)
    assert [pid for pid, _ in first] == [pid for pid, _ in second]  # the same workers
    assert [groups for _, groups in second] == [2, 2]  # the default group and the task's own


def test_a_pool_whose_workers_gathered_too_many_threads_is_replaced(monkeypatch):
    import tests.harness as harness

    monkeypatch.setattr(harness, "MAX_WORKER_THREADS", 0)
    first = run_distributed(_creates_a_group_and_counts_groups, 2)
    second = run_distributed(_creates_a_group_and_counts_groups, 2)
    assert not {pid for pid, _ in first} & {pid for pid, _ in second}
