"""Tensor parallelism on torch.distributed, and the TP/PP/DP topology shared with DeepSpeed."""
