"""Peak memory of `convert_checkpoint.py import-hf` on a ~110M-parameter Llama-shaped model, against the
bound it promises (1.5 x the largest output file + the largest tensor) and against reading the whole
model (safetensors' load_file, what an importer that is not streaming holds) and reading the largest tensor
alone (this importer's read, checkpoint/hf_folder.py), measured in the same run.

Each measurement is its own process. Its memory is the rise of its peak RSS (VmHWM, reset through
/proc/self/clear_refs once the imports are done) over its RSS at that moment, so the interpreter, torch
and DeepSpeed, the same in every process, are left out; so is the code import_hf loads lazily (a first
import of a tiny model in the same process loads it).

    python benchmarks/bench_import_hf.py                  # 10 layers, hidden 768, GQA 12/4, vocabulary 32000, untied
    python benchmarks/bench_import_hf.py --num-layers 2   # a quick check
    python benchmarks/bench_import_hf.py --num-experts 8 --num-layers 4   # a Mixtral: its experts are the largest
                                                                          # tensors (one [E, 2F, h] stack per layer)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _measure(action) -> dict:
    """Run `action` with the peak RSS reset first: the rise of the peak over the RSS at the start."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    start_rss = _status("VmRSS")
    start = time.perf_counter()
    action()
    return {"seconds": time.perf_counter() - start, "peak_rise_bytes": _status("VmHWM") - start_rss}


def child(args) -> None:
    import torch  # noqa: F401 - imported before the measurement, as every process has it

    if args.child == "import":
        from megatron_lite.checkpoint.hf_import import import_hf as import_with
        from megatron_lite.validation import validate

        def import_hf(source, output, tp, pp, log):
            return import_with(source, output, tp, pp, lambda config: validate(config, 1)[0], log=log)

        # A first import of a tiny model loads the code import_hf pulls in lazily (validation, DeepSpeed's
        # pieces): the same for any model, so it is left out of the measurement like the interpreter is.
        import_hf(args.warm_up, args.output + "_warm_up", args.tp, 1, log=lambda line: None)
        result = _measure(lambda: import_hf(args.input, args.output, args.tp, 1, log=lambda line: None))
    elif args.child == "load_file":
        from safetensors.torch import load_file

        # What an importer that is not streaming holds: every tensor in memory (fp32, read from the map).
        result = _measure(lambda: {k: t.clone() for k, t in load_file(os.path.join(args.input,
                                                                                 "model.safetensors")).items()})
    else:
        from megatron_lite.checkpoint.hf_folder import WeightFiles

        files = WeightFiles(args.input)
        # the embedding is the largest tensor (vocabulary x hidden): the cost of reading it alone
        result = _measure(lambda: files.read("model.embed_tokens.weight"))
    print(json.dumps(result))


def run_child(*argv) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], capture_output=True, text=True,
                         cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def make_model(folder: str, args, hidden_size=None, vocab_size=None, num_layers=None) -> dict:
    import torch
    import transformers

    hidden = hidden_size or args.hidden_size
    fields = dict(vocab_size=vocab_size or args.vocab_size, hidden_size=hidden, intermediate_size=args.ffn_hidden_size,
                  num_hidden_layers=num_layers or args.num_layers, num_attention_heads=hidden // 64,
                  num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    if args.num_experts:  # save_pretrained writes one tensor per expert; in memory (and in our files) a stack
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **fields, num_local_experts=args.num_experts, num_experts_per_tok=2))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    model.save_pretrained(folder)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return {"parameters": sum(p.numel() for p in model.parameters()), "bytes": sum(sizes), "largest_tensor": max(sizes)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-layers", type=int, default=10)
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--ffn-hidden-size", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--num-experts", type=int, default=0, help="a MixtralForCausalLM with this many experts per layer "
                                                               "(default 0: a LlamaForCausalLM)")
    p.add_argument("--rounds", type=int, default=2, help="measurements of each kind, interleaved")
    p.add_argument("--child", choices=("import", "load_file", "read_largest"), help=argparse.SUPPRESS)
    p.add_argument("--input", help=argparse.SUPPRESS)
    p.add_argument("--output", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--warm-up", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    mib = 2 ** 20
    with tempfile.TemporaryDirectory() as root:
        hf = os.path.join(root, "hf")
        model = make_model(hf, args)
        warm_up = os.path.join(root, "tiny")
        make_model(warm_up, args, hidden_size=256, vocab_size=512, num_layers=1)
        print(f"model: {model['parameters']:,} parameters, {model['bytes'] / mib:.0f} MiB fp32, largest tensor "
              f"{model['largest_tensor'] / mib:.0f} MiB")
        rows = {}
        for round_ in range(args.rounds):
            for kind, tp in (("load_file", 1), ("read_largest", 1), ("import", 1), ("import", 2)):
                out = os.path.join(root, f"ckpt_{kind}_{tp}_{round_}")
                r = run_child("--child", kind, "--input", hf, "--output", out, "--tp", str(tp), "--warm-up", warm_up)
                if kind == "import":
                    tag = os.path.join(out, "iter_0000000")
                    r["largest_file"] = max(os.path.getsize(os.path.join(tag, f)) for f in os.listdir(tag)
                                            if f.startswith("layer_"))
                rows.setdefault((kind, tp), []).append(r)
        report = {"model": model, "rows": []}
        for (kind, tp), runs in rows.items():
            peak = max(r["peak_rise_bytes"] for r in runs)
            row = {"kind": kind, "tp": tp, "peak_rise_bytes": peak, "seconds": min(r["seconds"] for r in runs)}
            line = f"{kind:9s} TP {tp}: peak rise {peak / mib:6.0f} MiB, {row['seconds']:.1f}s"
            if kind == "import":
                bound = 1.5 * runs[0]["largest_file"] + model["largest_tensor"]
                row.update(largest_file=runs[0]["largest_file"], bound_bytes=bound, ratio_to_bound=peak / bound)
                line += (f" | largest output file {runs[0]['largest_file'] / mib:.0f} MiB, bound 1.5 x file + tensor "
                         f"{bound / mib:.0f} MiB: {peak / bound:.2f} of it; {peak / model['bytes']:.2f} of the model")
            else:
                line += f" | {peak / model['bytes']:.2f} of the model"
            print(line)
            report["rows"].append(row)
        print(json.dumps(report))


if __name__ == "__main__":
    main()
