"""Which layers full recompute rebuilds from their input: torch-free, so the estimate, the FLOP count and
the planner ask the same rule the stage runs by (the running itself: model/recompute.py)."""
from __future__ import annotations

from typing import List, Optional, Tuple


def recompute_chunks(method: Optional[str], num_layers: Optional[int], layers: int) -> List[Tuple[int, int, bool]]:
    """(start, end, recomputed) chunks covering a stage's `layers` transformer layers, in order, for
    --recompute-granularity full (model/recompute.py runs them): uniform cuts the layers into chunks of
    num_layers, each recomputed from its input; block recomputes the first num_layers layers one by one."""
    if method is None or layers == 0:
        return [(0, layers, False)] if layers else []
    if method == "uniform":
        return [(a, min(a + num_layers, layers), True) for a in range(0, layers, num_layers)]
    recomputed = min(num_layers, layers)
    chunks = [(i, i + 1, True) for i in range(recomputed)]
    return chunks + ([(recomputed, layers, False)] if recomputed < layers else [])
