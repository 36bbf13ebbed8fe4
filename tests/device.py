"""Run the CPU-written tests on another device: MEGATRON_LITE_TEST_DEVICE=cuda.

The tests build their tensors with torch's factory functions (randn, zeros, arange, ...), often
from CPU generators so that values do not depend on the device. With the variable set, the test
process and every harness worker enter `DeviceFactories`: a factory call that names no device
makes its tensor on the test device (like torch.set_default_device), except that a call drawing
from a CPU generator draws on the CPU and then moves the result, so the values stay those the
CPU run sees. Models (their parameters come from factories) follow. What a test makes otherwise
(torch.from_numpy, DataLoader batches) stays on the CPU; the engines move their batches themselves.

On one GPU several harness ranks share the device: they talk over gloo (NCCL refuses two ranks
on one GPU), and every rank's LOCAL_RANK is mapped onto the visible GPUs. Set to `cpu`, the mode
is active but changes nothing: how the dry run of scripts/gpu_check.sh keeps this path working.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

VARIABLE = "MEGATRON_LITE_TEST_DEVICE"


def test_device() -> Optional[str]:
    return os.environ.get(VARIABLE) or None


class DeviceFactories(TorchFunctionMode):
    def __init__(self, device: str):
        super().__init__()
        from torch.utils._device import _device_constructors

        self.device = torch.device(device)
        self.constructors = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self.constructors and kwargs.get("device") is None:
            generator = kwargs.get("generator")
            if generator is not None and generator.device != self.device:
                return func(*args, **kwargs).to(self.device)
            kwargs["device"] = self.device
        return func(*args, **kwargs)


def local_rank_for(rank: int) -> int:
    """LOCAL_RANK for a harness rank: its own GPU where there are enough, else a shared one."""
    device = test_device()
    if device and device.startswith("cuda") and torch.cuda.is_available():
        return rank % torch.cuda.device_count()
    return rank


def enter_test_device() -> None:
    """Called once per process (conftest, harness workers); a no-op without the variable."""
    device = test_device()
    if device is None:
        return
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    DeviceFactories(device).__enter__()  # for the life of the process
