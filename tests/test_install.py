"""The install a new user runs: a fresh virtual environment, the commands of README.md's Install section.

One session-scoped venv (the C++ build takes most of its ~2.5 minutes on 2 cores); the checkout is copied
first so the build writes nothing into this one.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.harness import REPO_ROOT

pytestmark = pytest.mark.slow


def readme_install_commands() -> str:
    """The bash block under README.md's `## Install` heading."""
    text = open(os.path.join(REPO_ROOT, "README.md")).read()
    section = text.split("\n## Install\n", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def _checkout_files():
    """Tracked and new (not ignored) files when this is a git checkout, else the tree without build outputs."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT, capture_output=True, check=True)
        return [f for f in out.stdout.decode().split("\0") if f and os.path.exists(os.path.join(REPO_ROOT, f))]
    except (OSError, subprocess.CalledProcessError):
        skip = {"build", "dist", ".git", "__pycache__", ".pytest_cache", "quickstart", "cache"}
        files = []
        for root, dirs, names in os.walk(REPO_ROOT):
            dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
            files += [os.path.relpath(os.path.join(root, n), REPO_ROOT) for n in names if not n.endswith(".so")]
        return files


@pytest.fixture(scope="session")
def fresh_install(tmp_path_factory):
    """(checkout copy, its venv's python) after running the README's commands in the copy."""
    src = tmp_path_factory.mktemp("install") / "megatron_lite"
    for rel in _checkout_files():
        os.makedirs(src / os.path.dirname(rel), exist_ok=True)
        shutil.copy2(os.path.join(REPO_ROOT, rel), src / rel)
    # `python3` in the README is this interpreter; pip may use its wheel cache, never the installed package.
    # No bytecode compiled at install time (PIP_NO_COMPILE=0 is --no-compile: pip reads a store_false flag's
    # variable inverted, pypa/pip#5735): compiling all of torch and DeepSpeed cost ~12 CPU-seconds, and the
    # imports below compile what they use.
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
               PIP_NO_COMPILE="0")
    env.pop("PYTHONPATH", None)
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", readme_install_commands()], cwd=src, env=env,
                            capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return src, str(src / "v" / "bin" / "python")


def test_readme_install_in_a_fresh_venv_builds_the_kernels_and_imports_this_checkout(fresh_install):
    src, python = fresh_install
    probe = ("import torch, megatron_lite, megatron_lite._C; print(megatron_lite.__file__); "
             "x = torch.randn(1, 2, 4, 4); "
             "y = torch.ops.megatron_lite.scaled_masked_softmax_forward(x, None, 1.0, True); "
             "print(torch.allclose(y, torch.softmax(x.masked_fill(torch.ones(4, 4).triu(1).bool(), -1e4), -1)))")
    result = subprocess.run([python, "-c", probe], cwd="/", capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    path, matches = result.stdout.split()
    assert path == str(src / "megatron_lite" / "__init__.py") and matches == "True"


def test_pretrain_help_runs_in_the_fresh_venv(fresh_install):
    src, python = fresh_install
    result = subprocess.run([python, "pretrain_gpt.py", "--help"], cwd=src, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "--pipeline-partition-method" in result.stdout, result.stderr
