"""megatron_lite: Megatron-style 3D-parallel GPT pretraining on PyTorch and DeepSpeed."""

__version__ = "0.1.0"
