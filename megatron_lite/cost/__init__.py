"""What a layout costs, from the config alone (and one measured profile): parameters and FLOPs, the
pipeline split's stage costs, activations, memory, Muon's step, pipeline efficiency. Read by validation,
metrics, tuning and benchmarks; above the network (model/), below training."""
