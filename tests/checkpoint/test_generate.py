"""generate: seeded sampling, greedy decoding of a memorised text, KV cache equal to recomputation."""
import pytest
import torch

from tests.checkpoint.conftest import run_tool

TEXT = "the quick brown fox jumps over the lazy dog. "


def _memorising_model(tokenizer_model, tmp_path):
    """A tiny GPT trained here, plain torch, until it has learned one repeated sentence by heart."""
    import sentencepiece

    from megatron_lite.checkpoint.merge import save_merged
    from megatron_lite.config import Config, DataConfig, ModelConfig, TrainingConfig
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.random import model_parallel_seed

    sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
    ids = sp.encode(TEXT * 12)
    config = Config(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                                      seq_length=32, max_position_embeddings=32, vocab_size=sp.vocab_size(),
                                      padded_vocab_size=sp.vocab_size(), hidden_dropout=0.0, attention_dropout=0.0),
                    data=DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=tokenizer_model),
                    training=TrainingConfig(seed=3))
    torch.manual_seed(0)
    model = GPTModel(config)
    model_parallel_seed(3, config.model.num_layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.tensor(ids)
    positions = torch.arange(32).unsqueeze(0).expand(8, 32)
    for step in range(150):
        starts = torch.randint(0, len(ids) - 33, (8,))
        batch = torch.stack([data[s:s + 33] for s in starts])
        loss = model(batch[:, :-1], positions, batch[:, 1:], torch.ones(8, 32))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    path = tmp_path / "memorised.pt"
    save_merged(str(path), config, model.state_dict(), 150, 0)
    return str(path), sp, loss.item()


@pytest.mark.slow
def test_greedy_decoding_of_a_memorised_text_reproduces_it(corpus, tmp_path):
    path, sp, loss = _memorising_model(corpus[1], tmp_path)
    assert loss < 0.1, loss
    prompt = "the quick brown"
    continuation = sp.decode(sp.encode(TEXT * 3))
    # positions past the 32 the model was trained on were never learned: stay within them
    new = 32 - len(sp.encode(prompt))
    result = run_tool("tools/generate.py", "--load", path, "--prompt", prompt, "--max-new-tokens", str(new))
    text = result.stdout.strip().splitlines()[-1]  # DeepSpeed may log a line before it
    assert text.startswith(prompt) and len(text) >= len(prompt) + 20
    assert continuation.startswith(text), (text, continuation)
    assert "tokens/s" in result.stderr and "greedy" in result.stderr


@pytest.fixture(scope="module")
def trained(run22):
    from megatron_lite.checkpoint.dense import load_dense_model

    return load_dense_model(run22["ckpt"])


@pytest.fixture(scope="module")
def rotary(rope_run):
    from megatron_lite.checkpoint.dense import load_dense_model

    return load_dense_model(rope_run)


PROMPT = [5, 17, 33, 2, 91, 140]


@pytest.mark.slow
def test_sampling_is_deterministic_with_a_seed(trained):
    from megatron_lite.inference.generation import SamplingOptions, generate

    config, model = trained

    def sample(seed):
        return generate(model, config, PROMPT, SamplingOptions(max_new_tokens=20, temperature=1.5, top_k=50,
                                                               top_p=0.95, seed=seed))

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


@pytest.mark.slow
@pytest.mark.parametrize("model_fixture", ["trained", "rotary"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kv_cache_gives_the_same_tokens_as_recomputing_the_sequence(model_fixture, temperature, request):
    from megatron_lite.inference.generation import SamplingOptions, forward_tokens, generate
    from megatron_lite.inference.kv_cache import KVCache

    config, model = request.getfixturevalue(model_fixture)
    options = dict(max_new_tokens=24, temperature=temperature, top_p=0.9, seed=7)
    cached = generate(model, config, PROMPT, SamplingOptions(use_kv_cache=True, **options))
    recomputed = generate(model, config, PROMPT, SamplingOptions(use_kv_cache=False, **options))
    assert cached == recomputed and len(cached) == 24

    # and the logits themselves: prompt in two chunks through the cache vs the whole sequence at once
    tokens = torch.tensor([PROMPT + cached[:10]])
    with torch.no_grad():
        whole = model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0))
        caches = [KVCache() for _ in range(config.model.num_layers)]
        first = forward_tokens(model, config, tokens[:, :7], 0, caches)
        rest = forward_tokens(model, config, tokens[:, 7:], 7, caches)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), whole, rtol=1e-5, atol=1e-5)


def test_top_k_and_top_p_keep_only_the_allowed_tokens():
    from megatron_lite.inference.sampling import sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    top_k = {int(sample(logits, 1.0, top_k=2, generator=g)) for _ in range(300)}
    assert top_k == {0, 1}
    top_p = {int(sample(logits, 1.0, top_p=0.75, generator=g)) for _ in range(300)}
    assert top_p == {0, 1}  # 0.5 + 0.3 already passes 0.75: the third token is out
    assert {int(sample(logits, 1.0, top_p=0.81, generator=g)) for _ in range(300)} == {0, 1, 2}
    assert int(sample(logits, 0.0)) == 0
