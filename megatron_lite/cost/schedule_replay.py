"""Replay per-rank pipeline instruction streams with given forward and backward times: when does each rank end?

A stream is a rank's instructions in order, each one of
    ("compute", seconds)                   a forward or a backward: the rank is busy
    ("exchange", [(peer, "send"|"recv")])  sends and receives launched together and waited for (DeepSpeed's
                                           CommitP2P; a 1F1B send or receive is an exchange of one)
An exchange ends once every peer has reached the exchange holding the matching receive or send: messages
between two ranks match in order, one queue per direction. Transfers take no time, so what is left beyond the
computation is the schedule's bubble. deepspeed_compat/dualpipev.py `instruction_streams` turns DeepSpeed's
schedules into streams; cost/pipeline_efficiency.py's closed forms are what this gives for them.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

Instruction = Tuple[str, object]


def replay(streams: Sequence[Sequence[Instruction]]) -> List[float]:
    """Each rank's end time; raises ValueError when the streams deadlock."""
    ranks = len(streams)
    # Number every message on its channel (sender, receiver): the n-th send matches the n-th receive.
    tagged: List[List[Instruction]] = []
    counts: Dict[Tuple[int, int, str], int] = {}
    for rank, stream in enumerate(streams):
        ops: List[Instruction] = []
        for kind, value in stream:
            if kind == "exchange":
                messages = []
                for peer, direction in value:
                    channel = (rank, peer) if direction == "send" else (peer, rank)
                    n = counts.get((*channel, direction), 0)
                    counts[(*channel, direction)] = n + 1
                    messages.append((channel, direction, n))
                ops.append(("exchange", messages))
            elif kind == "compute":
                ops.append(("compute", float(value)))
            else:
                raise ValueError(f"unknown instruction {kind!r}")
        tagged.append(ops)
    posted: Dict[tuple, float] = {}  # (channel, direction, n) -> when its exchange was reached
    clock, position = [0.0] * ranks, [0] * ranks
    moved = True
    while moved:
        moved = False
        for rank in range(ranks):
            ops = tagged[rank]
            while position[rank] < len(ops):
                kind, value = ops[position[rank]]
                if kind == "compute":
                    clock[rank] += value
                else:
                    for message in value:
                        posted.setdefault(message, clock[rank])
                    peers = [(channel, "recv" if direction == "send" else "send", n) for channel, direction, n in value]
                    if not all(p in posted for p in peers):
                        break
                    clock[rank] = max([clock[rank]] + [posted[p] for p in peers])
                position[rank] += 1
                moved = True
    stuck = [r for r in range(ranks) if position[r] < len(tagged[r])]
    if stuck:
        raise ValueError(f"the streams deadlock: ranks {stuck} wait forever")
    return clock
