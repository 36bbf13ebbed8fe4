"""Submit to and watch the two-node test cluster that tests/slurm/cluster.sh starts."""
from __future__ import annotations

import glob
import os
import re
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence

from tests.harness import REPO_ROOT

CLUSTER_SH = os.path.join(REPO_ROOT, "tests", "slurm", "cluster.sh")
SKIP_STATUS = 77  # cluster.sh: not possible on this machine


@dataclass
class Job:
    id: str
    output: str  # the job's output file

    def log(self) -> str:
        try:
            with open(self.output) as f:
                return f.read()
        except FileNotFoundError:
            return ""


class Cluster:
    def __init__(self, slurm_conf: str):
        self.slurm_conf = slurm_conf

    def env(self, **variables: str) -> Dict[str, str]:
        """The environment for client commands and jobs (sbatch passes it on to the job)."""
        env = dict(os.environ, SLURM_CONF=self.slurm_conf, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR",
                   PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.update(variables)
        return env

    def command(self, *args: str, check: bool = True) -> str:
        result = subprocess.run(args, env=self.env(), capture_output=True, text=True, timeout=60)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr}")
        return result.stdout

    def submit(self, script: str, output: str, *sbatch_args: str, script_args: Sequence[str] = (),
               **variables: str) -> Job:
        """sbatch an examples/slurm script from the repository root; variables go in the environment,
        script_args after the script (sweep_tp_pp.sbatch's plan)."""
        result = subprocess.run(["sbatch", "--parsable", "--output", output, *sbatch_args, script, *script_args],
                                cwd=REPO_ROOT,
                                env=self.env(**variables), capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {script} failed: {result.stderr}")
        return Job(result.stdout.strip().split(";")[0], output)

    def job_info(self, job: Job) -> Dict[str, str]:
        text = self.command("scontrol", "show", "job", job.id)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job: Job, timeout: float = 240, until: Optional[Callable[[Dict[str, str]], bool]] = None
             ) -> Dict[str, str]:
        """Poll until the job has left the queue (or `until(info)` holds); its final `scontrol` fields."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job_info(job)
            if until(info) if until else info.get("JobState") not in ("PENDING", "CONFIGURING", "RUNNING",
                                                                      "COMPLETING", "REQUEUED"):
                return info
            time.sleep(0.3)
        self.command("scancel", job.id, check=False)
        raise TimeoutError(f"job {job.id} still {self.job_info(job).get('JobState')} after {timeout:.0f}s:\n"
                           f"{job.log()[-3000:]}")

    def daemon_logs(self, lines: int = 30) -> str:
        """The end of slurmctld's and each slurmd's log, for a failure message: `cluster.sh down`
        removes them with the cluster."""
        parts = []
        for path in sorted(glob.glob(os.path.join(os.path.dirname(self.slurm_conf), "log", "*.log"))):
            with open(path) as f:
                parts.append(f"\n--- {path}\n" + "".join(f.readlines()[-lines:]))
        return "".join(parts)

    def wait_for_output(self, job: Job, pattern: str, timeout: float = 240) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, job.log())
            if match:
                return match
            if self.job_info(job).get("JobState") not in ("PENDING", "CONFIGURING", "RUNNING"):
                break
            time.sleep(0.2)
        raise AssertionError(f"job {job.id}: no {pattern!r} in its output:\n{job.log()[-3000:]}")


def bring_up() -> Cluster:
    """Start the cluster; raises Unavailable with cluster.sh's reason where it cannot run here."""
    result = subprocess.run(["bash", CLUSTER_SH, "up"], capture_output=True, text=True, timeout=900)
    if result.returncode == SKIP_STATUS:
        raise Unavailable(result.stderr.strip().splitlines()[-1])
    if result.returncode != 0:
        raise RuntimeError(f"tests/slurm/cluster.sh up failed ({result.returncode}):\n{result.stderr}")
    conf = re.search(r"^SLURM_CONF=(.+)$", result.stdout, re.M)
    return Cluster(conf.group(1))


def tear_down() -> None:
    subprocess.run(["bash", CLUSTER_SH, "down"], capture_output=True, text=True, timeout=120)


class Unavailable(Exception):
    pass
