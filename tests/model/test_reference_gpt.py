"""GPTModel at TP = 1 computes what an independently written plain PyTorch GPT computes."""
import pytest
import torch

from tests.model.gpt_layouts import tiny_config
from tests.model.reference_gpt import ReferenceConfig, ReferenceGPT, load_megatron_lite_state

VARIANTS = {
    "learned positions, tied head": (),
    "rotary positions": ("--position-embedding-type", "rope"),
    "untied head": ("--untie-embeddings-and-output-weights",),
}


def _models(extra):
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    # A vocabulary that gets padded (100 -> 128), so the padded rows are part of the check (in the logits,
    # out of the loss's softmax); weights
    # large enough for logits of order 1, where a wrong mapping or formula cannot hide.
    config = tiny_config(extra=("--num-layers", "2", "--vocab-size", "100", "--init-method-std", "0.2", *extra))
    ours = GPTModel(config).eval()
    model_parallel_seed(config.training.seed, config.model.num_layers)  # dropout streams; eval draws nothing
    # Init leaves LayerNorm gains at 1 and biases at 0: make every parameter matter.
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    m = config.model
    reference = ReferenceGPT(ReferenceConfig(
        vocab_size=m.padded_vocab_size, hidden_size=m.hidden_size, num_heads=m.num_attention_heads,
        num_layers=m.num_layers, ffn_hidden_size=m.ffn_hidden_size, max_positions=m.max_position_embeddings,
        rotary=m.position_embedding_type == "rope", rotary_base=m.rotary_base,
        tied_head=not m.untie_embeddings_and_output_weights, layernorm_epsilon=m.norm_epsilon,
        real_vocab_size=m.vocab_size)).eval()
    load_megatron_lite_state(reference, ours.state_dict())
    return config, ours, reference


@pytest.mark.parametrize("backend", ["sdpa", "fused"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpt_model_gives_the_logits_and_loss_of_an_independent_plain_pytorch_gpt(variant, backend):
    config, ours, reference = _models(tuple(VARIANTS[variant]) + ("--attention-backend", backend))
    g = torch.Generator().manual_seed(4)
    b, s = 3, config.model.seq_length
    tokens = torch.randint(0, config.model.vocab_size, (b, s + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    loss_mask = (torch.rand(b, s, generator=g) > 0.2).float()
    positions = torch.arange(s).expand(b, s)
    with torch.no_grad():
        logits = ours(inputs, positions)
        loss = ours(inputs, positions, labels, loss_mask)
        expected_logits = reference(inputs)
        expected_loss = reference(inputs, labels, loss_mask)
    assert expected_logits.abs().max() > 1.0, "logits this small would hide errors"
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
