"""Our single-process training step against what a single-machine user would pick instead.

Three trainers of the same GPT (4 layers, hidden 256, 8 heads, seq 256, micro batch 4,
vocabulary 2048, fp32, AdamW, clip 1.0, no dropout) in one process, timed in interleaved
rounds (each round: every trainer --iters steps in turn), at each --threads:

  ours      pretrain_gpt.py's stack: flags -> validate -> training.loop.setup (DeepSpeed pipeline
            engine at TP = PP = DP = 1, the DataLoader with --num-workers workers over an indexed
            dataset) -> per step what training.loop.pretrain does per iteration (train step,
            the stop/non-finite agreement, the log/evaluate/save checks)
  nanoGPT   karpathy/nanoGPT's model.py at a pinned commit, as its train.py drives it: get_batch
            from a memory-mapped .bin, model(X, Y), backward, clip_grad_norm_, its own AdamW groups
  HF        transformers' GPT2LMHeadModel (attn_implementation="sdpa", activation "gelu" as ours),
            model(input_ids, labels=...), backward, clip_grad_norm_, AdamW (no decay on 1-D)

--model llama times the Llama-family block instead (same sizes; SwiGLU with ffn 640, Megatron-LM's
default int(4 h 2/3 / 64) 64 for h = 256; RMSNorm; 2 query groups; no biases; untied head; RoPE base
500000 with Llama 3.1 scaling), two trainers:

  ours      pretrain_gpt.py's stack as above, with --swiglu --normalization RMSNorm
            --group-query-attention --num-query-groups 2 --disable-bias-linear
            --untie-embeddings-and-output-weights --position-embedding-type rope --use-rope-scaling
  HF        transformers' LlamaForCausalLM (attn_implementation="sdpa") of the same config
            (checkpoint/hf_llama.py's hf_config), driven as GPT2LMHeadModel is above

All read the same synthetic tokens (random ids made by tools/preprocess_data.py with the
NullTokenizer). The printed ratio is peer time / our time per round (above 1: ours is faster),
the median over rounds, with the rounds' min-max, and the minor page faults per step (a counter
that load does not move: each costs ~4.5 us on this VM). The last columns time the main thread's
CPU instead of the wall clock: at --threads 1 it does all the compute and, unlike the wall
clock, does not count time other processes held the core (our data worker runs in its own
process and is not counted: the wall-clock ratio is the result, this one a check under load). This VM drifts 10-25% within a minute, so
only same-round ratios mean anything; each round starts with the next trainer in turn.

--breakdown adds, in the same rounds, ours with --num-workers 0, our GPTModel in nanoGPT's plain
loop (no DeepSpeed, DataLoader or loop), our GPTModel under DeepSpeed's ordinary engine (ZeRO 0),
and our engine's time per pipeline instruction (forward, backward, reduce, optimizer, load, ...):
where the stack around the model spends its time.

nanoGPT's model.py is not part of this repository: it is downloaded at a pinned commit into
--cache-dir and checked against its SHA-256 (--nanogpt-model PATH or $NANOGPT_MODEL_PY gives a
local copy instead, checked the same way).

    python benchmarks/bench_single_peers.py                     # 1 and 2 threads
    python benchmarks/bench_single_peers.py --threads 2 --rounds 9 --num-workers 0
    python benchmarks/bench_single_peers.py --breakdown
    python benchmarks/bench_single_peers.py --model llama       # ours vs HF LlamaForCausalLM
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.util
import math
import os
import resource
import shutil
import sys
import time
import urllib.request
from statistics import median

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from synthetic_data import random_token_dataset  # noqa: E402

NANOGPT_COMMIT = "3adf61e154c3fe3fca428ad6bc3818b27a3b8291"
NANOGPT_URL = f"https://raw.githubusercontent.com/karpathy/nanoGPT/{NANOGPT_COMMIT}/model.py"
NANOGPT_SHA256 = "7c01703240dbec5d554527dc666e35b3df8391d0b117fddc07afcf325a21d11c"

LAYERS, HIDDEN, HEADS, SEQ, MICRO, VOCAB = 4, 256, 8, 256, 4, 2048
LR, CLIP, WEIGHT_DECAY = 1e-4, 1.0, 0.01
LLAMA_FFN, LLAMA_QUERY_GROUPS = 640, 2  # 640: what --swiglu gives h = 256 without --ffn-hidden-size
LLAMA_FLAGS = ["--swiglu", "--normalization", "RMSNorm", "--group-query-attention", "--num-query-groups",
               str(LLAMA_QUERY_GROUPS), "--disable-bias-linear", "--untie-embeddings-and-output-weights",
               "--position-embedding-type", "rope", "--use-rope-scaling", "--rotary-base", "500000",
               "--ffn-hidden-size", str(LLAMA_FFN)]


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def fetch_nanogpt(cache_dir: str, local: str | None = None) -> str:
    """Path of nanoGPT's model.py at NANOGPT_COMMIT in cache_dir: copied from `local`, or downloaded.
    Either way its SHA-256 must match the pinned one (the file is imported, i.e. executed)."""
    target = os.path.join(cache_dir, f"nanogpt-{NANOGPT_COMMIT[:8]}-model.py")
    if os.path.exists(target) and _sha256(target) == NANOGPT_SHA256:
        return target
    os.makedirs(cache_dir, exist_ok=True)
    partial = target + ".partial"
    if local:
        if not os.path.isfile(local):
            raise SystemExit(f"bench_single_peers.py: error: --nanogpt-model {local}: no such file; give nanoGPT's "
                             f"model.py at commit {NANOGPT_COMMIT[:8]}, or leave the flag out to download it")
        shutil.copyfile(local, partial)
        source = local
    else:
        try:
            with urllib.request.urlopen(NANOGPT_URL, timeout=30) as response, open(partial, "wb") as f:
                f.write(response.read())
        except OSError as e:
            raise SystemExit(f"bench_single_peers.py: error: could not download {NANOGPT_URL} ({e}); give a copy "
                             f"of model.py at commit {NANOGPT_COMMIT[:8]} with --nanogpt-model PATH") from None
        source = NANOGPT_URL
    digest = _sha256(partial)
    if digest != NANOGPT_SHA256:
        os.remove(partial)
        raise SystemExit(f"bench_single_peers.py: error: {source} has SHA-256 {digest}, not nanoGPT "
                         f"{NANOGPT_COMMIT[:8]}'s model.py ({NANOGPT_SHA256})")
    os.replace(partial, target)
    return target


def import_file(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic_dataset(cache_dir: str) -> str:
    return random_token_dataset(os.path.join(cache_dir, f"synthetic-v{VOCAB}"), VOCAB, 2_000_000)


def our_argv(data_prefix: str, cache_dir: str, num_workers: int | None, backend: str, model: str = "gpt") -> list:
    argv = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
            "--seq-length", str(SEQ), "--micro-batch-size", str(MICRO), "--global-batch-size", str(MICRO),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--data-path", data_prefix,
            "--data-cache-path", os.path.join(cache_dir, "indices"), "--split", "100,0,0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", str(LR), "--clip-grad", str(CLIP),
            "--weight-decay", str(WEIGHT_DECAY), "--lr-decay-style", "constant", "--attention-backend", backend,
            "--train-iters", "100000", "--log-interval", "1000000", "--eval-interval", "1000000",
            "--eval-iters", "0"]
    if num_workers is not None:
        argv += ["--num-workers", str(num_workers)]
    return argv + (LLAMA_FLAGS if model == "llama" else [])


def ours(args, data_prefix: str):
    """(step function, run) of our stack as pretrain_gpt.py builds it."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.training import loop

    config, _ = parse_args(our_argv(data_prefix, args.cache_dir, args.num_workers, args.attention_backend,
                                    args.model), world_size=1)
    run = loop.setup(config)
    return our_step(run), run


def our_step(run):
    from megatron_lite.training import loop

    def step():
        # What loop.pretrain does per iteration (log, evaluate and save are never due here).
        stats = loop.train_step(run)
        stop_signal, _ = loop.agree_over_ranks([run.exit_signal.received, not math.isfinite(stats.loss)], run.engine.device)
        loop.maybe_log(run, stats)
        loop.maybe_evaluate(run)
        loop.maybe_save_or_exit(run, stop_signal)
        return stats.loss
    return step


class MemmapBatches:
    """nanoGPT's train.py get_batch on CPU: random offsets into the token file, int64 tensors."""

    def __init__(self, data_prefix: str, seed: int):
        self.data = np.memmap(data_prefix + ".bin", dtype=np.uint16, mode="r")
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self):
        ix = torch.randint(len(self.data) - SEQ, (MICRO,), generator=self.generator)
        x = torch.stack([torch.from_numpy(self.data[i:i + SEQ].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(self.data[i + 1:i + 1 + SEQ].astype(np.int64)) for i in ix])
        return x, y


def nanogpt(args, data_prefix: str, compiled: bool = False):
    """nanoGPT's model and optimizer as its train.py builds them; compiled: with its compile=True (torch.compile of
    the whole model, --compile)."""
    module = import_file("nanogpt_model", fetch_nanogpt(args.cache_dir, args.nanogpt_model))
    torch.manual_seed(0)
    model = module.GPT(module.GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=LAYERS, n_head=HEADS,
                                        n_embd=HIDDEN, dropout=0.0, bias=True))
    optimizer = model.configure_optimizers(WEIGHT_DECAY, LR, (0.9, 0.999), "cpu")
    run = torch.compile(model) if compiled else model
    return plain_step(lambda x, y: run(x, y)[1], model, optimizer, MemmapBatches(data_prefix, seed=5 if compiled else 1))


def our_compiled_step(run):
    """--compile: the same engine's step with its transformer layers compiled (model/compile.py, as --compile
    does), and `ours` then switched back to eager layers: one model, one optimizer, both in the same rounds.
    The switch is torch's own: nn.Module.compile() keeps the compiled call in `_compiled_call_impl`."""
    from megatron_lite.model.compile import compile_layers
    from megatron_lite.model.transformer import TransformerLayer

    compile_layers(run.engine.module, "inductor")
    layers = [m for m in run.engine.module.modules() if isinstance(m, TransformerLayer)]
    compiled_calls = [layer._compiled_call_impl for layer in layers]
    step = our_step(run)

    def switched(on: bool):
        def run_step():
            for layer, call in zip(layers, compiled_calls):
                layer._compiled_call_impl = call if on else None
            return step()
        return run_step
    return switched(True), switched(False)


def huggingface(args, data_prefix: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron_lite.checkpoint.optimizer_groups import parameter_groups

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu",
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    model.train()
    optimizer = torch.optim.AdamW(parameter_groups(model.parameters(), WEIGHT_DECAY), lr=LR)
    # GPT2LMHeadModel shifts the labels inside
    return plain_step(lambda x, _: model(input_ids=x, labels=x).loss, model, optimizer,
                      MemmapBatches(data_prefix, seed=2))


def huggingface_llama(data_prefix: str, config):
    """--model llama: transformers' LlamaForCausalLM with our model's shape (hf_config of our ModelConfig)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_lite.checkpoint.hf_llama import hf_config
    from megatron_lite.checkpoint.optimizer_groups import parameter_groups

    torch.manual_seed(0)
    hf = LlamaConfig.from_dict(dict(hf_config(config.model), bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1))
    model = LlamaForCausalLM._from_config(hf, attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(parameter_groups(model.parameters(), WEIGHT_DECAY), lr=LR)
    # LlamaForCausalLM shifts the labels inside
    return plain_step(lambda x, _: model(input_ids=x, labels=x).loss, model, optimizer,
                      MemmapBatches(data_prefix, seed=2))


def plain_step(loss_of, model, optimizer, get_batch):
    """The training step a single-machine user writes: forward, backward, clip, AdamW."""
    def step():
        loss = loss_of(*get_batch())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


def our_model_plain_loop(args, data_prefix: str, config):
    """--breakdown only: our GPTModel (same layers, same loss) in nanoGPT's loop, without DeepSpeed,
    the DataLoader or the training loop: what the stack around the model costs."""
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.training.optimizer import build_optimizer

    torch.manual_seed(0)
    model = GPTModel(config)
    optimizer = build_optimizer(model, config.optimizer)
    position_ids, loss_mask = torch.arange(SEQ).expand(MICRO, SEQ), torch.ones(MICRO, SEQ)
    return plain_step(lambda x, y: model(x, position_ids, y, loss_mask), model, optimizer,
                      MemmapBatches(data_prefix, seed=3))


def our_model_plain_engine(data_prefix: str, config):
    """--breakdown only: our GPTModel under DeepSpeed's ordinary engine (ZeRO 0, no pipeline), the
    engine pretrain_gpt.py does not use at PP = 1 (its checkpoints are the pipeline engine's
    per-layer files): what the pipeline engine's instructions cost against it."""
    import deepspeed

    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel import state
    from megatron_lite.deepspeed_config import clips_in_optimizer, deepspeed_config
    from megatron_lite.training.optimizer import build_optimizer

    torch.manual_seed(0)
    model = GPTModel(config)
    optimizer = build_optimizer(model, config.optimizer, clip_in_optimizer=clips_in_optimizer(config))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, mpu=state.ModelParallelUnit(),
                                      config=deepspeed_config(config))
    get_batch = MemmapBatches(data_prefix, seed=4)
    position_ids, loss_mask = torch.arange(SEQ).expand(MICRO, SEQ), torch.ones(MICRO, SEQ)

    def step():
        x, y = get_batch()
        loss = engine(x, position_ids, y, loss_mask)
        engine.backward(loss)
        engine.step()
        return loss.item()
    return step


def timed(step, iters: int):
    """(seconds per step, this thread's CPU seconds per step, minor page faults per step) over `iters` steps."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start, cpu = time.perf_counter(), time.thread_time()
    for _ in range(iters):
        step()
    seconds, cpu = (time.perf_counter() - start) / iters, (time.thread_time() - cpu) / iters
    return seconds, cpu, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / iters


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch intra-op threads, in turn")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iters", type=int, default=4, help="steps per trainer per round")
    parser.add_argument("--warmup", type=int, default=3, help="steps per trainer before each thread count")
    parser.add_argument("--num-workers", type=int, default=None,
                        help="our DataLoader workers (default: pretrain_gpt.py's --num-workers default)")
    parser.add_argument("--attention-backend", default="auto", help="ours: pretrain_gpt.py's --attention-backend")
    parser.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                        help="gpt: GPT-2's block against nanoGPT and HF GPT2LMHeadModel; llama: the Llama-family "
                             "block against HF LlamaForCausalLM")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time our engine's instructions, ours with --num-workers 0, and our model in a "
                             "plain loop without DeepSpeed (in the same rounds)")
    parser.add_argument("--compile", action="store_true",
                        help="also time ours with --compile (the same engine, layers switched between compiled and "
                             "eager) and, for --model gpt, nanoGPT with its compile=True; ratios are then against ours "
                             "compiled, and each compiled trainer's first step (its compile) is printed")
    parser.add_argument("--cache-dir", default=os.path.join(REPO, "cache", "bench_single_peers"),
                        help="nanoGPT's model.py, the synthetic dataset and its sample indices")
    parser.add_argument("--nanogpt-model", default=os.environ.get("NANOGPT_MODEL_PY"),
                        help="a local copy of nanoGPT's model.py at the pinned commit (default: $NANOGPT_MODEL_PY, "
                             "else download)")
    args = parser.parse_args(argv)

    data_prefix = synthetic_dataset(args.cache_dir)
    ours_step, run = ours(args, data_prefix)
    steps = {"ours": ours_step}
    if args.compile:
        steps["ours, --compile"], steps["ours"] = our_compiled_step(run)
    if args.model == "llama":
        steps["HF LlamaForCausalLM"] = huggingface_llama(data_prefix, run.config)
    else:
        steps.update({"nanoGPT": nanogpt(args, data_prefix), "HF GPT2LMHeadModel": huggingface(args, data_prefix)})
        if args.compile:
            steps["nanoGPT, compile=True"] = nanogpt(args, data_prefix, compiled=True)
    baseline = "ours, --compile" if args.compile else "ours"
    timer = None
    if args.breakdown:
        from megatron_lite.data.sampler import build_data_iterator
        from megatron_lite.training.stage_timing import COLUMNS, StageTimer

        timer = StageTimer(run.engine.engine)
        # The same engine, fed by a DataLoader without workers.
        in_process = dataclasses.replace(run, train_iter=build_data_iterator(
            run.train_iter._dataset, 0, MICRO, 0, 1, num_workers=0))
        steps["ours, --num-workers 0"] = our_step(in_process)
        steps["our GPTModel, plain loop"] = our_model_plain_loop(args, data_prefix, run.config)
        steps["our GPTModel, DeepSpeed's plain engine"] = our_model_plain_engine(data_prefix, run.config)
    block = (f"Llama block (SwiGLU ffn {LLAMA_FFN}, RMSNorm, {LLAMA_QUERY_GROUPS} query groups, no biases, untied "
             f"head, RoPE with Llama 3.1 scaling)" if args.model == "llama" else "GPT-2 block")
    peers = ("LlamaForCausalLM (sdpa)" if args.model == "llama"
             else f"GPT2LMHeadModel (sdpa); nanoGPT {NANOGPT_COMMIT[:8]} model.py")
    print(f"# single-process training step, {block}: {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, seq {SEQ}, "
          f"micro batch {MICRO}, vocabulary {VOCAB}, fp32, AdamW, clip {CLIP}, no dropout\n"
          f"# ours: pretrain_gpt.py's stack, --attention-backend {args.attention_backend}, --num-workers "
          f"{run.config.data.num_workers}; transformers {__import__('transformers').__version__} {peers}; "
          f"torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start\n"
          f"# median over {args.rounds} interleaved rounds of {args.iters} steps each; ratio = its time / the time of "
          f"{baseline} (> 1: {baseline} faster)")
    print("| threads | trainer | ms/step (median) | tokens/s | ours vs it (median of rounds) | min-max of rounds "
          "| minor page faults/step | main-thread CPU ms/step | ours vs it, CPU time |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if "compile" in name and threads == args.threads[0]:
                print(f"# {name}: first step {time.perf_counter() - start:.1f} s (compiling; inductor's cache "
                      f"{os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'default')})", flush=True)
            for _ in range(args.warmup - 1):
                step()
        times = {name: [] for name in steps}
        cpu_times = {name: [] for name in steps}
        faults = {name: 0.0 for name in steps}
        if timer:
            timer.take(0.0)
        names = list(steps)
        for round_index in range(args.rounds):
            # Each round starts with the next trainer, so none always runs right after the same one.
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                step = steps[name]
                # The engine's instruction timer counts "ours" only (the variant shares its engine).
                with timer.paused() if timer and name != "ours" else contextlib.nullcontext():
                    seconds, cpu, step_faults = timed(step, args.iters)
                times[name].append(seconds)
                cpu_times[name].append(cpu)
                faults[name] += step_faults / args.rounds
        for name, seconds in times.items():
            ratios = [t / o for t, o in zip(seconds, times[baseline])]
            cpu_ratios = [t / o for t, o in zip(cpu_times[name], cpu_times[baseline])]
            print(f"| {threads} | {name} | {median(seconds) * 1e3:.1f} | {MICRO * SEQ / median(seconds):.0f} | "
                  f"{median(ratios):.3f} | {min(ratios):.3f}-{max(ratios):.3f} | {faults[name]:.0f} | "
                  f"{median(cpu_times[name]) * 1e3:.1f} | {median(cpu_ratios):.3f} |", flush=True)
        if timer:
            sums = timer.take(sum(times["ours"]) * args.iters)
            n = args.rounds * args.iters
            print(f"| {threads} | ours, per engine instruction (ms/step, mean) | "
                  + ", ".join(f"{c} {1e3 * sums.get(c, 0.0) / n:.2f}" for c in COLUMNS)
                  + f", step {1e3 * sums['step'] / n:.1f} | | | | | | |", flush=True)


if __name__ == "__main__":
    main()
