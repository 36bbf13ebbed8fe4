import io
import json
import re
from contextlib import redirect_stdout

import pytest

from megatron_lite.cost import memory

from megatron_lite.cost import model_state
from megatron_lite.deepspeed_config import deepspeed_config
from tests.cost.activation_census import saved_bytes_per_stage
from tests.device import census_device
from tests.harness import run_distributed, shutdown_pools
from tests.model.gpt_layouts import tiny_config
from tests.model.test_llama_parallel import LLAMA, YARN
from tests.model.test_mla_parallel import MLA as MLA_MODEL

GIB = 2 ** 30


def _printed_gpu_gib(printed, options):
    """The per-GPU GB column of the row of a DeepSpeed `_all_cold`/`_all_live` table whose options match."""
    for line in printed.splitlines():
        if options in line.replace(" ", "").replace("OffloadDeviceEnum.", ""):
            return float(re.findall(r"([\d.]+)GB", line)[1])
    raise AssertionError(f"no row {options!r} in\n{printed}")


SHAPES = [(1_300_000_000, 1, 8), (6_700_000_000, 2, 8), (175_000_000_000, 16, 8), (20_000_000_000, 4, 4)]


@pytest.mark.parametrize("params, nodes, gpus", SHAPES)
def test_zero2_model_states_equal_deepspeeds_estimator(params, nodes, gpus):
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs, estimate_zero2_model_states_mem_needs_all_cold)

    n = nodes * gpus
    for offload in (False, True):
        # DeepSpeed's estimator counts the step: between steps ours holds no gradients at 16-bit ZeRO 2 (measured,
        # benchmarks/memory_census.py); during it the 16-bit partition (step_gradients) and the fp32 partition
        # the step makes (half of the measured step transient), which ZeRO-Offload keeps on the CPU.
        ours = model_state.model_state_bytes(params, 2, n, "bf16", cpu_offload=offload)
        during = sum(ours[k] for k in ("weights", "gradients", "optimizer_states")) + (
            0 if offload else memory.step_gradient_bytes(params, 2, "bf16", n) + 4 * params // n)
        theirs = estimate_zero2_model_states_mem_needs(params, gpus, nodes, cpu_offload=offload)[1]
        assert during == pytest.approx(theirs, rel=0.01)
        out = io.StringIO()
        with redirect_stdout(out):
            estimate_zero2_model_states_mem_needs_all_cold(params, gpus, nodes)
        printed = _printed_gpu_gib(out.getvalue(), "offload_optimizer=cpu" if offload else "offload_optimizer=none")
        assert during / GIB == pytest.approx(printed, rel=0.01, abs=0.006)


@pytest.mark.parametrize("params, nodes, gpus", SHAPES)
def test_zero3_model_states_equal_deepspeeds_estimator(params, nodes, gpus):
    from deepspeed.runtime.zero.stage3 import (
        estimate_zero3_model_states_mem_needs, estimate_zero3_model_states_mem_needs_all_cold)

    largest = params // 40
    n = nodes * gpus
    out = io.StringIO()
    with redirect_stdout(out):
        estimate_zero3_model_states_mem_needs_all_cold(params, largest, gpus, nodes)
    for offload, offload_param, row in ((False, False, "offload_param=none,offload_optimizer=none,zero_init=1"),
                                        (True, False, "offload_param=none,offload_optimizer=cpu,zero_init=1"),
                                        (True, True, "offload_param=cpu,offload_optimizer=cpu,zero_init=1")):
        ours = model_state.model_state_bytes(params, 3, n, "bf16", cpu_offload=offload, offload_param=offload_param)
        # DeepSpeed's 4L is the gathered working set (two largest layers, bf16), which we book during forward
        # and backward (zero3_gathered_bytes), not between steps; its gradients are fp32 (fp32_accumulation).
        device = sum(ours[k] for k in ("weights", "gradients", "optimizer_states")) + 2 * 2 * largest
        theirs = estimate_zero3_model_states_mem_needs(params, largest, gpus, nodes, cpu_offload=offload,
                                                       cpu_offload_params=offload_param)[1]
        assert device == pytest.approx(theirs, rel=0.01)
        assert device / GIB == pytest.approx(_printed_gpu_gib(out.getvalue(), row), rel=0.01, abs=0.006)


def test_live_estimators_on_a_real_module_agree():
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live

    # torch.empty never touches its pages: 1.5e9 parameters cost no resident memory here.
    layers = torch.nn.ModuleList(torch.nn.Linear(1, 1, bias=False) for _ in range(3))
    for layer in layers:
        layer.weight = torch.nn.Parameter(torch.empty(500_000_000))
    params = 1_500_000_000
    for fn, zero, row in ((estimate_zero2_model_states_mem_needs_all_live, 2, "offload_optimizer=none"),
                          (estimate_zero3_model_states_mem_needs_all_live, 3,
                           "offload_param=none,offload_optimizer=none,zero_init=1")):
        out = io.StringIO()
        with redirect_stdout(out):
            fn(layers, num_gpus_per_node=4, num_nodes=1)
        ours = model_state.model_state_bytes(params, zero, 4, "bf16")
        during = sum(ours[k] for k in ("weights", "gradients", "optimizer_states")) + (
            memory.step_gradient_bytes(params, 2, "bf16", 4) + 4 * params // 4 if zero == 2
            else 2 * 2 * 500_000_000)  # as above; ZeRO 3: the gathered working set
        assert during / GIB == pytest.approx(_printed_gpu_gib(out.getvalue(), row), rel=0.01)


ENGINE_LAYOUTS = [(1, 1, 1, ()), (2, 1, 1, ()), (1, 2, 1, ()), (2, 2, 1, ()), (1, 1, 2, ("--zero-stage", "1")),
                  (1, 2, 2, ("--zero-stage", "1")), (2, 1, 2, ("--zero-stage", "2")), (1, 1, 2, ("--zero-stage", "2"))]


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp, dp, extra", ENGINE_LAYOUTS)
def test_model_states_of_a_real_engine_match_the_estimate(tp, pp, dp, extra, tmp_path):
    from tests.cost.engine_census import engine_census

    ds_json = tmp_path / "ds.json"
    # Small buckets, so the comparison is about the model states, not a 2 GB reduction buffer.
    ds_json.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 2000}}))
    shutdown_pools()  # a fresh pool: no engine of an earlier test still holds memory
    results = run_distributed(engine_census, tp * pp * dp, tp, pp, dp, list(extra), str(ds_json))
    shutdown_pools()
    config = results[0]["config"]
    stages = memory.estimate(config, {"zero_optimization": {"stage": config.parallel.zero_stage,
                                                            "reduce_bucket_size": 2000}})
    for r in results:
        st = stages[r["stage"]]
        # Counted just before the optimizer's step: at ZeRO 0 the parameters' gradients are still alive (the
        # estimate's step_gradients, freed after the step); ZeRO 1/2 have reduced theirs into their partitions.
        during = st.step_gradients if config.parallel.zero_stage == 0 else 0
        predicted = st.model_states + st.communication_buffers + during
        assert r["bytes"] == pytest.approx(predicted, rel=0.02), (r["rank"], r["stage"], r["bytes"], st)


FULL = ["--recompute-granularity", "full", "--recompute-method"]
RECOMPUTE = {"none": [], "selective": ["--recompute-granularity", "selective"],
             "full": FULL + ["uniform", "--recompute-num-layers", "1"],
             "uniform2": FULL + ["uniform", "--recompute-num-layers", "2"],
             "block1": FULL + ["block", "--recompute-num-layers", "1"]}


# Hidden 128 and vocabulary 2048: the last stage's [b, s, V] logits weigh as much as a stage's activations.
PEAK_MODEL = ("--hidden-size", "128", "--vocab-size", "2048", "--micro-batch-size", "4", "--global-batch-size", "16",
              "--seq-length", "64")


def _measured_peaks(tp, pp, extra, tmp_path, free_last_stage_outputs=True):
    from tests.cost.peak_census import engine_peak

    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 2000}}))
    shutdown_pools()  # a fresh pool: no engine of an earlier test still holds memory
    results = run_distributed(engine_peak, tp * pp, tp, pp, 1, list(PEAK_MODEL) + list(extra), str(ds_json),
                              free_last_stage_outputs)
    shutdown_pools()
    return results


@pytest.mark.parametrize("tp, extra", [
    (1, ()), (1, LLAMA), pytest.param(2, (), marks=pytest.mark.slow),
    pytest.param(2, ("--sequence-parallel", "--recompute-granularity", "selective"), marks=pytest.mark.slow),
    pytest.param(2, LLAMA + ("--sequence-parallel", "--recompute-granularity", "selective"), marks=pytest.mark.slow),
    # each pipeline rank: two stages (measured 0.985 and 1.076 of the estimate, 2026-12-07)
    pytest.param(1, ("--pipeline-schedule", "dualpipev"), marks=pytest.mark.slow)])
def test_every_stages_estimated_peak_is_within_10_percent_of_the_measured_peak_at_pp2(tp, extra, tmp_path):
    results = _measured_peaks(tp, 2, extra, tmp_path)
    config = results[0]["config"]
    stages = memory.estimate(config, {"zero_optimization": {"stage": 0, "reduce_bucket_size": 2000}},
                             device=census_device())
    for r in results:
        assert r["peak"] == pytest.approx(stages[r["stage"]].peak, rel=0.10), (r["rank"], r["stage"], r["peak"])


QK_HEADS = ("--qk-layernorm", "--kv-channels", "24")
GPT_OSS_MLP = ("--quick-geglu", "--glu-linear-offset", "1", "--activation-func-clamp-value", "7")
BLOCKS = {"gpt2": (), "llama": LLAMA, "qwen3": LLAMA + QK_HEADS, "gpt2_qk": QK_HEADS, "yarn_half": YARN,
          "gpt_oss_mlp": GPT_OSS_MLP}
"""GPT-2's block, and the Llama block (SwiGLU, RMSNorm, 2 key/value groups for 4 heads: shared by two
ranks at TP 4, no biases, RoPE, untied head); each with QK-norm (RMSNorm's, LayerNorm's) on heads of 24,
not hidden / heads = 16; the Llama block with YaRN turning half of each head (RoPE's tables are r wide); and
GPT-2's block with gpt-oss's MLP (quick-GeGLU, clamped, offset: its input kept alone, model/activation.py)."""


def _activation_config(tp, pp, recompute, dropout, sp=False, backend="auto", block="gpt2", micro=2, bf16=False):
    extra = ["--micro-batch-size", str(micro), "--global-batch-size", "8", "--attention-backend", backend]
    if dropout:
        extra += ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    extra += RECOMPUTE[recompute] + (["--sequence-parallel"] if sp else []) + (["--bf16"] if bf16 else [])
    return tiny_config(tp, pp, 1, extra + list(BLOCKS[block]))


def _census(tp, pp, recompute, dropout, sp=False, block="gpt2", micro=2, bf16=False):
    return saved_bytes_per_stage(_activation_config(tp, pp, recompute, dropout, sp, block=block, micro=micro,
                                                    bf16=bf16))


def _stage_census_cases():
    """TP 1 with dropout in the fast tier (one layer's census covers TP 2 and SP there), and the Llama block
    at TP 4 (two ranks per key/value group) without dropout, bf16, micro batch 1 (the case a Llama plan
    trains: its first stage keeps the whole embedding output under SP); the rest in the full suite."""
    for tp, sp in ((1, False), (2, False), (2, True)):
        for pp in (1, 2):
            for recompute in RECOMPUTE:
                for dropout in (False, True):
                    fast = dropout and tp == 1
                    yield pytest.param(tp, sp, pp, recompute, dropout, "gpt2", 2, False,
                                       marks=() if fast else pytest.mark.slow)
    for tp, sp, pp, recompute, dropout, micro, bf16 in [
            (4, True, 2, "none", False, 1, True), (4, False, 2, "selective", True, 2, False),
            (4, True, 2, "full", False, 1, False), (1, False, 2, "block1", True, 2, True)]:
        fast = (tp, sp, recompute) == (4, True, "none")
        yield pytest.param(tp, sp, pp, recompute, dropout, "llama", micro, bf16, marks=() if fast else pytest.mark.slow)
    yield pytest.param(4, True, 2, "none", False, "qwen3", 1, True)
    yield pytest.param(2, False, 2, "selective", True, "gpt2_qk", 2, False, marks=pytest.mark.slow)


@pytest.mark.parametrize("tp, sp, pp, recompute, dropout, block, micro, bf16", _stage_census_cases())
def test_saved_activations_per_micro_batch_match_the_estimate(tp, sp, pp, recompute, dropout, block, micro, bf16):
    measured = run_distributed(_census, tp, tp, pp, recompute, dropout, sp, block, micro, bf16)[0]
    config = _activation_config(tp, pp, recompute, dropout, sp, block=block, micro=micro, bf16=bf16)
    stages = memory.estimate(config, deepspeed_config(config), device=census_device())
    assert measured == [st.activations_per_micro_batch for st in stages]


CENSUS_ROWS = [(sp, recompute) for sp in (False, True) for recompute in ("none", "selective", "full")]


def _layer_census(tp, configs):
    from megatron_lite.parallel import state
    from tests.cost.activation_census import saved_bytes_per_layer

    state.initialize(tp, 1)
    return [saved_bytes_per_layer(config) for config in configs]


def _layer_rows(tp, backend, block, **kw):
    return [(sp, recompute, _activation_config(tp, 1, recompute, True, sp, backend, block, **kw))
            for sp, recompute in CENSUS_ROWS if tp > 1 or not sp]


def _assert_layer_census_equals_the_estimate(tp, rows):
    from megatron_lite.cost import activations

    measured = run_distributed(_layer_census, tp, tp, [config for _, _, config in rows])
    for (sp, recompute, config), *per_rank in zip(rows, *measured):
        want = activations.stage_layer_bytes(config, 1, census_device())[0]
        for got in per_rank:
            assert got == want, f"SP {sp}, {recompute}: measured {got}, estimate {want}"
    return measured[0]


def _layer_cases():
    """GPT-2's block at TP 1 and 2 with the fused softmax, the Llama block at TP 4 (groups shared by two
    ranks) in the fast tier, each with QK-norm at TP 2 and 4; the rest in the full suite."""
    fast_tps = {"gpt2": (1, 2), "llama": (4,), "qwen3": (4,), "gpt2_qk": (2,), "yarn_half": (2,), "gpt_oss_mlp": (2,)}
    for block in BLOCKS:
        for backend in ("fused", "sdpa"):
            for tp in (1, 2, 4):
                fast = backend == "fused" and tp in fast_tps[block]
                yield pytest.param(tp, backend, block, marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("tp, backend, block", _layer_cases())
def test_one_layers_activations_match_the_estimate_with_sequence_parallel_and_recompute(tp, backend, block):
    """Korthikanti et al.'s rows for our layer: TP x SP x recompute none / selective / full, per layer and
    micro-batch, byte for byte (benchmarks/activation_table.py prints them beside the paper's formula)."""
    none, selective, full = _assert_layer_census_equals_the_estimate(tp, _layer_rows(tp, backend, block))[-3:]
    assert full < selective < none


@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 4])
def test_llama_layers_activations_in_bf16_at_micro_batch_1_match_the_estimate(tp):
    """What a Llama plan trains: bf16 (RMSNorm keeps an fp32 copy of its input), micro batch 1 (q, k, v
    handed to SDPA as views: the whole QKV output stays), RoPE's rotated q and k kept besides."""
    _assert_layer_census_equals_the_estimate(tp, _layer_rows(tp, "sdpa", "llama", micro=1, bf16=True))


@pytest.mark.parametrize("tp", [1, 2])
def test_partial_rope_under_flash_keeps_sdpas_output_apart_from_the_projections_input(tp):
    """YaRN on half of each head without dropout (SDPA's flash kernel on the CPU too): RoPE's concatenation makes
    q heads-major, the kernel lays its output out as q, and the projection's input is a copy of it."""
    rows = [(sp, recompute, _activation_config(tp, 1, recompute, False, sp, "sdpa", "yarn_half"))
            for sp, recompute in CENSUS_ROWS if tp > 1 or not sp]
    _assert_layer_census_equals_the_estimate(tp, rows)


def test_first_stage_holds_more_micro_batches_than_the_last():
    config = tiny_config(1, 4, 1, ["--global-batch-size", "16"])
    stages = memory.estimate(config, deepspeed_config(config))
    assert [st.micro_batches_in_flight for st in stages] == [4, 3, 2, 1]
    assert stages[0].activations > stages[-1].activations - stages[-1].activations_per_micro_batch


def test_estimate_peak_bytes_is_the_stage_total_the_training_loop_logs():
    config = tiny_config(1, 2, 1, ["--global-batch-size", "8"])
    ds_config = deepspeed_config(config)
    stages = memory.estimate(config, ds_config, device="cpu")
    for st in stages:
        assert memory.estimate_peak_bytes(config, st.stage, ds_config, device="cpu") == st.peak == (
            st.weights + st.gradients + st.optimizer_states + st.communication_buffers + st.step_gradients
            + max(st.activations + st.transient, st.reduction_transient, st.step_transient))
        assert st.between_steps == st.weights + st.gradients + st.optimizer_states + st.communication_buffers
    assert memory.estimate_peak_bytes(config, 0, ds_config) == stages[0].peak  # no GPU here: device defaults to cpu


MASKS = {"window": ["--window-size", "6"], "documents": ["--reset-attention-mask"],
         "documents+rope": ["--reset-attention-mask", "--reset-position-ids", "--position-embedding-type", "rope",
                            "--window-size", "6", "--window-attn-skip-freq", "2"]}
"""Document masks (one per sample), windows (one per layer) and per-sample rotary tables (model/attention_mask.py)."""


def _mask_rows(tp, backend, masks):
    rows = []
    for recompute in ("none", "selective", "full"):
        for dropout in (False, True):
            extra = ["--micro-batch-size", "2", "--global-batch-size", "8", "--attention-backend", backend]
            extra += (["--hidden-dropout", "0.1", "--attention-dropout", "0.1"] if dropout else []) + RECOMPUTE[recompute]
            rows.append(((recompute, dropout), None, tiny_config(tp, 1, 1, extra + MASKS[masks])))
    return rows


def _mask_census(configs, path, per_sample):
    from megatron_lite.model import attention_mask
    from megatron_lite.parallel import state
    from tests.cost import activation_census

    attention_mask.SEGMENTS_PER_TOKEN = 1.0 if path == "segments" else 0.0
    activation_census.DOCUMENTS_PER_SAMPLE = per_sample
    state.initialize(1, 1)
    return [activation_census.saved_bytes_per_layer(config) for config in configs]


@pytest.mark.parametrize("masks, path, per_sample", [
    (masks, path, per_sample) for masks in MASKS for path, per_sample in (("mask", 8), ("segments", 1), ("segments", 8))
    if masks != "window" or path == "mask"])  # a window alone has no documents to attend one by one
@pytest.mark.parametrize("backend", ["sdpa", "fused"])
def test_one_layers_activations_with_document_masks_and_windows_match_the_estimate(backend, masks, path,
                                                                                    per_sample):
    """SDPA's flash kernel keeps the mask in the queries' dtype, the fused softmax none of it; selective
    recompute keeps the bool mask it is given; rotary tables per sample when positions restart. Attended
    document by document, within the estimate's bound (one document per sample is its most: the s x s
    terms shrink with more); the estimate without a path is the larger path's."""
    from megatron_lite.cost import activations

    rows = _mask_rows(1, backend, masks)
    measured = run_distributed(_mask_census, 1, [config for _, _, config in rows], path, per_sample)[0]
    for (case, _, config), got in zip(rows, measured):
        selective = config.model.recompute_granularity == "selective"
        mask = activations.attention_mask_bytes(config, "cpu", selective)
        for_path = activations.attention_mask_bytes(config, "cpu", selective, path)
        want = activations.stage_layer_bytes(config, 1, "cpu")[0] - mask + for_path
        if config.model.recompute_granularity == "full":
            want = activations.stage_layer_bytes(config, 1, "cpu")[0]  # the chunk's input only
        assert (got == want) if path == "mask" else (got <= want), (case, got, want)


def _masked_census(pp):
    from megatron_lite.model import attention_mask

    attention_mask.SEGMENTS_PER_TOKEN = 0.0  # through the mask: the path whose bytes are exact
    return saved_bytes_per_stage(tiny_config(1, pp, 1, ["--micro-batch-size", "2", "--global-batch-size", "8"]
                                             + MASKS["documents+rope"]))


def test_a_pipeline_stage_with_document_ids_keeps_what_the_estimate_says():
    """The int32 document ids cross every stage boundary beside the hidden states; each layer keeps its
    mask (the estimate takes the larger of the mask's and the document-by-document bound, as data decides)."""
    from megatron_lite.cost import activations
    from megatron_lite.cost.stages import stage_bounds, transformer_layers_per_stage

    config = tiny_config(1, 2, 1, ["--micro-batch-size", "2", "--global-batch-size", "8"] + MASKS["documents+rope"])
    measured = run_distributed(_masked_census, 1, 2)[0]
    stages = memory.estimate(config, deepspeed_config(config), device=census_device())
    bound = activations.attention_mask_bytes(config, "cpu") - activations.attention_mask_bytes(config, "cpu",
                                                                                               path="mask")
    layers = transformer_layers_per_stage(config, stage_bounds(config, estimate=True))
    assert measured == [st.activations_per_micro_batch - n * bound for st, n in zip(stages, layers)]


def _sink_census(configs):
    from megatron_lite.parallel import state
    from tests.cost import activation_census

    state.initialize(1, 1)
    return [activation_census.saved_bytes_per_layer(config) for config in configs]


SINK_VARIANTS = {"causal": [], "window": ["--window-size", "3,0"], "dropout": ["--attention-dropout", "0.1"],
                 "groups": ["--group-query-attention", "--num-query-groups", "2", "--micro-batch-size", "1"],
                 "selective": ["--recompute-granularity", "selective"],
                 "mla": list(MLA_MODEL)}


@pytest.mark.parametrize("backend", ["sdpa", "fused"])
def test_one_layers_activations_with_attention_sinks_match_the_estimate(backend):
    """Learned sinks: the fused softmax keeps each row's sink probability; SDPA's sink-as-a-key keeps padded q, k, v
    (one more key), its padded output and a mask on every layer (flash), or the S x (S + 1) scores (math, with
    dropout); selective recompute keeps what it kept before (cost/sink_activations.py); MLA's heads too."""
    from megatron_lite.cost import activations

    configs = {name: tiny_config(1, 1, 1, ["--micro-batch-size", "2", "--global-batch-size", "8", "--attention-backend",
                                           backend, "--softmax-type", "learnable", "--position-embedding-type", "rope",
                                           *extra])
               for name, extra in SINK_VARIANTS.items()}
    measured = run_distributed(_sink_census, 1, list(configs.values()))[0]
    for (name, config), got in zip(configs.items(), measured):
        assert got == activations.stage_layer_bytes(config, 1, "cpu")[0], (name, got)


CHUNKED_LOSS_CASES = [(1, 2, ()), (2, 2, ("--sequence-parallel",)), (1, 2, ("--bf16",)),
                      (2, 2, ("--mtp-num-layers", "1", "--position-embedding-type", "rope", "--sequence-parallel"))]


@pytest.mark.parametrize("tp, pp, extra", [case if i == 0 else pytest.param(*case, marks=pytest.mark.slow)
                                           for i, case in enumerate(CHUNKED_LOSS_CASES)])
def test_the_chunked_output_loss_keeps_no_logits_and_the_census_equals_the_estimate(tp, pp, extra):
    """--output-loss-chunk-size: the last stage keeps the head's input (gathered under SP), the labels and a log-sum-exp
    per token instead of the [tokens, V/tp] fp32 logits; byte for byte what cost/activations.py says, and less than
    the whole head by the logits' share."""
    def config_of(chunk):
        flags = ["--micro-batch-size", "2", "--global-batch-size", "8", *extra]
        return tiny_config(tp, pp, 1, flags + (["--output-loss-chunk-size", "7"] if chunk else []))

    chunked, whole = config_of(True), config_of(False)
    measured = run_distributed(saved_bytes_per_stage, tp, chunked)[0]
    assert measured == [st.activations_per_micro_batch
                        for st in memory.estimate(chunked, deepspeed_config(chunked), device=census_device())]
    whole_last = memory.estimate(whole, deepspeed_config(whole), device=census_device())[-1].activations_per_micro_batch
    tokens = 2 * whole.model.seq_length * (1 + (whole.model.mtp_num_layers or 0))
    # the fp32 logits gone, less the gathered input SP keeps (hidden 64, fp32 at most)
    assert whole_last - measured[-1] >= 4 * tokens * whole.model.padded_vocab_size // tp - 4 * tokens * 64
