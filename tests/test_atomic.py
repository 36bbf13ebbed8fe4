"""The one atomic writer: content appears whole under its final name or not at all, and a failure names the path."""
import os
import subprocess
import sys

import pytest
import torch

from megatron_lite.atomic import (
    WriteError,
    atomic_file,
    atomic_folder,
    remove_stale_temporaries,
    save_torch,
    temporary_name,
    write_text,
)
from tests.tmpfs import listing, small_tmpfs


def test_a_file_appears_only_when_its_block_ends_and_an_exception_leaves_the_old_content(tmp_path):
    path = tmp_path / "out.txt"
    write_text(str(path), "old")
    with pytest.raises(ValueError):
        with atomic_file(str(path), "w") as f:
            f.write("new, half")
            assert path.read_text() == "old"
            raise ValueError("caller failed")
    assert path.read_text() == "old" and listing(tmp_path) == ["out.txt"]
    write_text(str(path), "new")
    assert path.read_text() == "new" and listing(tmp_path) == ["out.txt"]


def test_temporary_names_are_hidden_siblings_unique_per_call(tmp_path):
    names = {temporary_name(str(tmp_path / "x.bin")) for _ in range(50)}
    assert len(names) == 50
    for name in names:
        assert os.path.dirname(name) == str(tmp_path) and os.path.basename(name).startswith(".x.bin.tmp-")
        assert f"-{os.getpid()}-" in os.path.basename(name)


def test_temporaries_of_dead_processes_are_removed_and_those_of_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    live = temporary_name(str(tmp_path / "ckpt"))  # this process: alive
    stale = live.replace(f"-{os.getpid()}-", f"-{dead_pid}-")
    os.makedirs(stale)
    (tmp_path / os.path.basename(stale) / "big.pt").write_bytes(b"x" * 1000)
    open(live, "w").close()
    other_target = temporary_name(str(tmp_path / "other")).replace(f"-{os.getpid()}-", f"-{dead_pid}-")
    open(other_target, "w").close()
    removed = remove_stale_temporaries(str(tmp_path / "ckpt"))
    assert removed == [stale]
    assert sorted(listing(tmp_path)) == sorted([os.path.basename(live), os.path.basename(other_target)])


def test_a_folder_appears_whole_and_a_failure_inside_removes_it(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_folder(str(target)) as tmp:
            open(os.path.join(tmp, "a"), "w").close()
            raise RuntimeError("stop")
    assert listing(tmp_path) == []
    with atomic_folder(str(target)) as tmp:
        open(os.path.join(tmp, "a"), "w").close()
        assert not target.exists()
    assert listing(tmp_path) == ["out", "out/a"]


def test_a_full_disk_is_one_write_error_naming_the_final_path_and_leaves_nothing(tmp_path):
    with small_tmpfs(tmp_path / "small", 64 * 1024) as small:
        path = os.path.join(small, "model.pt")
        with pytest.raises(WriteError) as info:
            save_torch({"w": torch.zeros(64 * 1024)}, path)
        assert str(info.value) == f"cannot write {path}: No space left on device"
        with pytest.raises(WriteError) as info:
            with atomic_file(os.path.join(small, "a.bin")) as f:
                f.write(b"\0" * (128 * 1024))
        assert "a.bin: No space left on device" in str(info.value)
        with pytest.raises(WriteError) as info:
            with atomic_folder(os.path.join(small, "ckpt")) as tmp:
                with open(os.path.join(tmp, "layer.pt"), "wb") as f:
                    f.write(b"\0" * (128 * 1024))
        assert str(info.value) == f"cannot write {os.path.join(small, 'ckpt')}: No space left on device"
        assert listing(small) == []


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2 exchange", "rename aside"])
def test_replacing_a_folder_publishes_the_new_one_whole_and_a_failure_leaves_the_old_one(tmp_path, monkeypatch,
                                                                                          exchange):
    import megatron_lite.atomic as atomic

    if not exchange:  # a system without renameat2: the previous folder is renamed aside first
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("previous")
    with pytest.raises(RuntimeError):
        with atomic_folder(str(out), replace=True) as tmp:
            with open(os.path.join(tmp, "new"), "w") as f:
                f.write("half")
            raise RuntimeError("killed mid-write")
    assert sorted(os.listdir(out)) == ["old"] and sorted(os.listdir(tmp_path)) == ["out"]
    with atomic_folder(str(out), replace=True) as tmp:
        with open(os.path.join(tmp, "new"), "w") as f:
            f.write("whole")
    assert sorted(os.listdir(out)) == ["new"] and (out / "new").read_text() == "whole"
    assert sorted(os.listdir(tmp_path)) == ["out"]  # neither the temporary nor the previous folder is left
