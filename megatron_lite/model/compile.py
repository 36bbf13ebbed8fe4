"""--compile: each transformer layer compiled on its own with torch.compile (torchtitan's per-block choice), and
what the compiler did, counted.

Why per layer, not the pipeline module: DeepSpeed's pipeline engine calls the stage's layer functions one by one
and mutates its own state between them; a layer is the unit every layout repeats, so the model's L layers share
one compiled graph per kind of layer (dense, MoE, windowed, ...; the modules' parameters are graph inputs) and
the embedding, the head and the loss stay eager. A layer compiles through everything it does:
  - our tensor/sequence/context-parallel autograd Functions (parallel/mappings.py, parallel/layers.py): their
    collectives name the group from a global, never as an argument, so dynamo traces them into the graph;
  - recompute: full recompute wraps whole layers in torch's non-reentrant checkpoint outside the compiled code
    (model/recompute.py), so the recompute runs the same compiled graph under the same grad mode (DeepSpeed's
    reentrant checkpoint would run the layer under no_grad first and compile it twice); selective recompute is
    a checkpoint inside the layer, which dynamo traces;
  - dropout that draws (training, p > 0) runs eagerly in its stream (parallel/random.py `run_in_stream`): one graph
    break per dropout site, and the masks an eager layer draws; without dropout a dense layer has no break;
  - document masks take the explicit mask instead of the document-by-document split (that split reads ranges to
    the host and shapes the work by them); the attention-work share is then 1, as computed.
Past dynamo's recompile limit a frame would silently run eager: `fail_on_recompile_limit_hit` makes that an
error instead. The inductor caches (on by default in torch 2.13; TORCHINDUCTOR_CACHE_DIR moves them, default
/tmp/torchinductor_$USER) make a second run of the same model pay a fraction of the first's compile time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from megatron_lite.config.model_core import COMPILE_BACKENDS
from megatron_lite.model.transformer import TransformerLayer

RECOMPILE_LIMIT = 16
"""Graphs dynamo may keep per compiled code: every kind of layer (dense, MoE, windowed, ...) in training and in
evaluation is one. Torch's default (8) can be reached by a model with four kinds of layer."""


@dataclass(frozen=True)
class CompileCounts:
    """What dynamo did since a CompileCounter was made: graphs compiled, graph breaks (and why), seconds in compile."""
    graphs: int
    graph_breaks: int
    break_reasons: Dict[str, int]
    seconds: float

    def line(self, backend: str) -> str:
        reasons = "".join(f"; {n} x {reason.splitlines()[0][:120]}" for reason, n in self.break_reasons.items())
        return (f"compile | {backend}: {self.graphs} graphs, {self.graph_breaks} graph breaks, "
                f"{self.seconds:.1f} s compiling{reasons}")


def compile_layers(module: nn.Module, backend: str = "inductor") -> int:
    """Compile every transformer layer of `module` in place (its state dict keeps its names); returns how many."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"--compile-backend {backend!r}: expected one of {', '.join(COMPILE_BACKENDS)}")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    layers = [m for m in module.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)


class CompileCounter:
    """Counts dynamo's graphs and graph breaks from when it is made (counters are process-wide)."""

    def __init__(self) -> None:
        self._graphs = counters["stats"]["unique_graphs"]
        self._breaks = dict(counters["graph_break"])
        self._seconds = _compile_seconds()

    def counts(self) -> CompileCounts:
        reasons = {r: n - self._breaks.get(r, 0) for r, n in counters["graph_break"].items()}
        reasons = {r: n for r, n in reasons.items() if n > 0}
        return CompileCounts(graphs=counters["stats"]["unique_graphs"] - self._graphs,
                             graph_breaks=sum(reasons.values()), break_reasons=reasons,
                             seconds=_compile_seconds() - self._seconds)


def _compile_seconds() -> float:
    """Seconds spent in dynamo's compile entry point so far (its own timing table)."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))
