"""Multi-Token Prediction's flags (model/mtp.py): the depths need rotary positions (a depth predicts with the
embedding of a token ahead, and a learned position table would be looked up at the wrong positions: Megatron-LM
refuses it too), fewer depths than tokens, and the loss factor only with depths."""
from __future__ import annotations

from megatron_lite.config import Config, ConfigError


def check_mtp(config: Config) -> None:
    m = config.model
    if not m.mtp_num_layers:
        if m.mtp_loss_scaling_factor != 0.1:
            raise ConfigError(f"--mtp-loss-scaling-factor {m.mtp_loss_scaling_factor:g} weighs the Multi-Token "
                              f"Prediction depths' losses, and there are none; add --mtp-num-layers D, or drop it")
        return
    if m.position_embedding_type == "learned_absolute":
        raise ConfigError(f"--mtp-num-layers {m.mtp_num_layers} with --position-embedding-type learned_absolute: "
                          f"the depths embed tokens ahead without a position table; use --position-embedding-type "
                          f"rope (or yarn)", code="mtp_with_learned_positions")
    if m.mtp_num_layers >= m.seq_length:
        raise ConfigError(f"--mtp-num-layers {m.mtp_num_layers} looks {m.mtp_num_layers} tokens ahead of every "
                          f"position of a --seq-length {m.seq_length} sample, past its end; use fewer depths "
                          f"(DeepSeek-V3: 1)")
    if config.parallel.pipeline_partition_method == "profile":
        raise ConfigError("--pipeline-partition-method profile times each layer spec on hidden states alone, but "
                          "the Multi-Token Prediction depths read their tokens too; use --pipeline-partition-method "
                          "cost (the default) with --mtp-num-layers")
