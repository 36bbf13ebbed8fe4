import os
import shutil

import pytest

from tests.slurm.cluster import Unavailable, bring_up, tear_down


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real two-node Slurm (nodes n1, n2 in their own network namespaces), up once for all Slurm
    tests. Skips, saying why, where that is impossible: not root, no apt-get to install Slurm,
    no network namespaces."""
    if os.geteuid() != 0:
        pytest.skip(f"the Slurm tests need root (network namespaces, daemons, /etc/hosts); running as uid "
                    f"{os.geteuid()}")
    if not shutil.which("sbatch") and not shutil.which("apt-get"):
        pytest.skip("the Slurm tests need Slurm installed, or apt-get to install slurmctld slurmd slurm-client munge")
    try:
        cluster = bring_up()
    except Unavailable as e:
        pytest.skip(str(e))
    try:
        yield cluster
    finally:
        tear_down()
