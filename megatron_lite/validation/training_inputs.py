"""What pretrain_gpt.py needs beyond a consistent config: the data, writable outputs, a device with the precision
asked for (training/loop.py calls it before any process group exists)."""
from __future__ import annotations

from megatron_lite.config import Config, ConfigError
from megatron_lite.validation.outputs import check_output_folders


def check_training_inputs(config: Config) -> None:
    """What training needs beyond a consistent config (the flags parse without data, for tools, and
    a config is planned for devices other than this one), checked before any process group exists."""
    if not config.data.data_path:
        raise ConfigError(
            "--data-path is required to train: the prefix of a .bin/.idx pair written by "
            "tools/preprocess_data.py, e.g. --data-path data/corpus_text_document (see scripts/quickstart.sh)"
        )
    check_output_folders(config)
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if config.precision.fp16 and not accelerator.is_fp16_supported():
        raise ConfigError(f"--fp16: this {accelerator.device_name()} device has no fp16 kernels (DeepSpeed refuses "
                          f"fp16 here); use --bf16, or train in fp32 without either flag")
    if config.precision.bf16 and not accelerator.is_bf16_supported():
        raise ConfigError(f"--bf16: this {accelerator.device_name()} device has no bf16 support; use --fp16 or fp32")
