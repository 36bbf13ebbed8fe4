"""DeepSeek-V3's model: Multi-head Latent Attention (query and key/value latents with their norms, one rotary key
shared by the heads, values narrower than queries and keys, YaRN with its softmax factor), its experts and
Multi-Token Prediction (1 and 2 depths), on packed documents, computes the dense single-process losses, depth
losses and gradient norms under every layout: TP with and without SP, CP, PP, DP with ZeRO 1, EP, selective
recompute, both attention backends; and the anchors' bugs stay out: the shared key gathered over SP when SP is
off (Megatron-LM #1416), packed documents (#1398), a CP rank whose part of a depth's mask is empty (a document
ends at the CP boundary in every sample: PR #3396's NaN)."""
import pytest
import torch

from tests.harness import run_distributed
from tests.model.gpt_layouts import dense_losses, global_batches, micro_batches, tiny_config

STEPS = 3
EOD = 5
MLA = ("--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "10", "--qk-layernorm", "--norm-epsilon", "1e-6",
       "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights",
       "--position-embedding-type", "yarn", "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings",
       "16", "--mscale", "1", "--mscale-all-dim", "0.8", "--init-method-std", "0.1", "--ffn-hidden-size", "96")
"""Values 10 wide where queries and keys are 8 + 4: the context-parallel exchange sends them apart. YaRN at s 4
with mscale_all_dim 0.8: the softmax scale is 1.23^2 / sqrt(12). Weights of std 0.1: attention far from uniform."""
EXPERTS = ("--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
           "--moe-shared-expert-intermediate-size", "64", "--moe-layer-freq", "([0]*1+[1]*3)",
           "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
           "--moe-router-topk-scaling-factor", "2.5", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1")
"""DeepSeek-V3's router (sigmoid scores with an expert bias, 2 groups of which the best 1 is searched) after one
dense layer."""
DOCUMENTS = ("--reset-attention-mask", "--reset-position-ids")
MTP = ("--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3")
MODEL = MLA + EXPERTS + DOCUMENTS + MTP


def with_eods(batches):
    """About one token in eight ends a document, and so does the last token of the first half of every sample: at
    CP 2 a document ends at the boundary."""
    g = torch.Generator().manual_seed(3)
    batches = torch.where(torch.rand(batches.shape, generator=g) < 0.125, torch.full_like(batches, EOD), batches)
    batches[..., (batches.shape[-1] - 1) // 2 - 1] = EOD
    return batches


def _train(tp, cp, pp, dp, ep, extra, steps):
    import torch.distributed as dist

    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine

    config = tiny_config(tp, pp, dp, ("--expert-model-parallel-size", str(ep)) + tuple(extra), cp=cp)
    state.initialize(tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep)
    engine = Engine(config, with_scheduler=False)
    data = micro_batches(config, with_eods(global_batches(config, steps)), state.get_data_parallel_rank(), dp,
                         cp=(state.get_context_parallel_rank(), cp), eod=EOD)
    stats = [engine.train_step(data) for _ in range(steps)]
    return {"rank": dist.get_rank(), "losses": [s.loss for s in stats], "norms": [s.grad_norm for s in stats],
            "mtp": [s.mtp_losses for s in stats], "coord": state.describe()}


def run_layout(tp, cp, pp, dp, ep, extra=()):
    return run_distributed(_train, tp * cp * pp * dp, tp, cp, pp, dp, ep, MODEL + tuple(extra), STEPS, timeout=180.0)


@pytest.fixture(scope="module")
def reference():
    return dense_reference_of(MODEL)


def assert_matches(results, reference, tolerance=1e-5):
    for r in results:
        where = f"rank {r['rank']} {r['coord']}"
        rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], reference["losses"]))
        assert rel <= tolerance, f"{where}: {r['losses']} vs dense {reference['losses']} (rel {rel:.2e})"
        rel = max(abs(a - b) / abs(b) for a, b in zip(r["norms"], reference["norms"]))
        assert rel <= tolerance, f"{where}: gradient norms {r['norms']} vs dense {reference['norms']} (rel {rel:.2e})"
        if reference["mtp"] is not None:
            mine = [d for step in r["mtp"] for d in step]
            rel = max(abs(a - b) / abs(b) for a, b in zip(mine, [d for step in reference["mtp"] for d in step]))
            assert len(mine) == len(reference["mtp"]) * len(reference["mtp"][0]) and rel <= tolerance, \
                f"{where}: depth losses {r['mtp']} vs dense {reference['mtp']} (rel {rel:.2e})"


LAYOUTS = [  # (tp, cp, pp, dp, ep, extra): the five, and TP 2 without SP
    (2, 1, 1, 1, 1, ()),
    (2, 1, 2, 1, 1, ("--sequence-parallel",)),
    (1, 2, 1, 2, 2, ()),
    (2, 2, 1, 1, 2, ()),
    (1, 1, 2, 2, 2, ("--zero-stage", "1")),
    (4, 1, 1, 2, 2, ("--recompute-granularity", "selective")),
]


@pytest.mark.parametrize("backend", ["sdpa", "fused"])
@pytest.mark.parametrize("tp, cp, pp, dp, ep, extra", [
    layout if i == 0 else pytest.param(*layout, marks=pytest.mark.slow) for i, layout in enumerate(LAYOUTS)])
def test_mla_with_experts_and_documents_matches_the_dense_losses_and_norms(tp, cp, pp, dp, ep, extra, backend,
                                                                           reference):
    """The dense reference takes SDPA (auto on CPU); the fused path's losses agree with it to 1e-5 as well."""
    assert_matches(run_layout(tp, cp, pp, dp, ep, extra + ("--attention-backend", backend)), reference)


TWO_DEPTHS = MLA + EXPERTS + DOCUMENTS + ("--mtp-num-layers", "2")


@pytest.fixture(scope="module")
def two_depths_reference():
    return dense_reference_of(TWO_DEPTHS)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sdpa", "fused"])
@pytest.mark.parametrize("tp, cp, pp, dp, ep, extra", LAYOUTS[1:])
def test_two_prediction_depths_match_the_dense_losses_depth_losses_and_norms(tp, cp, pp, dp, ep, extra, backend,
                                                                            two_depths_reference):
    """Depth 2 reads depth 1's normed output, the tokens two ahead, and its own decoder layer (numbered L + 2)."""
    results = run_distributed(_train, tp * cp * pp * dp, tp, cp, pp, dp, ep,
                              TWO_DEPTHS + extra + ("--attention-backend", backend), STEPS, timeout=180.0)
    assert_matches(results, two_depths_reference)


def without(flags, flag, takes_value=True):
    i = flags.index(flag)
    return flags[:i] + flags[i + 1 + takes_value:]


def test_mla_without_a_query_latent_matches_the_dense_losses_at_tp2_cp2():
    """No --q-lora-rank: one column-parallel query projection from the hidden state (DeepSeek-V2-Lite)."""
    model = without(MLA, "--q-lora-rank") + EXPERTS + DOCUMENTS
    assert_matches(run_distributed(_train, 4, 2, 2, 1, 1, 1, model, STEPS, timeout=180.0), dense_reference_of(model))


def dense_reference_of(model):
    from megatron_lite.model import mtp

    config = tiny_config(extra=model)
    norms = []
    mtp.take_losses()
    losses = dense_losses(config, with_eods(global_batches(config, STEPS)),
                          micro_batch_size=config.batch.micro_batch_size, eod=EOD, norms=norms)
    recorded, gas = mtp.take_losses(), config.batch.global_batch_size // config.batch.micro_batch_size
    depths = [[sum(d) / gas for d in zip(*recorded[i * gas:(i + 1) * gas])] for i in range(STEPS)] if recorded else None
    return {"losses": losses, "norms": norms, "mtp": depths}


def test_the_latent_norms_the_softmax_factor_the_documents_and_the_depths_change_the_losses(reference):
    """Each ingredient the layouts test moves the dense losses well past its tolerance, so it can fail."""
    variants = {
        "latent norms": without(MODEL, "--qk-layernorm", takes_value=False),
        "YaRN's softmax factor": without(MODEL, "--mscale-all-dim"),
        "documents": MLA + EXPERTS + MTP,
        "multi-token prediction": MLA + EXPERTS + DOCUMENTS,
    }
    for what, flags in variants.items():
        other = dense_reference_of(flags)["losses"]
        assert max(abs(a - b) / abs(b) for a, b in zip(other, reference["losses"])) > 1e-3, what
    assert all(len(step) == 1 and step[0] > 0 for step in reference["mtp"])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sdpa", "fused"])
def test_mla_with_learned_attention_sinks_matches_the_dense_losses_at_tp2_cp2(backend):
    """Sinks (gpt-oss's) on MLA's heads: split over TP and then CP with them, under values narrower than the queries
    (SDPA pads both to the next multiple of 8 past the wider)."""
    model = MLA + EXPERTS + DOCUMENTS + ("--softmax-type", "learnable")
    results = run_distributed(_train, 4, 2, 2, 1, 1, 1, model + ("--attention-backend", backend), STEPS, timeout=180.0)
    assert_matches(results, dense_reference_of(model))
