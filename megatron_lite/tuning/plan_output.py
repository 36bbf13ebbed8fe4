"""The plan as written and printed: the `Plan` record (its JSON) and the table, notes and first choice
tune_parallelism.py plan shows."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List

from megatron_lite.atomic import write_text
from megatron_lite.cost import memory
from megatron_lite.tuning.candidates import Candidate

REJECTION_LABELS = {
    "does_not_fit_memory": "does not fit in memory",
    "layers_fewer_than_stages": "layers fewer than stages",
    "heads_not_divisible_by_tp": "heads not divisible by TP",
    "ffn_not_divisible_by_tp": "FFN width not divisible by TP",
    "hidden_not_divisible_by_heads": "hidden not divisible by heads",
    "groups_not_compatible_with_tp": "query groups neither divide nor are divided by TP (or K/V rows do not split)",
    "heads_not_divisible_by_groups": "heads not divisible by query groups",
    "batch_not_divisible": "global batch not divisible by micro x DP",
    "world_not_divisible": "world size not divisible by TP x CP x PP",
    "heads_not_divisible_by_cp": "heads per TP rank not divisible by CP",
    "groups_not_compatible_with_cp": "query groups per TP rank neither divide nor are divided by CP",
    "seq_not_divisible_by_cp": "sequence not divisible by CP (x TP with sequence parallelism)",
}
"""Reason code -> the words the plan's table groups rejections under."""


@dataclass
class Plan:
    mode: str
    cluster: Dict[str, Any]
    model_argv: List[str]
    """The model and batch flags as the user gave them."""
    memory_budget_bytes: int
    candidates: List[Candidate]
    rejected: List[Dict[str, Any]]
    notes: List[str] = field(default_factory=list)
    """What the plan changed of the user's flags (their layout flags are replaced per candidate)."""

    def to_dict(self) -> Dict[str, Any]:
        return {"mode": self.mode, "cluster": self.cluster, "model_argv": self.model_argv,
                "memory_budget_bytes": self.memory_budget_bytes,
                "candidates": [dict(asdict(c), layout=c.layout) for c in self.candidates],
                "rejected": self.rejected, "notes": self.notes}

    def save(self, path: str) -> None:
        write_text(path, json.dumps(self.to_dict(), indent=1))


def rejection_kind(rejection: Dict[str, Any]) -> str:
    """The words a rejection is grouped under in the table, from its reason code."""
    code = rejection.get("reason_code", "invalid")
    return REJECTION_LABELS.get(code, code.replace("_", " "))


def first_choice_reason(p: Plan) -> str:
    """Why the plan's first candidate is first, in the words of its order."""
    if not p.candidates:
        return "no candidate fits"
    c, gpus_per_node = p.candidates[0], p.cluster["gpus_per_node"]
    tail = (f"peak {max(c.peak_bytes_per_stage) / memory.GIB:.1f} GiB of the {p.memory_budget_bytes / memory.GIB:.1f} "
            f"GiB budget; predicted throughput rank {c.throughput_rank} of {len(p.candidates)}")
    if p.cluster["order"] == "throughput" or p.mode == "micro-batch-probe":
        return f"{c.layout}: the highest predicted tokens/s; {tail}"
    pp, gas = c.pipeline_model_parallel_size, c.gradient_accumulation_steps
    tp, cp, ep = c.tensor_model_parallel_size, c.context_parallel_size, c.expert_model_parallel_size
    moe = p.cluster.get("num_experts") is not None
    group = f"TP {tp} x EP {ep}" if moe else f"TP {tp}"
    fills = "= GPUs per node" if tp * ep == gpus_per_node else f"the nearest to {gpus_per_node} GPUs per node"
    return (f"{c.layout}: gas {gas} {'>=' if gas >= 8 * pp else '<'} 8 x PP {pp}, {group} {fills}, "
            f"memory saver '{c.saver}' (tier {c.saver_tier}), CP {cp}, {pp} stage{'s' if pp > 1 else ''}, "
            f"{f'EP {ep}, ' if moe else ''}micro batch {c.micro_batch_size} (Shaden's order, in that priority); {tail}")


PRICED_FROM = {"model times": "model", "profile": "profile", "constants": "const"}
"""The table's 'from' column: calibrate's timed steps of this model, the profile's generic fits, or the constants."""


def format_plan(p: Plan, limit: int = 30) -> str:
    # An MoE model's plan adds EP and the expert all-to-alls' share of the predicted step.
    moe = p.cluster.get("num_experts") is not None
    lines = [f"{'rank':>4} {'thr.rank':>8} {'TP':>3} {'CP':>3} {'PP':>3} {'DP':>4} " + ("  EP " if moe else "")
             + f"{'micro':>5} {'gas':>5} {'peak GiB (stages)':>24} {'pipe eff':>8} {'rel. thr':>8} "
             + ("a2a % " if moe else "") + f"{'from':>7}  saver"]
    for c in p.candidates[:limit]:
        peaks = [x / memory.GIB for x in c.peak_bytes_per_stage]
        peak_txt = (f"{max(peaks):.3g} ({peaks[0]:.3g}..{peaks[-1]:.3g})" if len(peaks) > 1
                    else f"{peaks[0]:.3g}")
        a2a = f"{100 * c.predicted_ep_comm_seconds / c.predicted_step_seconds:>5.1f} " if moe else ""
        lines.append(f"{c.rank:>4} {c.throughput_rank:>8} {c.tensor_model_parallel_size:>3} "
                     f"{c.context_parallel_size:>3} {c.pipeline_model_parallel_size:>3} "
                     f"{c.data_parallel_size:>4} " + (f"{c.expert_model_parallel_size:>4} " if moe else "")
                     + f"{c.micro_batch_size:>5} {c.gradient_accumulation_steps:>5} {peak_txt:>24} "
                     f"{c.predicted_pipeline_efficiency:>8.3f} {c.predicted_relative_throughput:>8.3f} {a2a}"
                     f"{PRICED_FROM.get(c.predicted_from, c.predicted_from):>7}  {c.saver}")
    if len(p.candidates) > limit:
        lines.append(f"... {len(p.candidates) - limit} more in the JSON")
    kinds: Dict[str, List[str]] = {}
    for r in p.rejected:
        kinds.setdefault(rejection_kind(r), []).append(r["layout"])
    lines += [f"note: {note}" for note in p.notes]
    lines.append(f"{len(p.candidates)} candidates kept, {len(p.rejected)} rejected (every reason in the JSON):")
    for kind, layouts in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(layouts[:4]) + (", ..." if len(layouts) > 4 else "")
        lines.append(f"  {len(layouts):>4} x {kind}: {shown}")
    return "\n".join(lines)
