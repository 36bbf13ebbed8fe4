import pytest

from megatron_lite.training.distributed import environment_from_launcher, first_host

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
               "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


@pytest.fixture
def clean_env(monkeypatch):
    import os

    saved = dict(os.environ)  # environment_from_launcher writes os.environ itself
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the node list is parsed here
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("nodelist, host", [("node7", "node7"), ("gpu[003-010,12]", "gpu003"),
                                            ("a[1,3],b[2-4]", "a1"), ("x1,x2", "x1"), ("n[08-09]", "n08")])
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_plain_srun_environment_is_mapped_for_torch_and_deepspeed(clean_env):
    import os

    clean_env.setenv("SLURM_PROCID", "5")
    clean_env.setenv("SLURM_NTASKS", "8")
    clean_env.setenv("SLURM_LOCALID", "1")
    clean_env.setenv("SLURM_JOB_ID", "123456")
    clean_env.setenv("SLURM_JOB_NODELIST", "gpu[003-006]")
    environment_from_launcher()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("5", "8", "1")
    assert os.environ["MASTER_ADDR"] == "gpu003"
    assert os.environ["MASTER_PORT"] == str(29500 + 123456 % 1000)


def test_torchrun_environment_is_left_alone(clean_env):
    import os

    for name, value in (("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "3"), ("MASTER_ADDR", "10.0.0.1"),
                        ("MASTER_PORT", "1234"), ("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")):
        clean_env.setenv(name, value)
    environment_from_launcher()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("3", "4", "10.0.0.1")


def test_a_bare_python_process_is_a_world_of_one(clean_env):
    import os

    environment_from_launcher()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("0", "1", "0")
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and int(os.environ["MASTER_PORT"]) > 0
