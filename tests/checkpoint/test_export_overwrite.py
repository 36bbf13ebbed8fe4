"""export-hf --overwrite over an earlier export replaces it, whole (issue 61: it always failed, rmdir of a full
folder: "Directory not empty")."""
import json
import os

import pytest

from tests.checkpoint.conftest import run_tool

pytestmark = pytest.mark.slow


def test_export_hf_with_overwrite_replaces_an_earlier_export_whole(zero1_run, tmp_path):
    out = tmp_path / "hf"
    first = run_tool("tools/convert_checkpoint.py", "export-hf", "--load", zero1_run, "--output", str(out),
                     check=False)
    assert first.returncode == 0, first.stderr[-2000:]
    (out / "left_by_the_user.txt").write_text("from before")
    again = run_tool("tools/convert_checkpoint.py", "export-hf", "--load", zero1_run, "--output", str(out),
                     "--dtype", "bfloat16", "--overwrite", check=False)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "left_by_the_user.txt" not in os.listdir(out)  # the new export, nothing of the old
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert not [p for p in os.listdir(tmp_path) if p != "hf"]  # no temporary or set-aside folder left
