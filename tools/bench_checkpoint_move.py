"""Time and peak memory to move a ~100M-parameter checkpoint to another layout, against its size on disk and a
plain read of its files measured in the same run.

The checkpoint: bf16, ZeRO 1, saved by two processes (DP 2) after one step, so it holds the DP-partitioned
fp32 masters and Adam moments a GPU run writes. Each measurement is its own process, timed from its start
to its end (imports and the engine included where there is one), with its peak RSS:

  read        torch.load(weights_only=True) of every file of the checkpoint: the I/O and unpickling floor
  native      --load at the saved layout (DP 2, DeepSpeed's own loader; rank 0's process)
  dp1         --load at DP 1 (the layout-free path: partitions put together, one rank takes everything)
  universal   convert_checkpoint.py universal (the layout-free form on disk)
  reshard     convert_checkpoint.py reshard to TP 2 x PP 2 (fp32 layer files and AdamW states)

    python tools/bench_checkpoint_move.py                   # 12 layers, hidden 768, vocabulary 32000 (~110M)
    python tools/bench_checkpoint_move.py --num-layers 2     # a quick check
"""
from __future__ import annotations

import argparse
import json
import os
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


def worker(rank: int, world: int, port: int, flags: list, save: str, load: str, out: str) -> None:
    """One rank: build the engine, optionally load (timed, with the RSS peak of the load), optionally train a
    step and save."""
    import threading

    import psutil
    import torch
    import torch.distributed as dist

    from megatron_lite.arguments import parse_args
    from megatron_lite.parallel import state
    from megatron_lite.training import checkpointing
    from megatron_lite.training.engine import Engine
    from tools.bench_training import join_gloo_world

    join_gloo_world(rank, world, port)
    config, _ = parse_args(flags + (["--save", save] if save else []) + (["--load", load] if load else []),
                           world_size=world)
    state.initialize(1, 1)
    engine = Engine(config)
    result = {}
    if load:
        process, peak, done = psutil.Process(), [0], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], process.memory_info().rss)
                time.sleep(0.005)
        before = process.memory_info().rss
        thread = threading.Thread(target=sample)
        thread.start()
        start = time.perf_counter()
        resumed = checkpointing.load(engine, config)
        result.update(load_seconds=time.perf_counter() - start, iteration=resumed.iteration)
        done.set()
        thread.join()
        result.update(load_rss_increase=max(peak[0], process.memory_info().rss) - before, note=resumed.note)
    if save:
        seq = config.model.seq_length
        tokens = torch.randint(0, config.model.vocab_size, (1, seq + 1))
        micro = [((tokens[:, :-1], torch.arange(seq)[None]), (tokens[:, 1:], torch.ones(1, seq)))] * 4
        engine.train_step(iter(micro))
        checkpointing.save(engine, config, 1, 2, checkpointing.SaveFolder(lock=None, run_id="bench"))
    if rank == 0 and out:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def spawn(world: int, flags: list, save: str = "", load: str = "") -> dict:
    import torch.multiprocessing as mp

    from megatron_lite.training.distributed import free_port

    out = tempfile.mktemp(suffix=".json")
    mp.start_processes(worker, args=(world, free_port(), flags, save, load, out), nprocs=world, start_method="spawn")
    with open(out) as f:
        return json.load(f)


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
            "print('RESULT', json.dumps(spawn(int(sys.argv[0]), json.loads(sys.argv[1]), load=sys.argv[2])))")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--vocab-size", type=int, default=32000)
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
    print(f"saved in {time.perf_counter() - start:.1f}s: {du(tag) / 2**20:.0f} MiB on disk in "
          f"{len(os.listdir(tag))} files", flush=True)

    rows = {"read": timed([sys.executable, "-c", READ_ALL, tag])}
    for name, world in (("native", 2), ("dp1", 1)):
        rows[name] = timed([sys.executable, "-c", LOAD_ONE, str(world), json.dumps(flags), ckpt])
    rows["universal"] = timed([sys.executable, "tools/convert_checkpoint.py", "universal", "--load", ckpt, "--save",
                               os.path.join(work, "universal")])
    rows["reshard"] = timed([sys.executable, "tools/convert_checkpoint.py", "reshard", "--load", ckpt, "--save",
                             os.path.join(work, "tp2pp2"), "--target-tensor-model-parallel-size", "2",
                             "--target-pipeline-model-parallel-size", "2"])
    size = du(tag)
    print("\n| what | process seconds | x read | peak RSS MiB | peak RSS / checkpoint size | load() seconds | "
          "RSS growth in load() MiB |\n|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        inner = (f"{row['load_seconds']:.1f} | {row['load_rss_increase'] / 2**20:.0f}" if "load_seconds" in row
                 else "- | -")
        print(f"| {name} | {row['seconds']:.1f} | {row['seconds'] / rows['read']['seconds']:.2f} | "
              f"{row['peak_rss'] / 2**20:.0f} | {row['peak_rss'] / size:.2f} | {inner} |")
    for name in ("native", "dp1"):
        print(f"{name}: {rows[name].get('note') or 'loaded by DeepSpeed'}")
    print(f"\ncheckpoint {size / 2**20:.0f} MiB; universal form {du(os.path.join(work, 'universal')) / 2**20:.0f} MiB; "
          f"TP 2 x PP 2 reshard {du(os.path.join(work, 'tp2pp2')) / 2**20:.0f} MiB; work folder {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
