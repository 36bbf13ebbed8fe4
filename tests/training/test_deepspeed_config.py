import json

import pytest

from megatron_lite.arguments import parse_args
from megatron_lite.config import ConfigError
from megatron_lite.deepspeed_config import deepspeed_config


def config_for(argv, world_size=4):
    return parse_args(argv, world_size=world_size)[0]


def test_batch_sizes_come_from_batching():
    cfg = config_for(["--micro-batch-size", "2", "--global-batch-size", "32", "--tensor-model-parallel-size", "2"])
    ds = deepspeed_config(cfg)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (32, 2, 8)
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 2


def test_precision_zero_and_clipping_are_translated():
    cfg = config_for(["--fp16", "--initial-loss-scale", "65536", "--loss-scale-window", "500", "--zero-stage", "1",
                      "--clip-grad", "0.5"])
    ds = deepspeed_config(cfg)
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 500,
                          "hysteresis": 2, "min_loss_scale": 1.0}
    assert ds["bf16"] == {"enabled": False}
    assert ds["zero_optimization"] == {"stage": 1}
    assert ds["gradient_clipping"] == 0.5
    ds = deepspeed_config(config_for(["--bf16", "--zero-stage", "2", "--cpu-offload"]))
    assert ds["bf16"] == {"enabled": True} and ds["fp16"] == {"enabled": False}
    assert ds["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert ds["zero_force_ds_cpu_optimizer"] is False  # else DeepSpeed refuses our torch AdamW under offload


def test_user_json_adds_keys_and_auto_takes_ours(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": "auto", "zero_optimization": {"stage": "auto",
                                "reduce_bucket_size": 1000}, "comms_logger": {"enabled": True},
                                "gradient_clipping": 1}))
    ds = deepspeed_config(config_for(["--deepspeed-config", str(path)]))
    assert ds["train_batch_size"] == 4
    assert ds["zero_optimization"] == {"stage": 0, "reduce_bucket_size": 1000}
    assert ds["comms_logger"] == {"enabled": True}
    assert ds["gradient_clipping"] == 0.0  # ZeRO 0 in fp32: ClippedAdamW clips, DeepSpeed must not


def test_deepspeed_clips_only_where_our_optimizer_cannot():
    assert deepspeed_config(config_for(["--clip-grad", "0.7"]))["gradient_clipping"] == 0.0
    assert deepspeed_config(config_for(["--clip-grad", "0.7", "--bf16"]))["gradient_clipping"] == 0.0
    assert deepspeed_config(config_for(["--clip-grad", "0.7", "--zero-stage", "1"]))["gradient_clipping"] == 0.7
    assert deepspeed_config(config_for(["--clip-grad", "0.7", "--fp16", "--zero-stage", "1"]))["gradient_clipping"] == 0.7


def test_contradiction_is_refused_by_validation_naming_both_values(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8}))
    with pytest.raises(ConfigError, match=rf'^--deepspeed-config {path}: "train_micro_batch_size_per_gpu" is 8 but '
                                          r"the command-line flags give 2; remove it"):
        config_for(["--micro-batch-size", "2", "--deepspeed-config", str(path)])
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    with pytest.raises(ConfigError, match=r'"zero_optimization.stage" is 2 but the command-line flags give 0'):
        config_for(["--deepspeed-config", str(path), "--pipeline-model-parallel-size", "2", "--num-layers", "2"])


def test_optimizer_in_user_json_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "Adam"}}))
    with pytest.raises(ConfigError, match=r'"optimizer" is set, but megatron_lite builds the optimizer'):
        config_for(["--deepspeed-config", str(path)])


def test_the_json_file_is_read_once_by_validation(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"comms_logger": {"enabled": True}}))
    cfg = config_for(["--deepspeed-config", str(path)])
    path.unlink()  # the engine builds its DeepSpeed config from what validation read
    assert deepspeed_config(cfg)["comms_logger"] == {"enabled": True}
