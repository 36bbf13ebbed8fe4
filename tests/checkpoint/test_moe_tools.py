"""The checkpoint tools and the inference paths on a Mixture-of-Experts checkpoint saved at EP 2, ZeRO 1: merge
and the layout-free form hold every expert by its global index, reshard and universal resume the uninterrupted
losses, generate and evaluate compute what the dense single-process model with the trained weights computes,
and export-hf refuses (no Hugging Face MoE mapping yet) instead of writing a model without its experts."""
import re

import numpy as np
import pytest
import torch

from tests.checkpoint.conftest import copy_checkpoint, edited_copy, error_line, run_tool
from tests.entry_points import run_entry
from tests.harness import run_distributed
from tests.model.gpt_layouts import global_batches, micro_batches, tiny_config
from tests.model.test_moe_parallel import MOE, SIGMOID_BIAS

STEPS, SAVE_AT = 4, 2
SOURCE = ("--zero-stage", "1", "--eval-iters", "2") + SIGMOID_BIAS
"""The saved run's: with the routers' expert bias, a buffer that layer files hold besides the parameters."""


def _train(tp, pp, dp, ep, extra, save=None, load=None):
    """Train STEPS steps (saving at SAVE_AT, or resuming from `load`): the losses, the resume note, and at
    SAVE_AT this rank's parameters by (layer spec, name) with its experts' global indices."""
    from megatron_lite.deepspeed_compat import checkpoint_files
    from megatron_lite.checkpoint.layout import ModelLayout
    from megatron_lite.parallel import state
    from megatron_lite.parallel.experts import is_expert_parameter, local_experts
    from megatron_lite.training import checkpointing
    from megatron_lite.training.engine import Engine

    flags = list(MOE) + list(extra) + ["--expert-model-parallel-size", str(ep), "--train-iters", str(STEPS),
                                       "--lr-warmup-iters", "1"]
    flags += (["--save", save] if save else []) + (["--load", load] if load else [])
    config = tiny_config(tp, pp, dp, flags)
    state.initialize(tp, pp, expert_model_parallel_size=ep)
    engine = Engine(config)
    start, note = 0, None
    if load:
        resumed = checkpointing.load(engine, config)
        start, note = resumed.iteration, resumed.note
    data = micro_batches(config, global_batches(config, STEPS)[start:], state.get_data_parallel_rank(), dp)
    losses, weights = {}, {}
    for iteration in range(start + 1, STEPS + 1):
        losses[iteration] = engine.train_step(data).loss
        if save and iteration == SAVE_AT:
            checkpointing.save(engine, config, iteration, iteration * config.batch.global_batch_size,
                               checkpointing.SaveFolder(lock=None, run_id="test"))
            layout = ModelLayout(config)
            for (owner, name), param in checkpoint_files.engine_parameters(engine.module).items():
                spec = layout.tied_spec[owner] if isinstance(owner, str) else owner
                experts = local_experts(config.model.num_experts) if is_expert_parameter(param) else None
                weights[(spec, name)] = (param.detach().clone(), experts)
            for name, buffer in engine.module.named_buffers():
                owner, inner = checkpoint_files.pipeline_parameter_owner(name)
                if inner in layout.buffers.get(owner, {}):
                    weights[(owner, inner)] = (buffer.clone(), None)
    return losses, note, weights


def _full_weights(per_rank):
    """The trained model's dense state dict (`layers.{spec}.{name}`) from every rank's tensors (TP 1): each
    expert by its global index, the rest as every rank holds it."""
    full, experts = {}, {}
    for _, _, weights in per_rank:
        for (spec, name), (tensor, indices) in weights.items():
            if indices is None:
                full[f"layers.{spec}.{name}"] = tensor
            for i, e in enumerate(indices or ()):
                experts.setdefault(f"layers.{spec}.{name}", {})[e] = tensor[i]
    for name, by_index in experts.items():
        assert sorted(by_index) == list(range(8)), (name, sorted(by_index))
        full[name] = torch.stack([by_index[e] for e in range(8)])
    return full


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """Trained at TP 1 x DP 2 with EP 2, ZeRO 1, saved at SAVE_AT; with a NullTokenizer dataset for evaluation."""
    from megatron_lite.data.indexed_dataset import IndexedDatasetWriter

    root = tmp_path_factory.mktemp("moe_tools")
    prefix = str(root / "tokens")
    rng = np.random.RandomState(0)
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for _ in range(100):
            writer.add_document(rng.randint(0, 127, size=rng.randint(20, 80)))
    ckpt = str(root / "ckpt")
    extra = SOURCE + ("--data-path", prefix, "--split", "50,50,0")
    per_rank = run_distributed(_train, 2, 1, 1, 2, 2, extra, ckpt)
    return {"ckpt": ckpt, "losses": per_rank[0][0], "weights": _full_weights(per_rank), "data": prefix}


def _dense_model(weights):
    """The single-process GPTModel (EP 1, every expert on this process) with the given dense weights."""
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    config = tiny_config(extra=MOE + SIGMOID_BIAS)
    model = GPTModel(config)
    model.load_state_dict(weights, strict=True)
    model_parallel_seed(config.training.seed, config.model.num_layers)
    return config, model.eval()


def _resumed_losses_match(resumed, full):
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert abs(loss - full[step]) <= 1e-5 * abs(full[step]), (step, loss, full[step])


def test_merge_of_an_ep2_checkpoint_holds_every_expert_of_the_trained_model_by_global_index(moe_run, tmp_path):
    from megatron_lite.checkpoint.merge import load_merged

    output = str(tmp_path / "model.pt")
    run_tool("tools/convert_checkpoint.py", "merge", "--load", moe_run["ckpt"], "--output", output)
    config, state, position = load_merged(output)
    assert position["iteration"] == SAVE_AT
    assert config.parallel.expert_model_parallel_size == 1  # the merged model is one process's
    assert sorted(state) == sorted(moe_run["weights"])
    assert state["layers.2.mlp.experts.weight1"].shape[0] == 8
    assert state["layers.2.mlp.router.expert_bias"].any()  # trained: a lost bias would read as zeros
    for name, trained in moe_run["weights"].items():
        assert torch.equal(state[name], trained), name


def test_universal_form_holds_every_expert_and_resumes_at_ep1_with_the_uninterrupted_losses(moe_run, tmp_path):
    from megatron_lite.checkpoint.format import read_latest, read_metadata
    from megatron_lite.checkpoint.layout_free import LayoutFreeReader

    target = str(tmp_path / "universal")
    run_tool("tools/convert_checkpoint.py", "universal", "--load", moe_run["ckpt"], "--save", target)
    tag = read_latest(target)
    states = LayoutFreeReader(f"{target}/{tag}", read_metadata(target, tag)).read()
    for (spec, name), state in states.items():
        assert torch.equal(state.fp32, moe_run["weights"][f"layers.{spec}.{name}"]), (spec, name)
        assert state.exp_avg.shape == state.fp32.shape and state.step == SAVE_AT
    buffers = LayoutFreeReader(f"{target}/{tag}", read_metadata(target, tag)).read_buffers()
    assert sorted(buffers) == [(spec, "mlp.router.expert_bias") for spec in (2, 3, 4)]
    for (spec, name), tensor in buffers.items():
        assert torch.equal(tensor, moe_run["weights"][f"layers.{spec}.{name}"]), (spec, name)
    resumed, note, _ = run_distributed(_train, 2, 1, 1, 2, 1, SOURCE, None, target)[0]
    _resumed_losses_match(resumed, moe_run["losses"])
    assert note.startswith("resharded TP 1 x PP 1 x DP 2 (EP 2) (ZeRO 1, fp32) -> TP 1 x PP 1 x DP 2 (ZeRO 1"), note


@pytest.mark.parametrize("tp, pp, dp, ep, zero", [(2, 1, 1, 1, "1"), (1, 2, 2, 2, "1"), (1, 2, 2, 1, "0")],
                         ids=["tp2-ep1", "pp2-ep2", "pp2-ep1-deepspeed-loads-it"])
def test_reshard_of_an_ep2_checkpoint_resumes_with_the_uninterrupted_losses(moe_run, tmp_path, tp, pp, dp, ep, zero):
    # The last case resumes at the layout the reshard wrote (fp32 ZeRO 0, EP 1): DeepSpeed's own loader reads
    # its plain AdamW state, whose groups must be the ones the run's optimizer has (the experts' own group).
    target = str(tmp_path / "resharded")
    result = run_tool("tools/convert_checkpoint.py", "reshard", "--load", moe_run["ckpt"], "--save", target,
                      "--target-tensor-model-parallel-size", str(tp), "--target-pipeline-model-parallel-size", str(pp))
    assert f"-> {target} TP={tp}, PP={pp}" in result.stdout
    resumed, note, _ = run_distributed(_train, tp * pp * dp, tp, pp, dp, ep, ("--zero-stage", zero) + SIGMOID_BIAS,
                                       None, target)[0]
    _resumed_losses_match(resumed, moe_run["losses"])
    assert (note is None) == (zero == "0"), note  # None: DeepSpeed's own load, not the layout-free path


def test_reshard_refuses_a_tensor_parallel_size_that_does_not_divide_the_experts():
    from megatron_lite.checkpoint.format import CheckpointError
    from megatron_lite.checkpoint.reshard import target_config

    # 8 heads and --ffn-hidden-size 128 split over TP 8; the experts' 36 columns do not
    source = tiny_config(extra=MOE + ("--num-attention-heads", "8", "--moe-ffn-hidden-size", "36"))
    with pytest.raises(CheckpointError) as refused:
        target_config(source, 8, 1, None)
    assert str(refused.value) == ("--target-tensor-model-parallel-size 8 does not divide the model's "
                                  "--moe-ffn-hidden-size 36: each expert is split over TP like the dense MLP; use a "
                                  "TP size that divides it, e.g. 2 or 4")
    assert target_config(source, 4, 1, None).parallel.tensor_model_parallel_size == 4


@pytest.fixture(scope="module")
def zero0_runs(tmp_path_factory):
    """EP -> (checkpoint, losses) of an fp32 ZeRO 0 run at DP 2: its optimizer state is one plain AdamW file,
    written by DP rank 0, with the experts in groups of their own after the rest. (At EP > 1 validation refuses
    such a --save: DP rank 0 holds 1/EP of the experts.)"""
    root = tmp_path_factory.mktemp("moe_zero0")
    runs = {}
    for ep in (1,):
        ckpt = str(root / f"ep{ep}")
        runs[ep] = ckpt, run_distributed(_train, 2, 1, 1, 2, ep, ("--zero-stage", "0"), ckpt)[0][0]
    return runs


def test_a_zero0_moe_checkpoint_resumes_at_ep2_through_its_universal_form_with_the_uninterrupted_losses(zero0_runs,
                                                                                                      tmp_path):
    ckpt, full = zero0_runs[1]
    target = str(tmp_path / "universal")
    run_tool("tools/convert_checkpoint.py", "universal", "--load", ckpt, "--save", target)
    resumed, note, _ = run_distributed(_train, 2, 1, 1, 2, 2, ("--zero-stage", "1"), None, target)[0]
    _resumed_losses_match(resumed, full)
    assert note.startswith("resharded TP 1 x PP 1 x DP 2 (ZeRO 0, fp32) -> TP 1 x PP 1 x DP 2 (EP 2) (ZeRO 1"), note


def test_export_hf_refuses_an_moe_checkpoint_no_hugging_face_architecture_holds(moe_run, tmp_path):
    """This run's router scores by sigmoid with an expert bias beside a shared expert (DeepSeek-V3's, on
    grouped-query attention: GLM-4.5's), but its shared expert (64) is not a whole number of experts (48), which
    Glm4MoeForCausalLM's n_shared_experts x moe_intermediate_size needs: refused naming the flag, nothing written
    (tests/checkpoint/test_import_hf_moe.py and test_import_hf_glm4_moe.py export the ones they hold)."""
    result = run_tool("tools/convert_checkpoint.py", "export-hf", "--load", moe_run["ckpt"], "--output",
                      str(tmp_path / "hf"), check=False)
    line = error_line(result)
    assert "Glm4MoeForCausalLM" in line and "--moe-shared-expert-intermediate-size 64" in line, line
    assert not (tmp_path / "hf").exists()


def test_generate_from_an_ep2_checkpoint_gives_the_dense_models_greedy_tokens(moe_run):
    config, model = _dense_model(moe_run["weights"])
    prompt, new = [5, 17, 42, 99, 3], 12
    tokens = torch.tensor([prompt])
    with torch.no_grad():  # greedy by recomputing the whole sequence for every token, no KV cache
        for _ in range(new):
            positions = torch.arange(tokens.shape[1]).unsqueeze(0)
            logits = model(tokens, positions)[:, -1, :config.model.vocab_size]
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    expected = " ".join(map(str, tokens[0].tolist()))
    for cache in ((), ("--no-kv-cache",)):
        result = run_tool("tools/generate.py", "--load", moe_run["ckpt"], "--prompt", " ".join(map(str, prompt)),
                          "--max-new-tokens", str(new), "--no-stop-at-eod", *cache)
        assert result.stdout.strip().splitlines()[-1] == expected, (cache, result.stdout[-500:], expected)


@pytest.mark.parametrize("nproc, extra", [(1, ()), (2, ("--expert-model-parallel-size", "2"))], ids=["ep1", "ep2"])
def test_evaluate_an_ep2_checkpoint_gives_the_dense_models_loss_on_the_same_samples(moe_run, nproc, extra):
    from megatron_lite.config import parse_data_path, parse_split
    from megatron_lite.inference.evaluation import evaluation_samples

    split = "50,50,0"
    samples = evaluation_samples(moe_run["ckpt"], parse_data_path([moe_run["data"]]), parse_split(split))
    config, model = _dense_model(moe_run["weights"])
    batch = config.batch.global_batch_size
    losses = []
    with torch.no_grad():
        for i in range(0, len(samples), batch):
            rows = samples[i:i + batch]
            stacked = {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in ("tokens", "labels", "loss_mask")}
            positions = torch.arange(config.model.seq_length).expand_as(stacked["tokens"])
            losses.append(model(stacked["tokens"], positions, stacked["labels"], stacked["loss_mask"]).item())
    assert len(losses) == 2
    result = run_entry(["tools/evaluate.py", "--load", moe_run["ckpt"], "--data-path", moe_run["data"], "--split",
                        split, *extra], nproc=nproc, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    loss = float(re.search(r"at iteration 2 on the valid split: loss (\S+)", result.stdout).group(1))
    assert f"DP={nproc}" in result.stdout
    assert loss == pytest.approx(sum(losses) / len(losses), rel=1e-5)


def test_evaluate_refuses_an_expert_parallel_size_its_data_parallel_ranks_cannot_hold(moe_run):
    result = run_entry(["tools/evaluate.py", "--load", moe_run["ckpt"], "--data-path", moe_run["data"], "--split",
                        "50,50,0", "--expert-model-parallel-size", "2"], nproc=1, timeout=300)
    line = error_line(result)
    assert line.startswith("evaluate.py: error: --expert-model-parallel-size 2 does not divide data-parallel 1"), line
    assert line.endswith("Use --expert-model-parallel-size 1"), line


READERS = {
    "generate": lambda ckpt, out: ("tools/generate.py", "--load", ckpt, "--prompt", "1 2"),
    "evaluate": lambda ckpt, out: ("tools/evaluate.py", "--load", ckpt),
    "merge": lambda ckpt, out: ("tools/convert_checkpoint.py", "merge", "--load", ckpt, "--output", f"{out}/m.pt"),
    "reshard": lambda ckpt, out: ("tools/convert_checkpoint.py", "reshard", "--load", ckpt, "--save", out,
                                  "--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size",
                                  "1"),
    "universal": lambda ckpt, out: ("tools/convert_checkpoint.py", "universal", "--load", ckpt, "--save", out),
    "export-hf": lambda ckpt, out: ("tools/convert_checkpoint.py", "export-hf", "--load", ckpt, "--output", out),
    "resume": lambda ckpt, out: ("pretrain_gpt.py", "--load", ckpt, "--use-checkpoint-args", "--save", out,
                                 "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "4",
                                 "--lr", "1e-3", "--data-path", f"{ckpt}/none"),
}


@pytest.mark.parametrize("edit, says", [
    ({"moe_router_topk": 9}, "--moe-router-topk 9 is more than --num-experts 8"),  # before: export-hf exited 0
    ({"window_size": "abc"}, "--window-size takes whole numbers, got 'abc'"),  # before: TypeError tracebacks
], ids=["topk-above-experts", "window-not-numbers"])
def test_every_reader_of_a_checkpoint_refuses_a_recorded_model_that_pretrain_refuses_naming_the_file(
        moe_run, tmp_path, edit, says):
    """Issue 61, class 5: generate, evaluate, merge, reshard, universal, export-hf and a resume check the recorded
    config through one function (validation/saved_config.py), before torch starts, and write nothing."""
    ckpt = edited_copy(moe_run["ckpt"], tmp_path / "edited", "model", **edit)
    for reader, command in READERS.items():
        out = tmp_path / f"out-{reader}"
        line = error_line(run_tool(*command(ckpt, str(out)), check=False))
        assert f"{ckpt}/iter_{SAVE_AT:07d}/megatron_lite.json records a model that pretrain_gpt.py refuses" in line, \
            (reader, line)
        assert says in line, (reader, line)
        assert not out.exists() or not any(out.iterdir()), reader


def test_generate_refuses_a_merged_file_whose_recorded_model_pretrain_refuses(moe_run, tmp_path):
    import json

    merged = str(tmp_path / "model.pt")
    run_tool("tools/convert_checkpoint.py", "merge", "--load", moe_run["ckpt"], "--output", merged)
    saved = torch.load(merged, weights_only=True)
    config = json.loads(saved["config_json"])
    config["model"]["moe_router_topk"] = 9
    saved["config_json"] = json.dumps(config)
    torch.save(saved, merged)
    line = error_line(run_tool("tools/generate.py", "--load", merged, "--prompt", "1 2", check=False))
    assert f"{merged} records a model that pretrain_gpt.py refuses" in line and "--moe-router-topk 9" in line, line


@pytest.mark.parametrize("latest", ["../../../etc", "ABSOLUTE"], ids=["parent-path", "absolute-path"])
def test_a_latest_that_names_a_path_is_refused_as_a_path_even_when_the_path_exists(moe_run, tmp_path, latest):
    """Before: "... does not exist" for `../../../etc` and for an absolute path to a real iter folder (both exist)."""
    ckpt = copy_checkpoint(moe_run["ckpt"], tmp_path / "ckpt")
    named = f"{moe_run['ckpt']}/iter_{SAVE_AT:07d}" if latest == "ABSOLUTE" else latest
    with open(f"{ckpt}/latest", "w") as f:
        f.write(named)
    for command in (READERS["generate"](ckpt, ""), READERS["resume"](ckpt, str(tmp_path / "out"))):
        line = error_line(run_tool(*command, check=False))
        assert f"{ckpt}/latest names '{named}', a path, but it holds the name of a folder inside {ckpt}" in line, line


def test_evaluate_refuses_more_eval_iters_than_the_split_holds_before_any_process_group(moe_run):
    """Issue 61, class 10: before, --eval-iters 100000 on a split of a few dozen samples read it thousands of times
    over, silently, for minutes."""
    result = run_tool("tools/evaluate.py", "--load", moe_run["ckpt"], "--data-path", moe_run["data"], "--split",
                      "50,50,0", "--eval-iters", "100000", "--global-batch-size", "2", check=False)
    line = error_line(result)
    match = re.search(r"--eval-iters 100000 x --global-batch-size 2 = 200,000 samples, but the valid split of "
                      r"--data-path \S+ \(--split 50,50,0\) holds (\d+) samples of \d+ tokens: it would be read "
                      r"[\d,]+ times over; use --eval-iters (\d+) or less", line)
    assert match and int(match.group(2)) == int(match.group(1)) // 2, line
