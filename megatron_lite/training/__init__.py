"""DeepSpeed configuration, the training loop, checkpoints and metrics."""
