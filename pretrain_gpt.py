"""Pretrain a GPT: parse Megatron-LM-named flags into one validated config, then train.

Launch with torchrun, the deepspeed launcher or srun; see README.md.
"""
import sys

from megatron_lite.arguments import parse_args_or_exit
from megatron_lite.validation.machine_memory import refuse_unless_weights_fit


def main(argv=None) -> None:
    config = parse_args_or_exit(argv)
    refuse_unless_weights_fit(config)  # from the parameter arithmetic, before any allocation or process group
    from megatron_lite.training.watchdog import watching

    with watching(config):  # from here this rank's progress is watched, by a monitor local rank 0 starts
        # Imported after validation so a bad flag costs no torch/DeepSpeed start-up.
        from megatron_lite.training.console import select_accelerator

        select_accelerator()  # before DeepSpeed's first import
        from megatron_lite.training.loop import main as train

        train(config)


if __name__ == "__main__":
    from megatron_lite.process_end import run_then_end

    run_then_end(main, sys.argv[1:])  # not the interpreter's exit: its finalization can abort gloo's threads
