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

from megatron_lite.training.console import select_accelerator  # noqa: E402

select_accelerator()  # before DeepSpeed's first import: it would warn that it found no GPU

from megatron_lite.checkpoint.format import CheckpointError  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="generate.py", description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="--save folder of a run, or a file from convert_checkpoint.py merge")
    p.add_argument("--iteration", type=int, default=None, help="which iter_XXXXXXX of a folder (default: latest)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); higher = more random")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens whose "
                                                            "probabilities sum to p (1.0 = all)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence for every token")
    p.add_argument("--no-stop-at-eod", action="store_true", help="keep going after the end-of-document token")
    p.add_argument("--tokenizer-model", default=None, help="SentencePiece model (default: the one training used)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for flag, bad in (("--max-new-tokens", args.max_new_tokens < 1), ("--temperature", args.temperature < 0),
                      ("--top-k", args.top_k < 0), ("--top-p", not 0.0 < args.top_p <= 1.0)):
        if bad:
            print(f"generate.py: error: {flag} {getattr(args, flag[2:].replace('-', '_'))} is out of range "
                  f"(--max-new-tokens >= 1, --temperature >= 0, --top-k >= 0, 0 < --top-p <= 1)", file=sys.stderr)
            return 2
    import torch

    from megatron_lite.checkpoint.dense import load_dense_model
    from megatron_lite.data.tokenizer import build_tokenizer
    from megatron_lite.inference.generation import SamplingOptions, generate

    try:
        config, model = load_dense_model(args.load, args.iteration)
        tokenizer_model = args.tokenizer_model or config.data.tokenizer_model
        if config.data.tokenizer_type == "SentencePieceTokenizer" and not (tokenizer_model and
                                                                           os.path.isfile(tokenizer_model)):
            raise CheckpointError(f"the SentencePiece model {tokenizer_model} the run used is not there; "
                                  f"give --tokenizer-model PATH.model")
        tokenizer = build_tokenizer(config.data.tokenizer_type or "NullTokenizer", tokenizer_model,
                                    config.model.vocab_size)
        if tokenizer.vocab_size != config.model.vocab_size:
            raise CheckpointError(f"--tokenizer-model {tokenizer_model} has {tokenizer.vocab_size} pieces, but the "
                                  f"model in {args.load} was trained with a vocabulary of {config.model.vocab_size}; "
                                  f"give the tokenizer model the run used")
        prompt = tokenizer.tokenize(args.prompt)
        options = SamplingOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed, use_kv_cache=not args.no_kv_cache,
                                  stop_token=None if args.no_stop_at_eod else tokenizer.eod)
        torch.set_grad_enabled(False)
        start = time.time()
        new = generate(model, config, prompt, options)
        seconds = time.time() - start
    except (CheckpointError, ValueError) as e:
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
