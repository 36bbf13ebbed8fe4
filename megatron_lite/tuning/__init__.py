"""Memory estimates and the TP/PP/micro-batch/gas tuning recipe."""
