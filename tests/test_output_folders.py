"""Every folder a training run writes is checked before any process group exists: one line naming the flag, exit 2,
nothing written."""
import os
import re

import numpy as np
import pytest

from megatron_lite.config import Config, ConfigError
from megatron_lite.validation.outputs import check_output_folders
from tests.test_pretrain_gpt_cli import _launch
from tests.tmpfs import listing, remount_read_only, small_tmpfs

FLAGS = {"save": ("training__save", "--save"), "tensorboard_dir": ("logging__tensorboard_dir", "--tensorboard-dir"),
         "data_cache_path": ("data__data_cache_path", "--data-cache-path")}


def _check(name, path):
    field, _ = FLAGS[name]
    check_output_folders(Config().replace(**{field: str(path)}))


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "runs"
    path.write_text("not a folder")
    return path


@pytest.mark.parametrize("name", FLAGS)
def test_an_output_folder_that_is_a_file_is_refused_naming_the_flag(name, a_file, tmp_path):
    flag = FLAGS[name][1]
    with pytest.raises(ConfigError, match=rf"^{flag} {re.escape(str(a_file))} is a file; give a folder \(it is "
                                          rf"created if missing\)$"):
        _check(name, a_file)
    assert listing(tmp_path) == ["runs"]


@pytest.mark.parametrize("name", FLAGS)
def test_an_output_folder_under_a_file_is_refused_naming_the_file(name, a_file, tmp_path):
    flag, path = FLAGS[name][1], a_file / "x" / "y"
    with pytest.raises(ConfigError, match=rf"^{flag} {re.escape(str(path))} cannot be created: "
                                          rf"{re.escape(str(a_file))} is a file; give a path whose parents are folders$"):
        _check(name, path)
    assert listing(tmp_path) == ["runs"]


@pytest.mark.parametrize("name", FLAGS)
def test_a_missing_output_folder_under_a_writable_one_is_accepted_and_not_created_yet(name, tmp_path):
    _check(name, tmp_path / "new" / "folder")
    assert listing(tmp_path) == []


def test_folders_on_a_read_only_file_system_are_refused_but_a_read_only_index_cache_is_read(tmp_path):
    with small_tmpfs(tmp_path / "disk", 64 * 1024) as disk:
        os.makedirs(os.path.join(disk, "existing"))
        remount_read_only(disk)
        for name, (_, flag) in FLAGS.items():
            missing = os.path.join(disk, "missing")
            with pytest.raises(ConfigError, match=rf"^{flag} {re.escape(missing)} cannot be created: "
                                                  rf"{re.escape(disk)} is not writable \(Read-only file system\)"):
                _check(name, missing)
            existing = os.path.join(disk, "existing")
            if name == "data_cache_path":
                _check(name, existing)  # indices built beforehand are read from there
                continue
            with pytest.raises(ConfigError, match=rf"^{flag} {re.escape(existing)} is not writable \(Read-only file "
                                                  rf"system\); give a folder this user can write$"):
                _check(name, existing)


def test_pretrain_refuses_a_tensorboard_dir_that_is_a_file_before_any_rendezvous_and_writes_nothing(tmp_path):
    from megatron_lite.data.indexed_dataset import IndexedDatasetWriter
    from tests.harness import free_port

    prefix = str(tmp_path / "data" / "tiny_text_document")
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_document(list(range(60)))
    tensorboard = tmp_path / "runs"
    tensorboard.write_text("")
    before = listing(tmp_path)
    # Rank 0 of 2 alone: anything that waits for the other rank (the rendezvous, a collective) would hang.
    proc = _launch(["--data-path", prefix, "--vocab-size", "100", "--split", "1,0,0", "--train-iters", "1",
                    "--save", str(tmp_path / "ckpt"), "--tensorboard-dir", str(tensorboard)],
                   WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 2 and "Traceback" not in out, out
    assert [line for line in out.splitlines() if "error" in line] == [
        f"pretrain_gpt.py: error: --tensorboard-dir {tensorboard} is a file; give a folder (it is created if missing)"], out
    assert listing(tmp_path) == before, "nothing written: no --save folder, no index cache"
