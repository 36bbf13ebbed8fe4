"""How much does this machine's speed move by itself? The same fixed work, timed again and again.

Every round, --processes processes (one thread each, one per core here) each multiply two 192 x 192 fp32
matrices --matmuls times: no communication, no memory growth, the same instructions every round. Printed
per round: seconds, and from /proc/stat the CPU time spent in user mode, in steal (time the hypervisor ran
someone else while this VM wanted the CPU) and idle over the round, in seconds of CPU. Last: the spread
(slowest / fastest round) and whether the slow rounds lost their time to steal (the VM was not scheduled)
or to user time (it was scheduled and each instruction took longer: frequency, a shared cache or memory
bandwidth, a busy SMT sibling). This is the floor under any timing comparison on the machine: two step
times of one layout measured apart cannot agree more closely than the machine's own spread.

    python benchmarks/bench_machine_drift.py                      # 40 rounds of about 5 s here
    python benchmarks/bench_machine_drift.py --rounds 10 --matmuls 5000 --json drift.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _work(matmuls: int) -> None:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(192, 192), torch.randn(192, 192)
    for _ in range(matmuls):
        torch.mm(a, b)


def cpu_times() -> dict:
    """The machine's CPU time so far, in seconds, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    return {"user": fields[0] / tick, "idle": fields[3] / tick, "steal": fields[7] / tick}


def one_round(processes: int, matmuls: int) -> dict:
    before, start = cpu_times(), time.perf_counter()
    workers = [multiprocessing.Process(target=_work, args=(matmuls,)) for _ in range(processes)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds, after = time.perf_counter() - start, cpu_times()
    return {"seconds": seconds, **{k: after[k] - before[k] for k in before}}


def summary(rounds) -> dict:
    fast = min(rounds, key=lambda r: r["seconds"])
    slow = max(rounds, key=lambda r: r["seconds"])
    return {"rounds": len(rounds), "fastest_s": fast["seconds"], "slowest_s": slow["seconds"],
            "spread": slow["seconds"] / fast["seconds"], "slowest_extra_user_s": slow["user"] - fast["user"],
            "slowest_extra_steal_s": slow["steal"] - fast["steal"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--matmuls", type=int, default=30000, help="192 x 192 matmuls per process and round")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", default=None, help="write every round here")
    args = parser.parse_args()
    for flag in ("rounds", "matmuls", "processes"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    multiprocessing.set_start_method("fork")
    import torch  # noqa: F401  (imported once here, so the forked workers time matmuls, not torch's import)
    rounds = []
    for r in range(args.rounds):
        rounds.append(one_round(args.processes, args.matmuls))
        x = rounds[-1]
        print(f"round {r + 1:3d}: {x['seconds']:6.2f} s  user {x['user']:6.2f} s  steal {x['steal']:5.2f} s  "
              f"idle {x['idle']:5.2f} s", flush=True)
    s = summary(rounds)
    print(f"{s['rounds']} rounds: fastest {s['fastest_s']:.2f} s, slowest {s['slowest_s']:.2f} s, spread "
          f"{s['spread']:.2f}; the slowest round spent {s['slowest_extra_user_s']:+.2f} s more user CPU time and "
          f"{s['slowest_extra_steal_s']:+.2f} s more steal than the fastest")
    if args.json:
        from megatron_lite.atomic import write_text

        write_text(args.json, json.dumps({"rounds": rounds, "summary": s}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
