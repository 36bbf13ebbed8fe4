"""Pretrain a GPT: parse Megatron-LM-named flags into one validated config, then train.

Launch with torchrun, the deepspeed launcher or srun; see README.md.
"""
import json
import sys

from megatron_lite.arguments import is_rank_zero_from_environment, parse_args_or_exit


def main(argv=None) -> None:
    config = parse_args_or_exit(argv)
    if is_rank_zero_from_environment():
        print(json.dumps(config.to_dict(), indent=1, sort_keys=True), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
