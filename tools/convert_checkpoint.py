#!/usr/bin/env python3
"""Convert a megatron_lite checkpoint: merge it into one file, reshard it, export it to Hugging Face, or import one.

    convert_checkpoint.py merge     --load ckpt [--iteration N] --output model.pt [--strip-vocab-padding]
    convert_checkpoint.py reshard   --load ckpt --save ckpt_tp1pp4 --target-tensor-model-parallel-size 1 \\
                                    --target-pipeline-model-parallel-size 4 [--no-optimizer]
    convert_checkpoint.py universal --load ckpt --save ckpt_universal
    convert_checkpoint.py export-hf --load ckpt --output hf_model/ [--dtype bfloat16]
    convert_checkpoint.py import-hf --input hf_model/ --output ckpt --target-tensor-model-parallel-size 2 \
                                    --target-pipeline-model-parallel-size 2

A bad checkpoint or flag is one line on stderr and exit 2; nothing is left at the target.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Torch-free imports only up here: --help, a bad flag and a missing path are refused before torch starts.
from megatron_lite.atomic import WriteError  # noqa: E402
from megatron_lite.checkpoint import preflight  # noqa: E402
from megatron_lite.checkpoint.format import CheckpointError, resolve_tag  # noqa: E402
from megatron_lite.checkpoint.tokenizer import (  # noqa: E402
    add_tokenizer_flags, check_tokenizer_flags, checkpoint_tokenizer, given_tokenizer, recorded_tokenizer,
)
from megatron_lite.flag_numbers import add_number  # noqa: E402
from megatron_lite.targets import OVERWRITE_HELP  # noqa: E402
from megatron_lite.validation.saved_config import checkpoint_config  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convert_checkpoint.py", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def source(p):
        p.add_argument("--load", required=True, help="the --save folder of a pretrain_gpt.py run")
        add_number(p, "--iteration", minimum=0, example=1000, default=None,
                   help="which iter_XXXXXXX to read (default: latest)")

    def overwrite(p):
        p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP + "; never the source")

    p = sub.add_parser("merge", help="all TP/PP shards -> one fp32 state dict of the dense GPTModel")
    source(p)
    p.add_argument("--output", required=True, help="file to write, e.g. model.pt")
    overwrite(p)
    p.add_argument("--strip-vocab-padding", action="store_true",
                   help="drop the rows the vocabulary was padded with for TP (--make-vocab-size-divisible-by); the "
                        "saved config then has padded_vocab_size = vocab_size. Default: keep them, so the tensors "
                        "have the shapes training used")

    p = sub.add_parser("reshard", help="rewrite for another TP x PP layout; --load under it continues training")
    source(p)
    p.add_argument("--save", required=True, help="new folder to write")
    overwrite(p)
    add_number(p, "--target-tensor-model-parallel-size", minimum=1, required=True, example=2)
    add_number(p, "--target-pipeline-model-parallel-size", minimum=1, required=True, example=2)
    p.add_argument("--target-pipeline-partition-method", default=None,
                   help="the --pipeline-partition-method the resumed run will use (default: the source's; cost if "
                        "the source gave explicit layer counts)")
    p.add_argument("--no-optimizer", action="store_true",
                   help="leave out the Adam moments (the resumed run starts them fresh)")

    p = sub.add_parser("universal", help="the layout-free form (per parameter: fp32 weight, Adam moments, step; "
                                         "the run state), which pretrain_gpt.py --load takes under any layout")
    source(p)
    p.add_argument("--save", required=True, help="new folder to write")
    overwrite(p)

    p = sub.add_parser("export-hf", help="Hugging Face folder (config.json, model.safetensors, the tokenizer's files): "
                                         "GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM or Qwen3ForCausalLM; "
                                         "with experts MixtralForCausalLM, Qwen2MoeForCausalLM or Qwen3MoeForCausalLM; "
                                         "with --multi-latent-attention DeepseekV3ForCausalLM (its multi-token "
                                         "prediction layers too); with DeepSeek-V3's router and shared expert and "
                                         "grouped-query attention Glm4MoeForCausalLM; with attention sinks "
                                         "GptOssForCausalLM; what the architecture cannot hold is refused")
    source(p)
    p.add_argument("--output", required=True, help="folder to write (new or empty)")
    overwrite(p)
    add_tokenizer_flags(p, "the one training used, its files copied alongside; a NullTokenizer model has none, "
                           "unless named here")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the written tensors (default: float32, the trained fp32 masters)")

    p = sub.add_parser("import-hf", help="Hugging Face GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM, "
                                         "MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM or "
                                         "DeepseekV3ForCausalLM (DeepSeek-V3's and Kimi K2's fp8 release read "
                                         "dequantized), Glm4MoeForCausalLM or GptOssForCausalLM (its MXFP4 "
                                         "release read dequantized) folder "
                                         "-> a checkpoint of ours at iteration 0 under any TP x PP (x EP); train it with "
                                         "pretrain_gpt.py --load CKPT --use-checkpoint-args")
    p.add_argument("--input", required=True, help="the Hugging Face folder (config.json and safetensors, as "
                                                  "save_pretrained writes; pytorch_model.bin is read without "
                                                  "running any code)")
    p.add_argument("--output", required=True, help="new checkpoint folder to write")
    overwrite(p)
    add_number(p, "--target-tensor-model-parallel-size", minimum=1, default=1)
    add_number(p, "--target-pipeline-model-parallel-size", minimum=1, default=1)
    add_number(p, "--target-expert-model-parallel-size", minimum=1, default=1,
               help="the --expert-model-parallel-size the training run will use (MoE models; it must divide the "
                    "experts)")
    p.add_argument("--target-pipeline-partition-method", default=None,
                   help="the --pipeline-partition-method the training run will use (default: cost)")
    add_number(p, "--seq-length", minimum=1, example=2048, default=None,
                   help="sequence length recorded in the checkpoint's config (default: the model's maximum "
                        "positions); training chooses its own with --seq-length")
    add_tokenizer_flags(p, "none, recorded as NullTokenizer: ids as text")
    return parser


def refuse_early(args) -> None:
    """The command's own first checks, in its order (target, then source), before torch is imported."""
    if args.command == "merge":
        preflight.refuse_existing_file(args.output, args.overwrite, args.load)
    elif args.command in ("reshard", "universal"):
        preflight.refuse_target("--save", args.save, args.overwrite, args.load)
    elif args.command == "export-hf":
        preflight.refuse_filled_folder(args.output, args.overwrite, args.load)
    else:
        preflight.refuse_target("--output", args.output, args.overwrite, args.input, "--input")
        preflight.hf_config_path(args.input)
        check_tokenizer_flags(given_tokenizer(args))
        return
    if args.command == "export-hf":
        check_tokenizer_flags(given_tokenizer(args))
    # The model the checkpoint records, checked as pretrain_gpt.py checks its flags (validation/saved_config.py).
    _, saved = checkpoint_config(args.load, resolve_tag(args.load, args.iteration))
    if args.command == "export-hf":  # the files to copy: given ones checked against the model's vocabulary as
        # generate.py and evaluate.py check them (before, a NullTokenizer model's were dropped), recorded ones there
        model, given, args.tokenizer = f"the model in {args.load}", given_tokenizer(args), None
        if given:
            args.tokenizer, _ = checkpoint_tokenizer(saved, given, model)
        else:
            recorded_tokenizer(saved, model)
    if args.command == "reshard":
        preflight.refuse_target_sizes(saved.model.num_attention_heads, saved.model.num_layers,
                                      args.target_tensor_model_parallel_size, args.target_pipeline_model_parallel_size)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        refuse_early(args)
        from megatron_lite.training.console import select_accelerator

        select_accelerator()  # before DeepSpeed's first import: it would warn that it found no GPU
        # torch and DeepSpeed start outside the time printed
        from megatron_lite.deepspeed_compat import checkpoint_files  # noqa: F401

        start = time.time()
        if args.command == "merge":
            from megatron_lite.checkpoint.merge import merge

            r = merge(args.load, args.output, args.iteration, args.strip_vocab_padding, args.overwrite)
            print(f"merged {args.load}/{r['tag']} (TP={r['tp']}, PP={r['pp']}) into {args.output}: {r['tensors']} "
                  f"tensors, {r['parameters']:,} parameters, vocabulary rows {r['padded_vocab_size']}, fp32, "
                  f"{time.time() - start:.1f}s")
        elif args.command == "reshard":
            from megatron_lite.checkpoint.reshard import reshard

            r = reshard(args.load, args.save, args.target_tensor_model_parallel_size,
                        args.target_pipeline_model_parallel_size, args.iteration, args.no_optimizer,
                        args.target_pipeline_partition_method, overwrite=args.overwrite)
            before, after = r["padded_vocab"]
            notes = ["Adam moments" if r["optimizer"] else "no Adam moments (--no-optimizer)",
                     "RNG" if r["rng"] else "RNG reseeded (layout changed)"]
            if before != after:
                notes.append(f"vocabulary rows {before} -> {after}")
            print(f"resharded {args.load}/{r['tag']} TP={r['source'][0]}, PP={r['source'][1]} -> {args.save} "
                  f"TP={r['target'][0]}, PP={r['target'][1]} (--pipeline-partition-method {r['partition_method']}): "
                  f"weights, LR schedule, iteration, {', '.join(notes)}, {time.time() - start:.1f}s")
        elif args.command == "universal":
            from megatron_lite.checkpoint.reshard import universal

            r = universal(args.load, args.save, args.iteration, args.overwrite)
            tp, pp, dp = r["source"]
            zero, precision = r["storage"]
            print(f"wrote the layout-free form of {args.load}/{r['tag']} (TP={tp}, PP={pp}, DP={dp}, ZeRO {zero}, "
                  f"{precision}) to {args.save}: {r['parameters']:,} parameters with fp32 weights, Adam moments and "
                  f"step; --load it under any layout; {time.time() - start:.1f}s")
        elif args.command == "import-hf":
            from megatron_lite.checkpoint.hf_import import import_hf
            from megatron_lite.validation import validate

            r = import_hf(args.input, args.output, args.target_tensor_model_parallel_size,
                          args.target_pipeline_model_parallel_size, lambda config: validate(config, 1)[0],
                          args.target_pipeline_partition_method, args.seq_length, overwrite=args.overwrite,
                          ep=args.target_expert_model_parallel_size, tokenizer=given_tokenizer(args))
            for note in r["notes"]:
                print(note)
            vocab, padded = r["vocab"]
            print(f"imported {args.input} ({r['architecture']}, {r['parameters']:,} parameters, vocabulary {vocab} "
                  f"padded to {padded}) into {args.output}/{r['tag']} at TP={r['target'][0]}, PP={r['target'][1]}"
                  + (f", EP={r['target'][2]}" if r['target'][2] > 1 else "") + ": "
                  f"fp32 weights, no optimizer state; train it with --load {args.output} --use-checkpoint-args; "
                  f"{time.time() - start:.1f}s")
        else:
            from megatron_lite.checkpoint.hf_export import export_hf

            r = export_hf(args.load, args.output, args.iteration, args.tokenizer, args.dtype, args.overwrite)
            print(f"exported {args.load}/{r['tag']} to {args.output} as {r['architecture']}: {r['parameters']:,} "
                  f"parameters, vocabulary {r['vocab_size']}, files {', '.join(r['files'])}, {time.time() - start:.1f}s")
    except CheckpointError as e:
        print(f"convert_checkpoint.py {args.command}: error: {e}", file=sys.stderr)
        return 2
    except WriteError as e:
        print(f"convert_checkpoint.py {args.command}: error: {e}; nothing was written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
