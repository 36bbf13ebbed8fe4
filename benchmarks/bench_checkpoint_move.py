"""Checkpoints of a ~100M-parameter GPT: the save's stall on training (synchronous and --async-save), its write
rate against the disk's, and the time and peak memory of each layout move, against measurements of the same
run (a plain read of the files, `dd` writing as many bytes).

The checkpoint: bf16, ZeRO 1, saved by two processes (DP 2) after one step, so it holds the DP-partitioned
fp32 masters and Adam moments a GPU run writes.

Saving: two processes train STEPS steps (DP 2) saving every INTERVAL steps, with no save, synchronous saves
and --async-save (none at the last step, so each async save's writer runs during the steps after it, as in
a long run), in interleaved rounds; a mode's stall per save is its extra wall time over the round's no-save
run, per save. The write rate is the checkpoint's bytes
over the synchronous save's time, next to `dd ... conv=fsync` of as many bytes into the same folder and a
plain write() + fsync of as many bytes from one tensor in memory.

Moves (each its own process(es), timed from start to end, with peak RSS; a --load also its load() seconds and
every rank's RSS growth inside load()):

  read        torch.load(weights_only=True) of every file of the checkpoint: the I/O and unpickling floor
  native      --load at the saved layout (DP 2, DeepSpeed's own loader)
  dp1         --load at DP 1 (the layout-free path: one rank reads every slice)
  tp4         --load at TP 4 (four ranks, each reading only its slices)
  universal   convert_checkpoint.py universal (the layout-free form on disk)
  reshard     convert_checkpoint.py reshard to TP 2 x PP 2 (fp32 layer files and AdamW states)

    python benchmarks/bench_checkpoint_move.py                   # 12 layers, hidden 768, vocabulary 32000 (~110M)
    python benchmarks/bench_checkpoint_move.py --num-layers 2 --rounds 1    # a quick check
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def model_flags(args) -> list:
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads",
            str(args.hidden_size // 64), "--seq-length", "128", "--vocab-size", str(args.vocab_size),
            "--micro-batch-size", "1", "--global-batch-size", "2", "--hidden-dropout", "0", "--attention-dropout",
            "0", "--bf16", "--zero-stage", "1", "--train-iters", "2", "--lr", "1e-4", "--seed", "3"]


def _rss_sampler():
    """(stop(), peak) : a thread sampling this process's RSS every 5 ms."""
    import threading

    import psutil

    process, peak, done = psutil.Process(), [psutil.Process().memory_info().rss], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.005)
    thread = threading.Thread(target=sample)
    thread.start()

    def stop():
        done.set()
        thread.join()
        return max(peak[0], process.memory_info().rss)
    return stop


def worker(rank: int, world: int, port: int, flags: list, save: str, load: str, out: str, tp: int = 1,
           train: dict = None) -> None:
    """One rank: build the engine; optionally load (timed, with the RSS growth of the load); optionally train
    a step and save; or (`train`) time STEPS steps with saves every INTERVAL (mode none / sync / async)."""
    import psutil
    import torch
    import torch.distributed as dist

    from megatron_lite.arguments import parse_args
    from megatron_lite.parallel import state
    from megatron_lite.training import checkpointing
    from megatron_lite.training.async_save import AsyncWriter
    from megatron_lite.training.engine import Engine
    from tools.bench_training import join_gloo_world

    join_gloo_world(rank, world, port)
    mode = (train or {}).get("mode")
    extra = ["--tensor-model-parallel-size", str(tp)] + (["--async-save"] if mode == "async" else [])
    config, _ = parse_args(flags + extra + (["--save", save] if save else []) + (["--load", load] if load else []),
                           world_size=world)
    state.initialize(tp, 1)
    engine = Engine(config)
    seq = config.model.seq_length
    tokens = torch.randint(0, config.model.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(rank))
    micro = [((tokens[:, :-1], torch.arange(seq)[None]), (tokens[:, 1:], torch.ones(1, seq)))]
    result = {}
    if load:
        before = psutil.Process().memory_info().rss
        stop = _rss_sampler()
        start = time.perf_counter()
        resumed = checkpointing.load(engine, config)
        result.update(load_seconds=time.perf_counter() - start, iteration=resumed.iteration, note=resumed.note)
        result.update(load_rss_increase=stop() - before, rss_before_load=before)
    if train:
        folder = checkpointing.SaveFolder(lock=None, run_id=f"bench-{mode}",
                                          writer=AsyncWriter() if mode == "async" else None)
        engine.train_step(iter(micro * 4))  # warm-up, untimed
        dist.barrier()
        saves, start = [], time.perf_counter()
        for step in range(1, train["steps"] + 1):
            engine.train_step(iter(micro * 4))
            # No save at the last step: in steady state the writer of a save runs during the steps after it.
            if mode != "none" and step % train["interval"] == 0 and step < train["steps"]:
                t = time.perf_counter()
                checkpointing.save(engine, config, step, 2 * step, folder)
                saves.append(time.perf_counter() - t)
        folder.wait()
        dist.barrier()
        result.update(seconds=time.perf_counter() - start, save_calls=saves)
    elif save:
        engine.train_step(iter(micro * 4))
        checkpointing.save(engine, config, 1, 2, checkpointing.SaveFolder(lock=None, run_id="bench"))
    if out:
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def spawn(world: int, flags: list, save: str = "", load: str = "", tp: int = 1, train: dict = None) -> dict:
    """Rank 0's result, with every rank's under "ranks"."""
    import torch.multiprocessing as mp

    from megatron_lite.training.distributed import free_port

    out = tempfile.mktemp(suffix=".json")
    mp.start_processes(worker, args=(world, free_port(), flags, save, load, out, tp, train), nprocs=world,
                       start_method="spawn")
    ranks = []
    for rank in range(world):
        with open(f"{out}.{rank}") as f:
            ranks.append(json.load(f))
        os.remove(f"{out}.{rank}")
    return dict(ranks[0], ranks=ranks)


def timed(cmd: list) -> dict:
    """seconds and peak RSS (GNU time) of a command, which must succeed."""
    result = subprocess.run(["/usr/bin/time", "-f", "TIME %e %M", *cmd], cwd=REPO, capture_output=True, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO))
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    seconds, kib = result.stderr.strip().splitlines()[-1].split()[1:]
    row = {"seconds": float(seconds), "peak_rss": int(kib) * 1024}
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            row.update(json.loads(line[len("RESULT "):]))
    return row


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(path) for f in files)


READ_ALL = ("import os, sys; from megatron_lite.checkpoint.format import load_file; "
            "[load_file(os.path.join(sys.argv[1], f)) for f in sorted(os.listdir(sys.argv[1])) if f.endswith('.pt')]")
LOAD_ONE = ("import sys, json; sys.argv = sys.argv[1:]; from tools.bench_checkpoint_move import spawn; "
            "print('RESULT', json.dumps(spawn(int(sys.argv[0]), json.loads(sys.argv[1]), load=sys.argv[2], "
            "tp=int(sys.argv[3]))))")


def dd_seconds(path: str, size: int) -> float:
    """Seconds for dd to write and fsync `size` bytes into `path` (the disk's sequential write rate)."""
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=8M", f"count={max(1, size // (8 << 20))}",
                    "conv=fsync"], check=True, capture_output=True)
    return time.perf_counter() - start


def raw_write_seconds(path: str, size: int) -> float:
    """Seconds to write() and fsync `size` bytes from one tensor in memory into `path`: the save's file writes
    without torch.save's format."""
    import torch

    data = torch.ones(size // 4, dtype=torch.float32)
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(data.numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def save_stalls(flags: list, work: str, size: int, rounds: int, steps: int, interval: int, world: int) -> dict:
    """Interleaved rounds of no save / sync / async training runs (`world` DP ranks of one thread each) and dd:
    per mode the per-round stalls."""
    runs = {"none": [], "sync": [], "async": []}
    save_calls = {"sync": [], "async": []}
    dd, raw = [], []
    for r in range(rounds):
        for mode in runs:
            folder = os.path.join(work, f"stall-{mode}-{r}")
            row = spawn(world, flags, save=folder, train={"mode": mode, "steps": steps, "interval": interval})
            runs[mode].append(row["seconds"])
            if mode != "none":
                save_calls[mode] += row["save_calls"]
            if mode == "sync":
                written = du(os.path.join(folder, f"iter_{interval:07d}"))
            shutil.rmtree(folder, ignore_errors=True)
        # Into new files kept until the end, as a run keeps its checkpoints: this VM hands freed memory back
        # to its host, and a write into page-cache pages freed a moment ago (a file just deleted) runs about
        # four times faster than into pages it must get back (measured: 1.5 GB/s against 0.3-0.4 GB/s).
        dd.append(dd_seconds(os.path.join(work, f"dd-{world}-{r}.bin"), size))
        raw.append(raw_write_seconds(os.path.join(work, f"raw-{world}-{r}.bin"), size))
        print(f"DP {world}, round {r + 1}: " + ", ".join(f"{m} {runs[m][-1]:.1f}s" for m in runs) +
              f"; dd {dd[-1]:.1f}s; raw write {raw[-1]:.1f}s", flush=True)
    for r in range(rounds):
        for name in (f"dd-{world}-{r}.bin", f"raw-{world}-{r}.bin"):
            os.remove(os.path.join(work, name))
    saves = (steps - 1) // interval
    stalls = {m: [(t - n) / saves for t, n in zip(runs[m], runs["none"])] for m in ("sync", "async")}
    return {"runs": runs, "stalls": stalls, "save_calls": save_calls, "dd": dd, "raw": raw, "bytes": written}


def _median(values):
    values = sorted(values)
    return values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the save-stall runs")
    p.add_argument("--steps", type=int, default=12, help="training steps per save-stall run (no save at the last)")
    p.add_argument("--save-every", type=int, default=4, help="a save every this many of those steps")
    p.add_argument("--stall-ranks", type=int, nargs="+", default=[2, 1],
                   help="DP sizes of the save-stall runs (2: every core trains; 1: a core is free for the writer)")
    p.add_argument("--no-moves", action="store_true", help="only the save measurements")
    p.add_argument("--work-dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    args = p.parse_args(argv)
    flags = model_flags(args)
    work = args.work_dir or tempfile.mkdtemp(prefix="bench-ckpt-")
    ckpt = os.path.join(work, "ckpt")
    h, L, v = args.hidden_size, args.num_layers, args.vocab_size
    parameters = L * (12 * h * h + 13 * h) + v * h + 128 * h + 2 * h
    print(f"model: {L} layers, hidden {h}, vocabulary {v}: {parameters / 1e6:.1f}M parameters; bf16, ZeRO 1, DP 2",
          flush=True)
    start = time.perf_counter()
    spawn(2, flags, save=ckpt)
    tag = os.path.join(ckpt, "iter_0000001")
    size = du(tag)
    print(f"saved in {time.perf_counter() - start:.1f}s: {size / 2**20:.0f} MiB on disk in "
          f"{len(os.listdir(tag))} files", flush=True)

    for world in args.stall_ranks:
        stall = save_stalls(flags, work, size, args.rounds, args.steps, args.save_every, world)
        sync_save, async_call = _median(stall["save_calls"]["sync"]), _median(stall["save_calls"]["async"])
        sync_stall, async_stall = _median(stall["stalls"]["sync"]), _median(stall["stalls"]["async"])
        dd, written = _median(stall["dd"]), stall["bytes"]
        cores = os.cpu_count()
        print(f"\n| save, DP {world} (one thread per rank, {cores} cores) | per save, median of {args.rounds} rounds |"
              f"\n|---|---|")
        print(f"| synchronous save() call, {written / 2**20:.0f} MiB | {sync_save:.2f} s "
              f"({written / sync_save / 2**20:.0f} MiB/s) |")
        print(f"| dd of {size / 2**20:.0f} MiB, conv=fsync | {dd:.2f} s ({size / dd / 2**20:.0f} MiB/s) |")
        raw = _median(stall["raw"])
        print(f"| write() + fsync of {size / 2**20:.0f} MiB from a tensor | {raw:.2f} s ({size / raw / 2**20:.0f} MiB/s) |")
        print(f"| write rate: sync save / dd | {(written / sync_save) / (size / dd):.2f}x (target >= 0.7x) |")
        print(f"| write rate: sync save / write() from a tensor | {(written / sync_save) / (size / raw):.2f}x |")
        print(f"| training stall, sync | {sync_stall:.2f} s |")
        print(f"| training stall, --async-save | {async_stall:.2f} s (save() call {async_call:.2f} s) |")
        print(f"| async stall / sync save time | {async_stall / sync_save:.2f} (target <= 0.15) |")
        print(f"runs (s): {json.dumps(stall['runs'])}; dd (s): {json.dumps(stall['dd'])}", flush=True)

    if args.no_moves:
        return 0
    rows = {"read": timed([sys.executable, "-c", READ_ALL, tag])}
    for name, world, tp in (("native", 2, 1), ("dp1", 1, 1), ("tp4", 4, 4)):
        rows[name] = timed([sys.executable, "-c", LOAD_ONE, str(world), json.dumps(flags), ckpt, str(tp)])
    rows["universal"] = timed([sys.executable, "tools/convert_checkpoint.py", "universal", "--load", ckpt, "--save",
                               os.path.join(work, "universal")])
    rows["reshard"] = timed([sys.executable, "tools/convert_checkpoint.py", "reshard", "--load", ckpt, "--save",
                             os.path.join(work, "tp2pp2"), "--target-tensor-model-parallel-size", "2",
                             "--target-pipeline-model-parallel-size", "2"])
    print("\n| what | process seconds | x read | largest process peak RSS MiB | / checkpoint size | load() seconds | "
          "RSS growth in load(), MiB per rank | growth summed / checkpoint size |\n|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        inner = "- | - | -"
        if "load_seconds" in row:
            growth = [r["load_rss_increase"] for r in row["ranks"]]
            inner = (f"{row['load_seconds']:.1f} | {', '.join(f'{g / 2**20:.0f}' for g in growth)} | "
                     f"{sum(growth) / size:.2f}")
        print(f"| {name} | {row['seconds']:.1f} | {row['seconds'] / rows['read']['seconds']:.2f} | "
              f"{row['peak_rss'] / 2**20:.0f} | {row['peak_rss'] / size:.2f} | {inner} |")
    for name in ("native", "dp1", "tp4"):
        print(f"{name}: {rows[name].get('note') or 'loaded by DeepSpeed'}")
    growth = [r["load_rss_increase"] for r in rows["tp4"]["ranks"]]
    share = size / 4
    print(f"tp4: each rank's growth / its share ({share / 2**20:.0f} MiB): "
          f"{', '.join(f'{g / share:.2f}' for g in growth)} (target <= 1.5); summed growth / checkpoint "
          f"{sum(growth) / size:.2f} (target <= 1.5)")
    print(f"\ncheckpoint {size / 2**20:.0f} MiB; universal form {du(os.path.join(work, 'universal')) / 2**20:.0f} MiB; "
          f"TP 2 x PP 2 reshard {du(os.path.join(work, 'tp2pp2')) / 2**20:.0f} MiB; work folder {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
