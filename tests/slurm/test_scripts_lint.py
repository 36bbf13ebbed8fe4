"""Every Slurm script parses (bash -n) and, where shellcheck is installed, is shellcheck-clean."""
import glob
import os
import shutil
import subprocess

import pytest

from tests.harness import REPO_ROOT

SCRIPTS = sorted(glob.glob(os.path.join(REPO_ROOT, "examples", "slurm", "*.sbatch"))
                 + glob.glob(os.path.join(REPO_ROOT, "examples", "slurm", "*.sh"))
                 + glob.glob(os.path.join(REPO_ROOT, "tests", "slurm", "*.sh")))


def test_the_slurm_scripts_are_all_found():
    names = {os.path.relpath(p, REPO_ROOT) for p in SCRIPTS}
    assert {"examples/slurm/pretrain_gpt.sbatch", "examples/slurm/pretrain_gpt_srun.sbatch",
            "examples/slurm/sweep_tp_pp.sbatch", "examples/slurm/lib.sh", "tests/slurm/cluster.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: os.path.relpath(p, REPO_ROOT))
def test_script_parses(script):
    result = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def shellcheck():
    """shellcheck, installed from the distribution where we may (root with apt-get), as the Slurm
    cluster's packages are; otherwise the lint is skipped with the reason."""
    if shutil.which("shellcheck") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "shellcheck"]
        if subprocess.run(install, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
            subprocess.run(install, env=env, capture_output=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed and cannot be here (needs root and apt-get: apt-get install shellcheck)")
    return shutil.which("shellcheck")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: os.path.relpath(p, REPO_ROOT))
def test_script_is_shellcheck_clean(script, shellcheck):
    # -x follows `source` lines; the scripts name lib.sh relative to the repository root
    result = subprocess.run([shellcheck, "-x", "--shell=bash", os.path.relpath(script, REPO_ROOT)], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
