"""A model whose weights alone do not fit this machine's memory, refused from the parameter arithmetic before
anything is allocated (a --kv-channels 99999999 printed its parameter count and then a 54-line allocation
traceback from the first rank's torch.empty).

The bound is what the weights of one rank need at the least: the parameters of every layer after the TP and EP
splits, shared evenly over the PP stages (the busiest stage holds at least that), over DP too at ZeRO 3, in the
training dtype. The machine's memory is the host's (/proc/meminfo's MemTotal, via sysconf), or the GPU's where
nvidia-smi reports one and the weights exceed a GiB (asked only then: a subprocess costs ~0.1 s): the larger of
the two, so that only a model that cannot fit either is refused. Torch-free; for a run on this machine only, not
for the tuning tools' layouts of other machines, so not one of validate()'s rules.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional

from megatron_lite.config import Config, ConfigError

GIB = 1 << 30


def host_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gpu_memory_bytes() -> Optional[int]:
    """The largest visible GPU's memory as nvidia-smi reports it, or None without one."""
    if not shutil.which("nvidia-smi") or os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return max(int(float(v)) for v in out.split()) << 20  # MiB
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def rank_weight_bytes(config: Config) -> int:
    """The least memory one rank's weights take (see the module's docstring)."""
    from megatron_lite.cost.arithmetic import spec_parameters

    p = config.parallel
    parameters = sum(spec_parameters(config, p.tensor_model_parallel_size, p.expert_model_parallel_size))
    parameters //= p.pipeline_model_parallel_size
    if p.zero_stage == 3:
        parameters //= max(1, (p.data_parallel_size or 1) * p.context_parallel_size)
    return parameters * (4 if config.precision.dtype_name == "fp32" else 2)


def weights_problem(config: Config, host: Optional[int] = None, gpu: Optional[int] = None) -> Optional[str]:
    """Why this machine cannot hold one rank's weights, naming the flags that make the model that size, or None.
    `host`, `gpu`: the memories in bytes (default: this machine's)."""
    need = rank_weight_bytes(config)
    host = host_memory_bytes() if host is None else host
    if need <= host:
        return None
    if gpu is None and need > GIB:
        gpu = gpu_memory_bytes()
    have, where = max((host, "host memory"), (gpu or 0, "GPU memory"))
    if need <= have:
        return None
    m, p = config.model, config.parallel
    flags = [f"--num-layers {m.num_layers}", f"--hidden-size {m.hidden_size}"]
    flags += [f"--{name.replace('_', '-')} {getattr(m, name)}"
              for name in ("ffn_hidden_size", "kv_channels", "num_experts", "moe_ffn_hidden_size", "vocab_size")
              if getattr(m, name, None)]
    layout = (f"TP {p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size}"
              + (f" x EP {p.expert_model_parallel_size}" if p.expert_model_parallel_size > 1 else ""))
    return (f"the model ({', '.join(flags)}) needs {need / GIB:,.1f} GiB for one rank's weights alone at "
            f"{layout} ({config.precision.dtype_name}), more than this machine's {have / GIB:,.1f} GiB of "
            f"{where}; make it smaller (tools/estimate_memory.py gives the sizes) or split it over more ranks")


def check_weights_fit(config: Config) -> None:
    problem = weights_problem(config)
    if problem:
        raise ConfigError(problem)


def refuse_unless_weights_fit(config: Config, tool: str = "pretrain_gpt.py") -> None:
    """Exit 2 with the one line (seen once under any launcher: refusal.py) when the weights cannot fit. A model
    whose size is not known yet (no vocabulary without data: the training inputs' check names --data-path next)
    is left to that check."""
    try:
        problem = weights_problem(config)
    except ConfigError:
        return
    if problem:
        from megatron_lite.refusal import refuse

        refuse(f"{tool}: error: {problem}")
