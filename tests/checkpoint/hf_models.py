"""Small random Hugging Face models, saved with save_pretrained, for the import tests.

Every weight is perturbed (norm gains around 1, larger linear weights), so logits are of order 1 and a
wrong mapping cannot hide inside a near-uniform softmax. The vocabulary is the test corpus's
SentencePiece vocabulary (400), so the imported models train and evaluate on its data.
"""
import torch

VOCAB = 400
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g) if "weight" in name or "norm" in name
                        else 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    return model


def llama_config(**overrides):
    import transformers

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=16384, rms_norm_eps=1e-5,
                  rope_scaling=dict(LLAMA3_SCALING), tie_word_embeddings=False)
    fields.update(overrides)
    return transformers.LlamaConfig(**fields)


def save_llama(folder, seed=11, **overrides):
    """A LlamaForCausalLM with grouped-query attention (4 heads, 2 groups), SwiGLU, RMSNorm, an untied head and
    Llama 3.1 RoPE scaling."""
    import transformers

    torch.manual_seed(seed)
    model = _perturb(transformers.LlamaForCausalLM(llama_config(**overrides)), seed).eval()
    model.save_pretrained(str(folder))
    return model


def save_qwen3(folder, seed=13, **overrides):
    """A Qwen3ForCausalLM: QK-norm, heads of 16 (not hidden 32 / 4 heads = 8), 2 key/value groups, a head tied
    to the embedding, no sliding window."""
    import transformers

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = _perturb(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields)), seed).eval()
    model.save_pretrained(str(folder))
    return model


def save_gpt2(folder, seed=12, **overrides):
    """A GPT2LMHeadModel with OpenAI's tanh GeLU (gelu_new), as GPT-2's own checkpoints have."""
    import transformers

    fields = dict(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64, activation_function="gelu_new",
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = _perturb(transformers.GPT2LMHeadModel(transformers.GPT2Config(**fields)), seed).eval()
    model.save_pretrained(str(folder))
    return model


def hf_loss(model, samples):
    """transformers' mean cross entropy over the samples' tokens where their loss mask is 1 (fp32)."""
    tokens = torch.tensor(np_stack([s["tokens"] for s in samples]))
    labels = torch.tensor(np_stack([s["labels"] for s in samples]))
    mask = torch.tensor(np_stack([s["loss_mask"] for s in samples])).float()
    with torch.no_grad():
        logits = model(tokens).logits.float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                            reduction="none").view(labels.shape)
    return ((nll * mask).sum() / mask.sum()).item()


def np_stack(arrays):
    import numpy as np

    return np.stack(arrays)


def _save_moe(folder, model_class, config_class, seed, fields, overrides):
    torch.manual_seed(seed)
    fields.update(overrides)
    model = _perturb(model_class(config_class(**fields)), seed).eval()
    model.save_pretrained(str(folder))
    return model


def moe_router_spread(model):
    """Routers with larger weights than _perturb's, so every expert is chosen for some tokens."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and "shared" not in name:
                p.mul_(4.0)
    return model


def save_mixtral(folder, seed=31, **overrides):
    """A MixtralForCausalLM: 4 experts of width 48, top 2, grouped-query attention, an untied head."""
    import transformers

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, num_local_experts=4, num_experts_per_tok=2,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, router_aux_loss_coef=0.01)
    return _save_moe(folder, transformers.MixtralForCausalLM, transformers.MixtralConfig, seed, fields, overrides)


def save_qwen2_moe(folder, seed=32, **overrides):
    """A Qwen2MoeForCausalLM: 4 experts of width 16, top 2 (not renormalised), a gated shared expert of 24, q/k/v
    biases, the second of its 3 layers dense (mlp_only_layers) with width 48, a head tied to the embedding."""
    import transformers

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, shared_expert_intermediate_size=24, mlp_only_layers=[1],
                  norm_topk_prob=False, qkv_bias=True, tie_word_embeddings=True, use_sliding_window=False)
    return _save_moe(folder, transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig, seed, fields, overrides)


def save_qwen3_moe(folder, seed=33, **overrides):
    """A Qwen3MoeForCausalLM: QK-norm, heads of 16, 4 experts of width 16, top 2 renormalised, every second of its 4
    layers with experts (decoder_sparse_step 2: each of 2 pipeline stages holds one), an untied head."""
    import transformers

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=2, norm_topk_prob=True,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False)
    return _save_moe(folder, transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig, seed, fields, overrides)


def save_deepseek_v3(folder, seed=34, **overrides):
    """A DeepseekV3ForCausalLM: Multi-head Latent Attention (query latent 16, key/value latent 16, heads of 8 + 8
    rotary dimensions, values of 8) with its rotary rows interleaved (rope_interleave) and YaRN (factor 4, mscale
    0.8, mscale_all_dim 1.0); the first of its 4 layers dense, then 8 routed experts of width 16, top 2 of the best
    of 2 groups, sigmoid scores chosen with a selection bias (perturbed from its zeros), a shared expert, scaling
    2.5; an untied head. save_pretrained writes num_nextn_predict_layers 1 and no MTP weights, as transformers
    builds none."""
    import transformers

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                  v_head_dim=8, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=16, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                  norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 1024, "mscale": 0.8, "mscale_all_dim": 1.0})
    return _save_deepseek_moe(folder, transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config, seed, fields,
                              overrides)


def save_glm4_moe(folder, seed=35, **overrides):
    """A Glm4MoeForCausalLM (GLM-4.5's shape): 4 heads in 2 key/value groups of width 16 (not hidden 32 / 4 heads),
    RoPE over the first half of each head (partial_rotary_factor 0.5), QK-norm, q/k/v biases (perturbed from their
    zeros); the first of its 4 layers dense, then 8 routed experts of width 16, top 2 of the best of 2 groups, sigmoid
    scores chosen with a selection bias (perturbed from its zeros), a shared expert, scaling 2.5; an untied head.
    save_pretrained writes num_nextn_predict_layers 1 and no MTP weights, as transformers builds none."""
    import transformers

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
                  first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                  n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False)
    return _save_deepseek_moe(folder, transformers.Glm4MoeForCausalLM, transformers.Glm4MoeConfig, seed, fields,
                              overrides)


def _save_deepseek_moe(folder, model_class, config_class, seed, fields, overrides):
    """_save_moe's, with the routers spread and DeepSeek-V3's selection bias perturbed from its zeros."""
    torch.manual_seed(seed)
    fields.update(overrides)
    model = moe_router_spread(_perturb(model_class(config_class(**fields)), seed)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, bias in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                bias.copy_(0.1 * torch.rand(bias.shape, generator=g))
    model.save_pretrained(str(folder))
    return model
