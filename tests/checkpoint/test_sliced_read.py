"""Reading one TP rank's slices out of memory-mapped checkpoint files: the slices are parallel/layers.py's
for any source and target TP, and a rank copies the bytes it keeps, not the tensors it does not."""
import itertools
import math

import pytest
import torch

from megatron_lite.checkpoint import sliced, slicing
from megatron_lite.checkpoint.format import load_file
from megatron_lite.checkpoint.vocab import resize_rows
from tests.harness import run_distributed
from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config

CASES = [((24, 6), 0, ()), ((24,), 0, ()), ((6, 24), 1, ()), ((48, 4), 0, (24, 12, 12)), ((32, 4), 0, (16, 16)),
         ((5, 5), -1, ())]


def _mapped_flats(tmp_path, full, source_tp, dim, sections, fragments):
    """Every source TP rank's slice saved, then memory-mapped as a DP-fragmented (or whole) flat piece."""
    path = tmp_path / f"slices-{source_tp}-{fragments}.pt"
    torch.save({r: t.reshape(-1) for r, t in enumerate(slicing.split(full, source_tp, dim, sections))}, path)
    mapped = load_file(str(path), mmap=True)
    flats = []
    for r in range(source_tp):
        f = mapped[r]
        cuts = [0, f.numel() // 3, f.numel() // 2, f.numel()] if fragments else [0, f.numel()]
        flats.append(sliced.Flat([f[a:b] for a, b in zip(cuts, cuts[1:])], mapped=True))
    return flats


@pytest.mark.parametrize("shape, dim, sections", CASES, ids=[f"{s}-dim{d}-{len(c)}sections" for s, d, c in CASES])
def test_every_target_ranks_slice_from_mapped_pieces_is_the_one_parallel_layers_cut(tmp_path, shape, dim, sections):
    full = torch.randn(shape)
    full_sections = sections or ((shape[dim],) if dim >= 0 else ())
    for source_tp, tp, fragments in itertools.product((1, 2, 4), (1, 2, 4), (False, True)):
        if dim < 0 and source_tp > 1:
            continue
        flats = _mapped_flats(tmp_path, full, source_tp, dim, full_sections, fragments)
        for rank in range(tp):
            want = slicing.piece(full, tp, rank, dim, full_sections)
            for _ in range(2):  # read again after its pages were given back: the file is read anew
                assert torch.equal(sliced.rank_slice(shape, dim, sections, flats, tp, rank), want)


def test_vocabulary_rows_are_dropped_or_zero_padded_for_the_targets_padding(tmp_path):
    full = torch.randn(20, 3)
    for source_tp, tp, rows in ((1, 2, 24), (2, 4, 16), (4, 2, 28), (2, 1, 20)):
        flats = _mapped_flats(tmp_path, full, source_tp, 0, (20,), fragments=True)
        for rank in range(tp):
            want = slicing.piece(resize_rows(full, rows), tp, rank, 0, (rows,))
            assert torch.equal(sliced.rank_slice((20, 3), 0, (), flats, tp, rank, rows), want)


def _save_zero1_dp2(root):
    from megatron_lite.parallel import state
    from megatron_lite.training import checkpointing
    from megatron_lite.training.engine import Engine

    config = tiny_config(1, 1, 2, ["--zero-stage", "1", "--train-iters", "1", "--save", root])
    state.initialize(1, 1)
    engine = Engine(config)
    engine.train_step(micro_batches(config, global_batches(config, 1), state.get_data_parallel_rank(), 2))
    checkpointing.save(engine, config, 1, 4, checkpointing.SaveFolder(lock=None, run_id="t"))


def test_a_rank_at_tp4_copies_only_its_slices_out_of_a_tp1_zero1_checkpoint(tmp_path, monkeypatch):
    """Counted through the reader's two copy paths: each rank of TP 4 copies its quarter of every split
    tensor's fp32 master and moments and the replicated ones whole; reading a full tensor and cutting it
    would copy four times as much of the split ones."""
    import os

    from megatron_lite.checkpoint.format import read_metadata
    from megatron_lite.checkpoint.layout_free import LayoutFreeReader

    run_distributed(_save_zero1_dp2, 2, str(tmp_path))
    copied = []
    for name in ("read", "read_columns"):
        original = getattr(sliced.Flat, name)

        def counting(self, *args, _original=original):
            out = _original(self, *args)
            copied.append(out.numel() * out.element_size())
            return out
        monkeypatch.setattr(sliced.Flat, name, counting)
    reader = LayoutFreeReader(os.path.join(tmp_path, "iter_0000001"), read_metadata(str(tmp_path), "iter_0000001"))
    params = [p for infos in reader.layout.params.values() for p in infos]
    split = sum(math.prod(p.shape) for p in params if p.partition_dim >= 0)
    replicated = sum(math.prod(p.shape) for p in params if p.partition_dim < 0)
    for rank in range(4):
        copied.clear()
        states = reader.read(tp=4, rank=rank)
        assert sum(copied) == 3 * 4 * (split // 4 + replicated)  # fp32, exp_avg, exp_avg_sq
        full = reader.read()
        for key, info in ((k, reader.info(k)) for k in states):
            sections = info.partition_sections or ((info.shape[info.partition_dim],) if info.partition_dim >= 0 else ())
            assert torch.equal(states[key].exp_avg, slicing.piece(full[key].exp_avg, 4, rank, info.partition_dim,
                                                                  sections)), key
