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


def census_device() -> str:
    """The device the memory estimates are asked for when a test compares them with what it measured:
    the test device's kernels are what the census saw (CUDA's dropout keeps a bool mask, the CPU's
    one in the input's dtype; SDPA picks other kernels). Asked for "cpu" under CUDA, the GPU check's
    activation censuses compared the CPU's bytes with the GPU's."""
    return "cuda" if (test_device() or "").startswith("cuda") else "cpu"


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
                # Drawn where the generator is, then moved; a tensor asked for with requires_grad must stay
                # a leaf (its .grad is what tests read), so the flag goes on the moved copy. Before this,
                # the GPU check's CP attention tests read x.grad as None.
                requires_grad = kwargs.pop("requires_grad", False)
                return func(*args, **kwargs).to(self.device).requires_grad_(requires_grad)
            kwargs["device"] = self.device
        return func(*args, **kwargs)


def local_rank_for(rank: int) -> int:
    """LOCAL_RANK for a harness rank: its own GPU where there are enough, else a shared one."""
    device = test_device()
    if device and device.startswith("cuda") and torch.cuda.is_available():
        return rank % torch.cuda.device_count()
    return rank


class _CopyBackWork:
    """irecv's work for a CUDA tensor received into a CPU buffer: wait() also copies it over."""

    def __init__(self, work, buffer: torch.Tensor, tensor: torch.Tensor):
        self.work, self.buffer, self.tensor = work, buffer, tensor

    def wait(self, *args, **kwargs):
        result = self.work.wait(*args, **kwargs)
        self.tensor.copy_(self.buffer)
        return result

    def is_completed(self):
        return self.work.is_completed()


def stage_point_to_point_through_cpu() -> None:
    """Point-to-point of CUDA tensors through CPU buffers, for ranks that share one GPU over gloo.

    Gloo has CUDA all-reduce, broadcast and all-gather but no CUDA send/recv: on the H100 every
    pipeline test hung in DeepSpeed's first stage-to-stage handshake (rank 0's send of a CUDA
    tensor never completed), and NCCL refuses two ranks on one GPU. DeepSpeed's comm layer looks
    torch.distributed.send/recv/isend/irecv up at each call, so replacing them here moves only the
    bytes between stages through the CPU; the stages' compute stays on the GPU."""
    import torch.distributed as dist

    if getattr(dist.send, "stages_through_cpu", False):
        return
    send, recv, isend, irecv = dist.send, dist.recv, dist.isend, dist.irecv

    def cpu_send(tensor, *args, **kwargs):
        return send(tensor.cpu() if tensor.is_cuda else tensor, *args, **kwargs)

    def cpu_isend(tensor, *args, **kwargs):
        return isend(tensor.cpu() if tensor.is_cuda else tensor, *args, **kwargs)

    def cpu_recv(tensor, *args, **kwargs):
        if not tensor.is_cuda:
            return recv(tensor, *args, **kwargs)
        buffer = torch.empty_like(tensor, device="cpu")
        source = recv(buffer, *args, **kwargs)
        tensor.copy_(buffer)
        return source

    def cpu_irecv(tensor, *args, **kwargs):
        if not tensor.is_cuda:
            return irecv(tensor, *args, **kwargs)
        buffer = torch.empty_like(tensor, device="cpu")
        return _CopyBackWork(irecv(buffer, *args, **kwargs), buffer, tensor)

    for name, fn in (("send", cpu_send), ("recv", cpu_recv), ("isend", cpu_isend), ("irecv", cpu_irecv)):
        fn.stages_through_cpu = True
        setattr(dist, name, fn)


def enter_test_device() -> None:
    """Called once per process (conftest, harness workers); a no-op without the variable."""
    device = test_device()
    if device is None:
        return
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        stage_point_to_point_through_cpu()
        device = f"cuda:{torch.cuda.current_device()}"
    DeviceFactories(device).__enter__()  # for the life of the process
