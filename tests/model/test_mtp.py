"""Multi-Token Prediction (model/mtp.py, data/mtp.py): a depth's logits equal transformers' MtpLayer on DeepSeek-V3's
decoder layer (embedding first, the main model's normed hidden state, its own post-norm, the shared head); the depth
inputs roll per document like Megatron-LM's packed roll; the reported loss is the language model's while its
gradient is the main loss's plus factor / D x the depths'; the flags are refused where they cannot work."""
import numpy as np
import pytest
import torch

from megatron_lite.config import ConfigError
from megatron_lite.data.context_parallel import mtp_context_parallel_part
from megatron_lite.data.mtp import mtp_arrays
from tests.model.gpt_layouts import tiny_config
from tests.model.test_hf_llama_reference import VOCAB, load_into_hf, our_model, random_tokens, relative_error

transformers = pytest.importorskip("transformers")


def rolled_by_hand(tokens, labels, mask, documents, depths):
    """data/mtp.py's arrays, position by position."""
    b, s = tokens.shape
    out = [np.zeros((b, depths, s), dtype=a.dtype) for a in (tokens, labels, mask)]
    for r in range(b):
        for k in range(1, depths + 1):
            for i in range(s):
                if i + k < s and (documents is None or documents[r, i + k] == documents[r, i]):
                    for o, a in zip(out, (tokens, labels, mask)):
                        o[r, k - 1, i] = a[r, i + k]
    return out


@pytest.mark.parametrize("with_documents", [False, True])
def test_depth_inputs_roll_per_document_and_zero_past_each_end(with_documents):
    g = np.random.default_rng(0)
    tokens = g.integers(1, 50, (3, 16))
    labels, mask = g.integers(1, 50, (3, 16)), (g.random((3, 16)) > 0.2).astype(np.float32)
    documents = np.sort(g.integers(0, 4, (3, 16)), axis=1) if with_documents else None
    expected = rolled_by_hand(tokens, labels, mask, documents, 3)
    for got, want in zip(mtp_arrays(tokens, labels, mask, documents, 3), expected):
        np.testing.assert_array_equal(got, want)
    as_tensors = mtp_arrays(*(torch.from_numpy(a) for a in (tokens, labels, mask)),
                            None if documents is None else torch.from_numpy(documents), 3)
    for got, want in zip(as_tensors, expected):
        np.testing.assert_array_equal(got.numpy(), want)


def test_a_cp_rank_whose_part_of_a_depth_is_all_masked_weighs_zero_and_the_parts_add_up_to_the_mean():
    """A document ending at the CP boundary leaves rank 0's last position of depth 1 masked, and with a mask that is
    zero on rank 0's whole part, rank 0's weights are zeros, not 0/0 (Megatron-LM PR #3396's NaN)."""
    tokens = torch.arange(1, 9)[None]
    documents = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])  # the document ends at the boundary of 2 CP ranks
    mask = torch.tensor([[0.0, 0, 0, 0, 1, 1, 1, 1]])
    mtp = mtp_arrays(tokens, tokens + 1, mask, documents, 1)
    assert mtp[2].tolist() == [[[0, 0, 0, 0, 1, 1, 1, 0]]]
    parts = [mtp_context_parallel_part(mtp, rank, 2) for rank in (0, 1)]
    assert torch.equal(parts[0][2], torch.zeros(1, 1, 4)) and not torch.isnan(parts[1][2]).any()
    losses = torch.rand(1, 1, 8)
    whole = (losses * mtp[2]).sum() / mtp[2].sum()
    shares = sum((losses[..., r * 4:(r + 1) * 4] * p[2]).sum() for r, p in enumerate(parts))
    assert torch.allclose(shares / 2, whole)  # DeepSpeed averages the C ranks' shares


MTP = ["--num-layers", "3", "--init-method-std", "0.1", "--vocab-size", str(VOCAB), "--swiglu", "--normalization",
       "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96",
       "--norm-epsilon", "1e-6", "--max-position-embeddings", "64", "--multi-latent-attention", "--kv-lora-rank", "16",
       "--q-lora-rank", "24", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12",
       "--qk-layernorm", "--position-embedding-type", "rope", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-ffn-hidden-size", "16", "--moe-layer-freq", "([0]*1+[1]*2)", "--moe-router-score-function", "sigmoid",
       "--moe-router-enable-expert-bias", "--moe-shared-expert-intermediate-size", "16", "--mtp-num-layers", "1"]
"""DeepSeek-V3's block (MLA, a dense layer then sigmoid-routed experts with a shared one); one depth, of the last
layer's kind (experts), as transformers builds its MTP layer."""


def test_a_depth_gives_transformers_mtp_layer_logits_on_the_deepseek_v3_block():
    from megatron_lite.checkpoint.hf_deepseek_v3 import hf_config, to_hf
    from transformers.modeling_layers import MtpModel

    config = tiny_config(extra=MTP)
    ours = our_model(config)
    with torch.no_grad():  # norms away from 1, so a norm left out or swapped changes the logits
        g = torch.Generator().manual_seed(5)
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight") or "norm." in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    state = ours.state_dict()
    depth = "layers.6.depths.0."  # embedding 0, layers 1-3, final norm 4, (the tied embedding 5), MTP 6, head 7
    main_state = {k: v for k, v in state.items() if not k.startswith("layers.6.")}
    main_state["layers.5.output.weight"] = main_state.pop("layers.7.output.weight")
    plain = tiny_config(extra=plain_flags())
    hf = transformers.DeepseekV3ForCausalLM._from_config(
        transformers.DeepseekV3Config.from_dict({**hf_config(plain.model), "num_nextn_predict_layers": 1}),
        attn_implementation="eager", dtype=torch.float32).eval()
    load_into_hf(hf, to_hf(main_state, plain.model, fused=True))
    mtp = MtpModel(hf, 1).eval()
    # The depth's decoder layer through the layer table: as layer 4 of a 4-layer model, it is model.layers.3.
    four = tiny_config(extra=[{"3": "4", "([0]*1+[1]*2)": "([0]*1+[1]*3)"}.get(f, f) for f in plain_flags()])
    four_state = {k: v for k, v in main_state.items() if not k.startswith(("layers.4.", "layers.5."))}
    four_state |= {k.replace(depth + "layer.", "layers.4."): v for k, v in state.items() if k.startswith(depth + "layer.")}
    four_state |= {"layers.5.weight": main_state["layers.4.weight"],
                   "layers.6.output.weight": main_state["layers.5.output.weight"]}
    hf_layer = {k[len("model.layers.3."):]: v for k, v in to_hf(four_state, four.model, fused=True).items()
                if k.startswith("model.layers.3.")}
    mtp.layers[0].mtp_block.load_state_dict(hf_layer, strict=True)
    with torch.no_grad():
        for ours_name, theirs in (("enorm", mtp.layers[0].enorm), ("hnorm", mtp.layers[0].hnorm),
                                  ("final_layernorm", mtp.layers[0].post_norm)):
            theirs.weight.copy_(state[depth + ours_name + ".weight"])
        mtp.layers[0].eh_proj.weight.copy_(state[depth + "eh_proj.weight"])

    tokens = random_tokens()
    b, s = tokens.shape
    labels = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
    depth_tokens, depth_labels, depth_mask = mtp_arrays(tokens, labels, torch.ones(b, s), None, 1)
    positions = torch.arange(s).expand(b, s)
    with torch.no_grad():
        logits = ours(tokens, positions, mtp=(depth_tokens, depth_labels, depth_mask))
        main = hf.model(tokens).last_hidden_state  # after the final norm
        hidden = mtp.forward_layer(0, main, positions, None, input_ids=depth_tokens[:, 0])
        theirs = mtp._project_to_logits(hidden)
    assert relative_error(hf.lm_head(main), logits[:b, :, :VOCAB]) <= 1e-5
    assert relative_error(theirs, logits[b:, :, :VOCAB]) <= 1e-5


def plain_flags():
    """MTP's model without the depths."""
    return MTP[:MTP.index("--mtp-num-layers")]


def test_the_reported_loss_is_the_language_models_and_its_gradient_adds_the_depths_scaled():
    config = tiny_config(extra=MTP + ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"])
    model = our_model(config).train()
    tokens = random_tokens()
    b, s = tokens.shape
    labels = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
    mask = torch.ones(b, s)
    depth = mtp_arrays(tokens, labels, mask, None, 2)
    positions = torch.arange(s).expand(b, s)
    loss = model(tokens, positions, labels, mask, mtp=depth)
    main = model(tokens, positions, labels, mask)  # no depth arrays: the language model's loss alone
    assert loss.item() == pytest.approx(main.item(), rel=1e-6)
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(loss, params, allow_unused=True)

    from megatron_lite.model import mtp
    from megatron_lite.model.gpt import reduce_losses, token_losses
    logits = model(tokens, positions, mtp=depth)
    main_loss, depth_losses = mtp.depth_losses(logits, (labels, mask, *depth[1:]),
                                               lambda x, y: token_losses(x, y, VOCAB), reduce_losses)
    want = torch.autograd.grad(main_loss + 0.3 / 2 * depth_losses.sum(), params, allow_unused=True)
    for p, a, w in zip(params, got, want):
        if w is None:
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-7)
    assert any(w is not None and w.abs().sum() > 0 for w in want[-20:])  # the depths' weights are trained


@pytest.mark.parametrize("flags, says", [
    (["--mtp-num-layers", "1"], "--position-embedding-type learned_absolute"),
    (["--mtp-loss-scaling-factor", "0.3"], "there are none; add --mtp-num-layers D"),
    (["--position-embedding-type", "rope", "--mtp-num-layers", "40"], "past its end"),
    (["--position-embedding-type", "rope", "--mtp-num-layers", "1", "--pipeline-partition-method", "profile"],
     "--pipeline-partition-method cost"),
])
def test_mtp_flags_that_cannot_work_are_refused_naming_them(flags, says):
    with pytest.raises(ConfigError) as refused:
        tiny_config(extra=flags)
    assert says in str(refused.value)
