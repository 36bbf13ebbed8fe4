"""transformers' own GptOssForCausalLM is the external reference for our GPT with attention sinks, alternating
sliding-window layers, YaRN without truncation and biased, clamped quick-GeGLU experts behind a biased router: built
from hf_gpt_oss.hf_config() and given our weights through to_hf() (or giving us its weights through from_hf()), it
computes our logits and loss on the unpadded vocabulary (eager attention, fp32).

The tiny model has every part that can be mapped wrong: 4 layers (sliding, full, sliding, full), a window of 4 on a
sequence of 16, heads of 24 (not hidden 64 / 4 heads = 16), 2 key/value groups, 4 experts (top 2) whose gate and up
columns transformers interleaves, every bias, sink and norm moved away from its initial value, the router spread so
that every expert is chosen, a clamp (1.0) that the experts' halves cross, and YaRN whose ramp ends fall between
dimensions (truncate false keeps them there)."""
import pytest
import torch

from megatron_lite.checkpoint.hf_gpt_oss import as_ours, from_hf, hf_config, mapping, model_fields, to_hf
from tests.model.gpt_layouts import tiny_config
from tests.model.test_hf_llama_reference import VOCAB, load_into_hf, our_model, relative_error

transformers = pytest.importorskip("transformers")

BATCH, SEQ, WINDOW = 2, 16, 4
GPT_OSS = ["--num-layers", "4", "--seq-length", str(SEQ), "--max-position-embeddings", "4096", "--init-method-std",
           "0.1", "--vocab-size", str(VOCAB), "--normalization", "RMSNorm", "--norm-epsilon", "1e-5",
           "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2",
           "--kv-channels", "24", "--softmax-type", "learnable", "--window-size", f"{WINDOW - 1},0",
           "--window-attn-skip-freq", "2", "--quick-geglu", "--glu-linear-offset", "1.0",
           "--activation-func-clamp-value", "1.0", "--num-experts", "4", "--moe-router-topk", "2",
           "--moe-ffn-hidden-size", "24", "--ffn-hidden-size", "24", "--moe-aux-loss-coeff", "0.001"]
YARN = ["--position-embedding-type", "yarn", "--rotary-base", "10000", "--rotary-scaling-factor", "4",
        "--yarn-original-max-position-embeddings", "1024", "--yarn-beta-fast", "8",
        "--no-yarn-correction-range-round-to-int"]


def gpt_oss_config(extra=()):
    return tiny_config(extra=GPT_OSS + YARN + list(extra))


def hf_model(hf_dict):
    config = transformers.GptOssConfig.from_dict(hf_dict)
    return transformers.GptOssForCausalLM._from_config(config, attn_implementation="eager",
                                                       dtype=torch.float32).eval()


def perturbed(model, seed=5):
    """Norms around 1, sinks and biases away from 0 (the biases small beside the embeddings, which would otherwise
    route every token alike) and the routers spread (every expert chosen), in either model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")) or name.startswith("layers.5."):
                t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=g))
            elif name.endswith(("sinks", "softmax_offset")):
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
            elif name.endswith("bias"):
                t.copy_(0.05 * torch.randn(t.shape, generator=g))
            if name.endswith("router.weight"):
                t.mul_(4.0)
    return model


def random_tokens(seed=0):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def logits_and_losses(ours, hf, tokens):
    """(our logits [.., :VOCAB], theirs, our loss, theirs): the loss of predicting each next token."""
    with torch.no_grad():
        expected = ours(tokens, torch.arange(SEQ).expand(BATCH, SEQ))[..., :VOCAB]
        out = hf(tokens, labels=tokens)
    loss = torch.nn.functional.cross_entropy(expected[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    return expected, out.logits, loss.item(), out.loss.item()


def ours_and_hf(config, edit=lambda hf_dict: hf_dict, theirs=to_hf):
    """Our perturbed model and transformers' with its weights (`theirs`: the conversion)."""
    torch.manual_seed(2)
    ours = perturbed(our_model(config))
    hf = hf_model(edit(hf_config(config.model)))
    load_into_hf(hf, theirs(ours.state_dict(), config.model))
    return ours, hf


def test_the_tiny_model_routes_to_every_expert_in_every_layer_and_clamps_the_experts_halves():
    """So a wrong expert order, or a gate swapped with up, cannot hide behind idle experts or an idle clamp."""
    _, hf = ours_and_hf(gpt_oss_config())
    chosen, gate_up = [set() for _ in hf.model.layers], []
    hooks = [layer.mlp.router.register_forward_hook(lambda module, args, out, i=i: chosen[i].update(
        out[2].flatten().tolist())) for i, layer in enumerate(hf.model.layers)]
    experts = hf.model.layers[0].mlp.experts
    apply_gate = experts._apply_gate
    experts._apply_gate = lambda x: gate_up.append(x) or apply_gate(x)  # the experts' [gate, up] before the clamp
    with torch.no_grad():
        hf(random_tokens())
    for hook in hooks:
        hook.remove()
    del experts._apply_gate
    assert chosen == [set(range(4))] * 4
    values = torch.cat([x.flatten() for x in gate_up])
    assert (values > 1.0).any() and (values < -1.0).any()


@pytest.mark.parametrize("backend", ["sdpa", "fused"])
def test_hf_gpt_oss_with_our_weights_through_to_hf_gives_our_logits_and_loss(backend):
    ours, hf = ours_and_hf(gpt_oss_config(["--attention-backend", backend]))
    expected, theirs, our_loss, their_loss = logits_and_losses(ours, hf, random_tokens())
    assert relative_error(theirs, expected) <= 1e-5
    assert abs(our_loss - their_loss) <= 1e-5 * their_loss


def test_our_model_with_hf_gpt_oss_weights_through_from_hf_gives_its_logits_and_loss():
    config = gpt_oss_config()
    torch.manual_seed(3)
    hf = perturbed(hf_model(hf_config(config.model)))
    ours = our_model(config)
    ours.load_state_dict(from_hf(hf.state_dict(), config.model), strict=True)
    expected, theirs, our_loss, their_loss = logits_and_losses(ours, hf, random_tokens(1))
    assert relative_error(theirs, expected) <= 1e-5
    assert abs(our_loss - their_loss) <= 1e-5 * their_loss


def _without_interleave(dense, m):
    """A converter that forgets transformers' interleaved gate/up columns: it transposes our [gate; up] halves as
    they are. Its tensors have the right names and shapes, so transformers loads them."""
    hf = to_hf(dense, m)
    for i in range(m.num_layers):
        experts = f"model.layers.{i}.mlp.experts."
        hf[experts + "gate_up_proj"] = dense[f"layers.{i + 1}.mlp.experts.weight1"].transpose(1, 2).contiguous()
        hf[experts + "gate_up_proj_bias"] = dense[f"layers.{i + 1}.mlp.experts.bias1"].clone()
    return hf


def test_the_match_depends_on_the_interleave_the_sinks_the_windows_and_yarns_untruncated_ramp():
    """Each ingredient moves transformers' logits by over 100 times the tolerance: expert columns left in halves
    (transformers takes every other column as the gate), sinks or the routers' biases at zero, no sliding layers,
    YaRN's ramp truncated to whole dimensions (the least: 5e-3 over 16 positions), a clamp of gpt-oss's 7."""
    config = gpt_oss_config()
    tokens = random_tokens()
    ours, hf = ours_and_hf(config)
    expected = logits_and_losses(ours, hf, tokens)[0]
    variants = {
        "halves, not interleaved": dict(theirs=_without_interleave),
        "sinks at zero": dict(theirs=lambda d, m: {k: torch.zeros_like(v) if k.endswith("sinks") else v
                                                   for k, v in to_hf(d, m).items()}),
        "router bias at zero": dict(theirs=lambda d, m: {k: torch.zeros_like(v) if k.endswith("router.bias") else v
                                                         for k, v in to_hf(d, m).items()}),
        "no sliding layers": dict(edit=lambda c: dict(c, layer_types=["full_attention"] * 4)),
        "truncated ramp": dict(edit=lambda c: dict(c, rope_scaling=dict(c["rope_scaling"], truncate=True))),
        "clamp 7": dict(edit=lambda c: dict(c, swiglu_limit=7.0)),
    }
    for what, change in variants.items():
        _, other = ours_and_hf(config, **change)
        assert relative_error(logits_and_losses(ours, other, tokens)[1], expected) > 1e-3, what


def test_to_hf_interleaves_the_experts_gate_and_up_columns_in_transformers_in_out_layout():
    """gate_up_proj [E, h, 2F]: column 2j is our gate row j, 2j + 1 our up row j; down_proj [E, F, h] is our
    [E, h, F] transposed; the biases alike."""
    config = gpt_oss_config()
    dense = perturbed(our_model(config)).state_dict()
    hf = to_hf(dense, config.model)
    w1, b1 = dense["layers.2.mlp.experts.weight1"], dense["layers.2.mlp.experts.bias1"]
    gate_up, bias = hf["model.layers.1.mlp.experts.gate_up_proj"], hf["model.layers.1.mlp.experts.gate_up_proj_bias"]
    assert gate_up.shape == (4, 64, 48) and bias.shape == (4, 48)
    assert torch.equal(gate_up[..., 0::2], w1[:, :24].transpose(1, 2)) and torch.equal(gate_up[..., 1::2],
                                                                                       w1[:, 24:].transpose(1, 2))
    assert torch.equal(bias[:, 0::2], b1[:, :24]) and torch.equal(bias[:, 1::2], b1[:, 24:])
    assert torch.equal(hf["model.layers.1.mlp.experts.down_proj"],
                       dense["layers.2.mlp.experts.weight2"].transpose(1, 2))
    assert torch.equal(as_ours("model.layers.1.mlp.experts.gate_up_proj", gate_up), w1)
    assert torch.equal(hf["model.layers.1.self_attn.sinks"], dense["layers.2.attention.softmax_offset"])


def test_to_hf_then_from_hf_gives_back_every_weight_exactly_and_the_config_reads_back():
    config = gpt_oss_config()
    m = config.model
    dense = perturbed(our_model(config)).state_dict()
    for name in ("layers.0.word_embeddings.weight", "layers.6.output.weight"):
        dense[name][VOCAB:] = 0  # the rows padding the vocabulary, which Hugging Face has not: zeros on the way in
    back = from_hf(to_hf(dense, m), m)
    assert list(back) == [e.ours for e in mapping(m)] and set(back) == set(dense)
    for name, tensor in back.items():
        assert torch.equal(tensor, dense[name]), name
    fields = model_fields(hf_config(m), "config.json")
    for name, value in fields.items():
        assert getattr(m, name) == value or name == "num_query_groups", name
    assert (fields["window_size"], fields["window_attn_skip_freq"], fields["yarn_correction_range_round_to_int"]) == (
        (WINDOW - 1, 0), 2, False)


def test_transformers_sliding_layers_are_ours_windowed_and_its_window_counts_the_query():
    """layer_types[i] (0-based) slides where i + 1 is odd; our --window-attn-skip-freq 2 makes layers 2 and 4
    (counted from 1) global; sliding_window 4 is a query and the 3 keys before it: --window-size 3,0."""
    from megatron_lite.model.attention_options import layer_window

    config = gpt_oss_config()
    hf = hf_model(hf_config(config.model))
    assert hf.config.layer_types == ["sliding_attention", "full_attention"] * 2 and hf.config.sliding_window == WINDOW
    assert [layer_window(config.model, i + 1) for i in range(4)] == [WINDOW - 1, None, WINDOW - 1, None]
    assert [layer.self_attn.sliding_window for layer in hf.model.layers] == [WINDOW, None, WINDOW, None]
