"""--compile (model/compile.py): each transformer layer compiled on its own gives the eager losses and gradients,
under every layout, with dropout drawing the eager masks; a layer without dropout compiles to one graph with no
break and no recompile; full recompute does not compile twice.

The layouts trace through aot_eager (dynamo's graphs, AOTAutograd's forward and backward, eager kernels): what
tracing can get wrong (collectives, checkpoints, streams) shows there, in seconds; inductor's generated kernels are
checked at one process (test_inductor_...), where the compile costs ~20 s on two cores."""
import pytest
import torch

from tests.harness import run_distributed
from tests.model.gpt_layouts import documents_of, global_batches, micro_batches, tiny_config
from tests.model.test_llama_parallel import LLAMA
from tests.model.test_moe_parallel import MOE

STEPS = 3
DROPOUT = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1")


def _train(tp, cp, pp, dp, ep, extra, steps, compiled):
    import torch.distributed as dist

    from megatron_lite.parallel import state
    from megatron_lite.training.engine import Engine

    flags = ("--expert-model-parallel-size", str(ep)) + tuple(extra) + (("--compile", "--compile-backend",
                                                                          "aot_eager") if compiled else ())
    config = tiny_config(tp, pp, dp, flags, cp=cp)
    state.initialize(tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep)
    engine = Engine(config, with_scheduler=False)
    data = micro_batches(config, global_batches(config, steps), state.get_data_parallel_rank(), dp,
                         cp=(state.get_context_parallel_rank(), cp))
    stats = [engine.train_step(data) for _ in range(steps)]
    counts = engine.compile_counter.counts() if compiled else None
    return {"rank": dist.get_rank(), "losses": [s.loss for s in stats], "norms": [s.grad_norm for s in stats],
            "coord": state.describe(), "breaks": counts and counts.break_reasons}


def relative(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


LAYOUTS = [  # (tp, cp, pp, dp, ep, extra): the four, each with dropout drawing
    (1, 1, 1, 1, 1, DROPOUT),
    (2, 1, 2, 1, 1, DROPOUT + ("--sequence-parallel", "--recompute-granularity", "selective")),
    (1, 2, 1, 2, 1, DROPOUT + LLAMA),
    (2, 1, 1, 2, 2, DROPOUT + MOE + ("--zero-stage", "1")),
]


@pytest.mark.parametrize("tp, cp, pp, dp, ep, extra",
                         [LAYOUTS[1]] + [pytest.param(*layout, marks=pytest.mark.slow)
                                         for layout in LAYOUTS[:1] + LAYOUTS[2:]])
def test_compiled_layers_give_the_eager_losses_and_norms_with_dropout_under_every_layout(tp, cp, pp, dp, ep, extra):
    world = tp * cp * pp * dp
    eager = run_distributed(_train, world, tp, cp, pp, dp, ep, extra, STEPS, False, timeout=180.0)
    compiled = run_distributed(_train, world, tp, cp, pp, dp, ep, extra, STEPS, True, timeout=300.0)
    for e, c in zip(eager, compiled):
        where = f"rank {c['rank']} {c['coord']}"
        assert relative(c["losses"], e["losses"]) <= 1e-5, f"{where}: {c['losses']} vs eager {e['losses']}"
        assert relative(c["norms"], e["norms"]) <= 1e-5, f"{where}: {c['norms']} vs eager {e['norms']}"
        # Dropout breaks each layer's graph at its sites (eager masks); nothing else may.
        assert set(c["breaks"]) <= {r for r in c["breaks"] if "torch.compiler.disable" in r}, f"{where}: {c['breaks']}"


def _dense_model(extra, backend):
    """A GPTModel (4 layers) and one micro-batch of 2 samples with two documents each; its layers compiled with
    `backend` (None: eager). Returns the model, the inputs and a counter started before the compile."""
    from megatron_lite.model.compile import CompileCounter, compile_layers
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    config = tiny_config(extra=extra)
    model_parallel_seed(7, config.model.numbered_layers)
    model = GPTModel(config)
    torch._dynamo.reset()  # graphs an earlier test compiled for a layer of the same kind would be taken again
    counter = CompileCounter()
    if backend is not None:
        compile_layers(model, backend)
    sample = global_batches(config, 1)[0][:2]
    sample[:, 9] = 3  # an end of document mid-sequence
    tokens, labels = sample[:, :-1], sample[:, 1:]
    positions, documents = documents_of(config, tokens, 3)
    return model, (tokens, positions, labels, torch.ones(labels.shape), documents), counter


def _steps(model, inputs, steps=3):
    """Losses of `steps` forward-backward passes (no optimizer step: the same weights) and the last gradients."""
    tokens, positions, labels, mask, documents = inputs
    losses = []
    for _ in range(steps):
        model.zero_grad()
        loss = model(tokens, positions, labels, mask, document_ids=documents)
        loss.backward()
        losses.append(loss.item())
    return losses, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


BLOCKS = {
    "gpt2": (),
    "llama documents window qk-norm": LLAMA + ("--reset-attention-mask", "--reset-position-ids", "--window-size",
                                                "6,0", "--qk-layernorm"),
    "selective recompute": ("--recompute-granularity", "selective"),
    "full recompute": ("--recompute-granularity", "full", "--recompute-method", "uniform",
                       "--recompute-num-layers", "1"),
    "fused softmax sinks": LLAMA + ("--attention-backend", "fused", "--softmax-type", "learnable"),
}


@pytest.mark.parametrize("block", BLOCKS)
def test_a_layer_without_dropout_compiles_to_one_graph_without_breaks_or_recompiles(block):
    """Each kind of dense layer, through the documents' mask, windows, QK-norm, recompute and the fused kernel's
    sinks: one graph for the 4 layers, no graph break, none compiled again over three passes, eager's numbers."""
    model, inputs, counter = _dense_model(BLOCKS[block], "aot_eager")
    losses, grads = _steps(model, inputs)
    counts = counter.counts()
    assert (counts.graphs, counts.graph_breaks) == (1, 0), counts
    eager_losses, eager_grads = _steps(*_dense_model(BLOCKS[block], None)[:2])
    assert losses == eager_losses
    torch.testing.assert_close(grads, eager_grads, rtol=0, atol=0)


def test_dropout_breaks_each_layer_at_its_sites_and_draws_the_eager_masks():
    """Attention and residual dropout run eagerly in their streams: the same masks (equal losses and gradients
    to the bit), one break per site, and the masks change from pass to pass as eager's do."""
    model, inputs, counter = _dense_model(DROPOUT, "aot_eager")
    losses, grads = _steps(model, inputs)
    counts = counter.counts()
    assert counts.graph_breaks > 0 and all("torch.compiler.disable" in r for r in counts.break_reasons), counts
    eager_losses, eager_grads = _steps(*_dense_model(DROPOUT, None)[:2])
    assert losses == eager_losses and len(set(losses)) == 3
    torch.testing.assert_close(grads, eager_grads, rtol=0, atol=0)


@pytest.mark.slow
def test_inductor_compiled_layers_give_the_eager_losses_and_gradients():
    """inductor's generated kernels (fused elementwise ops, reordered reductions): fp32 within 1e-5."""
    model, inputs, counter = _dense_model(LLAMA, "inductor")
    losses, grads = _steps(model, inputs, steps=2)
    assert (counter.counts().graphs, counter.counts().graph_breaks) == (1, 0)
    eager_losses, eager_grads = _steps(*_dense_model(LLAMA, None)[:2], steps=2)
    assert relative(losses, eager_losses) <= 1e-5
    torch.testing.assert_close(grads, eager_grads, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("argv, message", [
    (["--compile-backend", "aot_eager"], "--compile-backend aot_eager without --compile compiles nothing"),
    (["--compile", "--zero-stage", "3"], "--compile with --zero-stage 3"),
])
def test_compile_combinations_that_cannot_run_are_refused_in_one_line(argv, message):
    from megatron_lite.config import ConfigError
    from megatron_lite.validation import validate

    with pytest.raises(ConfigError, match=message) as refused:
        validate(tiny_config(dp=2, extra=argv))
    assert "\n" not in str(refused.value)


def test_compile_refuses_inductor_without_a_cpu_compiler_and_names_aot_eager(monkeypatch):
    from megatron_lite.config import ConfigError
    from megatron_lite.validation import compile as rules

    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(rules.shutil, "which", lambda name: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="needs a C[+][+] compiler on CPU .no-such-compiler not found.*aot_eager"):
        rules.compile_rules(tiny_config(extra=["--compile"]), [])
    rules.compile_rules(tiny_config(extra=["--compile", "--compile-backend", "aot_eager"]), [])
