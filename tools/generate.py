#!/usr/bin/env python3
"""Sample text from a checkpoint (a --save folder of any TP x PP layout, or a merged .pt file).

    generate.py --load ckpt --prompt "def main(" --max-new-tokens 64 --temperature 0.8 --top-p 0.9 --seed 1

Runs the dense model in this one process (CPU, fp32) with a KV cache;
--temperature 0 (the default) is greedy. Prints the prompt and its
continuation, then one summary line with the token count and tokens/s.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Torch-free imports only up here: --help, a bad flag and a missing --load are refused before torch starts.
from megatron_lite.checkpoint.format import CheckpointError, resolve_tag  # noqa: E402
from megatron_lite.checkpoint.tokenizer import (  # noqa: E402
    add_tokenizer_flags, check_tokenizer_flags, checkpoint_tokenizer, given_tokenizer,
)
from megatron_lite.flag_numbers import add_number  # noqa: E402
from megatron_lite.validation.saved_config import checkpoint_config, saved_config  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="generate.py", description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="--save folder of a run, or a file from convert_checkpoint.py merge")
    add_number(p, "--iteration", minimum=0, default=None, example=1000,
               help="which iter_XXXXXXX of a folder (default: latest)")
    p.add_argument("--prompt", required=True, help="text to continue")
    add_number(p, "--max-new-tokens", minimum=1, maximum=1 << 20, default=64)
    add_number(p, "--temperature", kind=float, minimum=0, maximum=100, default=0.0, example=0.8,
               help="0 = greedy (default); higher = more random")
    add_number(p, "--top-k", minimum=0, default=0, help="sample among the k most likely tokens (0 = all)")
    add_number(p, "--top-p", kind=float, above=0, maximum=1, default=1.0,
               help="sample among the most likely tokens whose probabilities sum to p (1.0 = all)")
    add_number(p, "--seed", minimum=0, default=1234)
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence for every token")
    p.add_argument("--no-stop-at-eod", action="store_true", help="keep going after the end-of-document token")
    add_tokenizer_flags(p, "the one the checkpoint records, which for a model imported without tokenizer files "
                           "is NullTokenizer: ids as text")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:  # the tokenizer flags' own checks, and for a folder the reader's first ones (its tag, the model it records,
        # checked as pretrain_gpt.py checks its flags), made before torch is imported
        check_tokenizer_flags(given_tokenizer(args))
        if not os.path.isfile(args.load):
            checkpoint_config(args.load, resolve_tag(args.load, args.iteration))
    except CheckpointError as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    from megatron_lite.training.console import select_accelerator

    select_accelerator()  # before DeepSpeed's first import: it would warn that it found no GPU
    import torch

    from megatron_lite.checkpoint.dense import load_dense_model
    from megatron_lite.inference.generation import SamplingOptions, generate
    from megatron_lite.inference.prompt import prompt_ids

    try:
        config, model = load_dense_model(args.load, args.iteration, check_merged=saved_config)
        _, tokenizer = checkpoint_tokenizer(config, given_tokenizer(args), f"the model in {args.load}")
        prompt = prompt_ids(tokenizer, args.prompt)
        options = SamplingOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed, use_kv_cache=not args.no_kv_cache,
                                  stop_token=None if args.no_stop_at_eod else tokenizer.eod)
        torch.set_grad_enabled(False)
        start = time.time()
        new = generate(model, config, prompt, options)
        seconds = time.time() - start
    except (CheckpointError, ValueError, OSError) as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    print(tokenizer.detokenize(list(prompt) + new))
    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}"
    print(f"generated {len(new)} tokens after a {len(prompt)}-token prompt in {seconds:.2f}s, "
          f"{len(new) / max(seconds, 1e-9):.1f} tokens/s ({mode}, seed {args.seed}, "
          f"{'no ' if args.no_kv_cache else ''}KV cache)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
