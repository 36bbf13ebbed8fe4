"""gpt-oss's model: learned attention sinks, the clamped offset quick-GeGLU, biases everywhere (q, k, v, o, the
router, every expert's gate/up and its down bias weighted by the routing probability), sliding-window layers
alternating with global ones, YaRN without rounding, experts chosen top 4 with a softmax over the chosen, computes
the dense single-process losses and gradient norms under the issue's layouts, both attention backends: TP with SP
and PP; CP with DP and EP; TP with CP and EP; PP with DP, EP and ZeRO 1."""
import pytest

from tests.harness import run_distributed
from tests.model.gpt_layouts import dense_losses, global_batches, micro_batches, tiny_config

STEPS = 3
GPT_OSS = ("--normalization", "RMSNorm", "--untie-embeddings-and-output-weights", "--group-query-attention",
           "--num-query-groups", "2", "--kv-channels", "12", "--softmax-type", "learnable",
           "--quick-geglu", "--glu-linear-offset", "1", "--activation-func-clamp-value", "0.5",
           "--window-size", "3,0", "--window-attn-skip-freq", "2",
           "--position-embedding-type", "yarn", "--rotary-base", "150000", "--rotary-scaling-factor", "4",
           "--yarn-original-max-position-embeddings", "16", "--no-yarn-correction-range-round-to-int",
           "--num-experts", "8", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "48",
           "--moe-router-score-function", "softmax", "--init-method-std", "0.1", "--ffn-hidden-size", "96")
"""Heads 12 wide where hidden / heads is 16; 2 key/value groups; a window of 4 keys on layers 1 and 3 (sequence 32);
the clamp at 0.5 bites at weights of std 0.1 (7, gpt-oss's, would not)."""


def _train(tp, cp, pp, dp, ep, extra, steps):
    import torch.distributed as dist

    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine

    config = tiny_config(tp, pp, dp, ("--expert-model-parallel-size", str(ep)) + tuple(extra), cp=cp)
    state.initialize(tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep)
    engine = Engine(config, with_scheduler=False)
    data = micro_batches(config, global_batches(config, steps), state.get_data_parallel_rank(), dp,
                         cp=(state.get_context_parallel_rank(), cp))
    stats = [engine.train_step(data) for _ in range(steps)]
    return {"rank": dist.get_rank(), "losses": [s.loss for s in stats], "norms": [s.grad_norm for s in stats],
            "coord": state.describe()}


def dense_reference_of(model):
    config = tiny_config(extra=model)
    norms = []
    losses = dense_losses(config, global_batches(config, STEPS), micro_batch_size=config.batch.micro_batch_size,
                          norms=norms)
    return {"losses": losses, "norms": norms}


@pytest.fixture(scope="module")
def reference():
    return dense_reference_of(GPT_OSS)


def relative(got, want):
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


LAYOUTS = [  # (tp, cp, pp, dp, ep, extra): the four
    (2, 2, 1, 1, 2, ()),
    (2, 1, 2, 1, 1, ("--sequence-parallel",)),
    (1, 2, 1, 2, 2, ()),
    (1, 1, 2, 2, 2, ("--zero-stage", "1")),
]
CASES = [pytest.param(*layout, backend, marks=() if (i, backend) == (0, "sdpa") else pytest.mark.slow)
         for i, layout in enumerate(LAYOUTS) for backend in ("sdpa", "fused")]


@pytest.mark.parametrize("tp, cp, pp, dp, ep, extra, backend", CASES)
def test_gpt_oss_matches_the_dense_losses_and_norms_under_every_layout(tp, cp, pp, dp, ep, extra, backend, reference):
    """The dense reference takes SDPA (auto on CPU); the fused kernel's sinks agree with it to 1e-5 as well."""
    results = run_distributed(_train, tp * cp * pp * dp, tp, cp, pp, dp, ep,
                              GPT_OSS + extra + ("--attention-backend", backend), STEPS, timeout=180.0)
    for r in results:
        where = f"rank {r['rank']} {r['coord']}"
        assert relative(r["losses"], reference["losses"]) <= 1e-5, f"{where}: {r['losses']} vs {reference['losses']}"
        assert relative(r["norms"], reference["norms"]) <= 1e-5, f"{where}: {r['norms']} vs {reference['norms']}"


def without(flags, flag, takes_value=True):
    i = flags.index(flag)
    return flags[:i] + flags[i + 1 + takes_value:]


def test_the_sinks_the_clamp_the_offset_and_the_windows_change_the_losses(reference):
    """Each ingredient the layouts test moves the dense losses well past their tolerance, so it can fail."""
    variants = {
        "sinks": without(GPT_OSS, "--softmax-type"),
        "clamp": without(GPT_OSS, "--activation-func-clamp-value"),
        "offset": without(GPT_OSS, "--glu-linear-offset"),
        "windows": without(without(GPT_OSS, "--window-size"), "--window-attn-skip-freq"),
    }
    for what, flags in variants.items():
        other = dense_reference_of(flags)["losses"]
        assert relative(other, reference["losses"]) > 1e-3, what
