"""--optimizer muon at TP = PP = DP = 1 is torch.optim.Muon on each of the dense model's matrices (Q, K and V,
gate and up, every expert) and torch's AdamW on the rest; bad combinations are refused with one line."""
import pytest
import torch

from megatron_lite.checkpoint.optimizer_groups import parameter_groups
from megatron_lite.model.gpt import GPTModel
from megatron_lite.training.optimizer import build_optimizer
from tests.model.gpt_layouts import tiny_config

MUON_MODEL = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
              "--moe-shared-expert-intermediate-size", "64", "--moe-layer-freq", "([0]*1+[1]*3)", "--swiglu",
              "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
              "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2",
              "--optimizer", "muon", "--weight-decay", "0.1", "--lr", "0.02", "--muon-fp32-matmul-prec", "medium")
"""Llama's block with 2 key/value groups (Q, K and V of different sizes), SwiGLU, and MoE layers with SwiGLU
experts and a shared expert: every kind of matrix Muon splits. Newton-Schulz in bf16, as torch's."""

# Our scale mode and extra factor -> torch.optim.Muon's adjust_lr_fn giving the same update.
TORCH_ADJUST = {("spectral", "0.2"): "match_rms_adamw", ("shape_scaling", "1"): "original"}


def _matrices(name, param, model_config):
    """The dense model's matrices in a parameter, as views: written by hand from the config (not from our
    optimizer's reading of the partition attributes), so a wrong split in ours fails here."""
    heads, groups = model_config.num_attention_heads, model_config.num_query_groups
    head_dim = model_config.hidden_size // heads
    if name.endswith("query_key_value.weight"):
        return list(param.split([heads * head_dim, groups * head_dim, groups * head_dim]))
    if name.endswith("dense_h_to_4h.weight"):  # SwiGLU [gate; up]
        return list(param.chunk(2))
    if name.endswith("experts.weight1"):
        return [half for expert in param for half in expert.chunk(2)]
    if name.endswith("experts.weight2"):
        return list(param)
    return [param]


@pytest.mark.parametrize("scale_mode, extra", list(TORCH_ADJUST))
def test_two_steps_equal_torch_muon_on_each_dense_matrix_and_torch_adamw_on_the_rest(scale_mode, extra):
    config = tiny_config(extra=MUON_MODEL + ("--muon-scale-mode", scale_mode, "--muon-extra-scale-factor", extra))
    opt = config.optimizer
    ours = GPTModel(config)
    theirs = {name: p.detach().clone() for name, p in ours.named_parameters()}
    optimizer = build_optimizer(ours, opt)
    muon_names = [n for n, p in ours.named_parameters() if getattr(p, "hidden_matrix", False)]
    assert len(muon_names) == 4 * 4 + 3 * 2  # QKV, dense, 2 MLP matrices per layer; + experts' 2 and shared 2
    pieces = {name: [m.clone().requires_grad_() for m in _matrices(name, theirs[name], config.model)]
              for name in muon_names}
    rest = {name: t.requires_grad_() for name, t in theirs.items() if name not in pieces}
    torch_muon = torch.optim.Muon([p for ps in pieces.values() for p in ps], lr=opt.lr, weight_decay=opt.weight_decay,
                                  momentum=opt.muon_momentum, nesterov=opt.muon_nesterov,
                                  ns_steps=opt.muon_num_ns_steps, adjust_lr_fn=TORCH_ADJUST[(scale_mode, extra)])
    torch_adamw = torch.optim.AdamW(parameter_groups(rest.values(), opt.weight_decay), lr=opt.lr,
                                    betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps, fused=True)
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):  # the second step uses the momentum of the first
        for name, p in ours.named_parameters():
            p.grad = torch.randn(p.shape, generator=generator)
            if name in pieces:
                for piece, grad in zip(pieces[name], _matrices(name, p.grad, config.model)):
                    piece.grad = grad.clone()
            else:
                rest[name].grad = p.grad.clone()
        optimizer.step()
        torch_muon.step()
        torch_adamw.step()
    for name, p in ours.named_parameters():
        expected = torch.cat([m.detach().reshape(-1) for m in pieces[name]]) if name in pieces else rest[name].detach()
        # Relative to the tensor: ours scales O before the step, torch the learning rate (1-ulp differences).
        torch.testing.assert_close(p.detach().reshape(-1), expected.reshape(-1), rtol=1e-5,
                                   atol=1e-5 * expected.abs().max().item(), msg=lambda m: f"{name}: {m}")
    moved = (ours.layers[1].attention.query_key_value.weight - theirs["layers.1.attention.query_key_value.weight"])
    assert moved.abs().max() > 1e-4  # the comparison saw an update


def test_the_fused_qkv_as_one_matrix_is_not_the_dense_update():
    """--muon-no-split-qkv orthogonalises [Q; K; V] whole: a different update (what the split test guards)."""
    updates = []
    for extra in ((), ("--muon-no-split-qkv",)):
        config = tiny_config(extra=MUON_MODEL + extra)
        model = GPTModel(config)
        weight = model.layers[1].attention.query_key_value.weight
        before = weight.detach().clone()
        weight.grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
        build_optimizer(model, config.optimizer).step()
        updates.append(weight.detach() - before)
    assert (updates[0] - updates[1]).abs().max() > 1e-2 * updates[0].abs().max()


@pytest.mark.parametrize("extra, message", [
    (("--zero-stage", "3"), "--optimizer muon runs at --zero-stage 0, 1 or 2"),
    (("--zero-stage", "1", "--cpu-offload"), "--optimizer muon does not run with --cpu-offload"),
])
def test_muon_where_it_cannot_see_whole_matrices_is_refused_naming_the_flags(extra, message):
    from megatron_lite.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        tiny_config(dp=2, extra=("--optimizer", "muon") + extra)


def test_an_unknown_scale_mode_exits_2_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as stopped:
        tiny_config(extra=("--optimizer", "muon", "--muon-scale-mode", "rms"))
    assert stopped.value.code == 2
    assert "--muon-scale-mode: invalid choice: 'rms' (choose from 'spectral', 'unit_rms_norm', 'shape_scaling')" \
        in capsys.readouterr().err
