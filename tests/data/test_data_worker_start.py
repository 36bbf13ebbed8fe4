"""DataLoader workers start in a trainer that already runs threads, and receive the dataset by name, not by value.

A worker made by fork() inherits every lock as it was at the fork; one that another thread of the trainer
held then stays locked in the worker forever (issue 29: a rank waited for its first batch until killed).
"""
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import psutil
import pytest

from megatron_lite.data.gpt_dataset import build_train_valid_test_datasets
from megatron_lite.data.sampler import build_data_iterator
from tests.data.synthetic import write_positional_dataset
from tests.harness import REPO_ROOT

FIRST_BATCH_TIMEOUT = 60  # seconds; a spawned worker needs about 1-3 (it imports torch)

# Taken by every item, as a library's internal lock (allocator, logging, gloo) is taken by code a worker runs.
LOCK = threading.Lock()


class LockedDataset:
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        with LOCK:
            return {"tokens": np.array([index]), "position_ids": np.array([0]), "labels": np.array([index]),
                    "loss_mask": np.array([1.0], dtype=np.float32)}


HELD_LOCK_SCRIPT = textwrap.dedent("""
    import threading
    from megatron_lite.data.sampler import build_data_iterator
    from tests.data.test_data_worker_start import LOCK, LockedDataset

    held, done = threading.Event(), threading.Event()

    def hold_the_lock():
        with LOCK:
            held.set()
            done.wait()

    threading.Thread(target=hold_the_lock, daemon=True).start()
    held.wait()
    it = build_data_iterator(LockedDataset(), 0, 2, 0, 1, num_workers=1)  # the workers start while it is held
    done.set()
    print("workers", *[w.pid for w in it._workers], flush=True)
    print("first", int(next(it)[0][0][0, 0]), flush=True)
""")


def test_a_worker_gets_its_first_batch_although_another_trainer_thread_held_a_lock_while_it_started():
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", HELD_LOCK_SCRIPT], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=FIRST_BATCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its workers: its session is theirs
        out, _ = proc.communicate()
        pytest.fail(f"no first batch within {FIRST_BATCH_TIMEOUT}s: the worker inherited the lock held by another "
                    f"thread of its trainer, locked for good\n{out}")
    assert proc.returncode == 0 and "first 0" in out, out
    workers = [int(pid) for pid in out.split("workers", 1)[1].split("\n", 1)[0].split()]
    assert workers and not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                               for pid in workers), "a worker outlived its trainer"


@pytest.fixture
def datasets(tmp_path):
    """(a single-prefix GPTDataset, a blend of two): train splits of real .bin/.idx files."""
    a = write_positional_dataset(tmp_path / "a_text_document", num_documents=2000, seed=1).prefix
    b = write_positional_dataset(tmp_path / "b_text_document", num_documents=2000, seed=2, offset=10 ** 6).prefix
    common = dict(split=(100, 0, 0), seq_length=16, num_samples=(3000, 0, 0), seed=1234,
                  cache_path=str(tmp_path / "cache"), eod_token=-1, eod_mask_loss=False)
    single = build_train_valid_test_datasets(((1.0, a),), **common)[0]
    blend = build_train_valid_test_datasets(((0.3, a), (0.7, b)), **common)[0]
    return single, blend


def test_a_pickled_dataset_names_its_files_and_yields_the_same_samples(datasets):
    single, blend = datasets
    for dataset in (single, blend, single.indexed):
        data = pickle.dumps(dataset)
        # the .bin alone is 240 KB per prefix, each index array of 3000 samples 12-48 KB
        assert len(data) < 4096, f"{type(dataset).__name__} pickles to {len(data)} bytes"
        copy = pickle.loads(data)
        assert len(copy) == len(dataset)
        for i in range(len(dataset)):
            expected, got = dataset[i], copy[i]
            if isinstance(expected, dict):
                assert all(np.array_equal(expected[k], got[k]) for k in expected), i
            else:
                assert np.array_equal(expected, got), i
    assert isinstance(pickle.loads(pickle.dumps(single)).shuffle_index, np.memmap)


def test_workers_yield_the_micro_batches_of_the_trainer_itself(datasets):
    for dataset in datasets:
        expected = [batch[0][0] for batch in build_data_iterator(dataset, 30, 4, 1, 2, num_workers=0)]
        it = build_data_iterator(dataset, 30, 4, 1, 2, num_workers=2)
        try:
            got = [next(it)[0][0] for _ in expected]
        finally:
            it._shutdown_workers()
        assert len(expected) == (len(dataset) - 30) // 8
        assert all(np.array_equal(e.numpy(), g.numpy()) for e, g in zip(expected, got))
