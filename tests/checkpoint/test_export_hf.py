"""export-hf: Hugging Face's own GPT2LMHeadModel / LlamaForCausalLM on the exported folder is our GPT (the external
reference)."""
import json

import pytest
import torch

from tests.checkpoint.conftest import run_tool

pytestmark = pytest.mark.slow

TEXT = ('def read_config(path):\n    """Read a JSON file and return its contents."""\n'
        '    with open(path) as f:\n        return json.load(f)\n')


def _export(ckpt, tmp_path, architecture):
    """export-hf of `ckpt` into tmp_path/hf: (the folder, its config.json), checked to hold the three files."""
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    out = tmp_path / "hf"
    result = run_tool("tools/convert_checkpoint.py", "export-hf", "--load", ckpt, "--output", str(out))
    assert architecture in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.model"]
    return out, json.loads((out / "config.json").read_text())


def test_hf_gpt2_gives_our_dense_logits_on_real_text_and_the_same_greedy_continuation(run22, tmp_path):
    out, hf_config = _export(run22["ckpt"], tmp_path, "GPT2LMHeadModel")
    import sentencepiece
    import transformers

    from megatron_lite.checkpoint.dense import load_dense_model
    from megatron_lite.inference.generation import SamplingOptions, generate

    assert hf_config["activation_function"] == "gelu" and hf_config["tie_word_embeddings"] is True

    config, ours = load_dense_model(run22["ckpt"])
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    sp = sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    ids = sp.encode(TEXT)[: config.model.seq_length]
    assert len(ids) >= 16
    tokens = torch.tensor([ids])
    with torch.no_grad():
        expected = ours(tokens, torch.arange(len(ids)).unsqueeze(0))[..., : config.model.vocab_size]
        theirs = hf(tokens).logits
    assert theirs.shape == expected.shape
    rel = ((theirs - expected).abs().max() / expected.abs().max()).item()
    assert rel <= 1e-4, rel

    # The padded vocabulary rows are out of our loss's softmax: our loss is GPT-2's on the same tokens.
    labels = tokens[:, 1:]
    positions = torch.arange(len(ids) - 1).unsqueeze(0)
    with torch.no_grad():
        ours_nll = ours(tokens[:, :-1], positions, labels, torch.ones_like(labels, dtype=torch.float))
    hf_nll = torch.nn.functional.cross_entropy(theirs[0, :-1].float(), labels[0])
    assert config.model.padded_vocab_size > config.model.vocab_size, "the case must have padded rows"
    assert ours_nll.item() == pytest.approx(hf_nll.item(), rel=1e-5)

    prompt = ids[:6]
    new = 12
    ours_greedy = generate(ours, config, prompt, SamplingOptions(max_new_tokens=new, temperature=0.0))
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=sp.eos_id())
    assert hf_out[0, len(prompt):].tolist() == ours_greedy


def test_hf_llama_on_an_exported_tp2_llama_block_gives_our_dense_logits(llama_run, tmp_path):
    out, hf_config = _export(llama_run["ckpt"], tmp_path, "LlamaForCausalLM")
    import sentencepiece
    import transformers

    from megatron_lite.checkpoint.dense import load_dense_model

    assert hf_config["num_key_value_heads"] == 2 and hf_config["rope_scaling"]["rope_type"] == "llama3"

    config, ours = load_dense_model(llama_run["ckpt"])
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    sp = sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert hf_config["eos_token_id"] == sp.eos_id()
    ids = sp.encode(TEXT)[: config.model.seq_length]
    tokens = torch.tensor([ids])
    with torch.no_grad():
        expected = ours(tokens, torch.arange(len(ids)).unsqueeze(0))[..., : config.model.vocab_size]
        theirs = hf(tokens).logits
    assert theirs.shape == expected.shape
    assert ((theirs - expected).abs().max() / expected.abs().max()).item() <= 1e-5
