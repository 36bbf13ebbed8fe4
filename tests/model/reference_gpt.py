"""A plain PyTorch GPT, written for the tests without any megatron_lite import.

nanoGPT-shaped: pre-LayerNorm blocks, learned absolute positions or rotary
(RoFormer, halves rotated), exact GeLU, biases everywhere but the head, a head
tied to the word embedding unless untied, causal softmax attention written out.
`load_megatron_lite_state` fills it from a TP = 1 `GPTModel.state_dict()`, so
the project's GPT can be checked against a model that shares no code with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


@dataclass
class ReferenceConfig:
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_layers: int
    ffn_hidden_size: int
    max_positions: int
    rotary: bool = False
    rotary_base: int = 10000
    tied_head: bool = True
    layernorm_epsilon: float = 1e-5
    real_vocab_size: Optional[int] = None
    """The tokenizer's vocabulary: the loss's softmax covers only these columns (the rest is TP padding)."""


def gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def rotate(x, base):
    """RoPE on [b, heads, s, d]: pair dimension i with i + d/2, turn the pair by angle pos * base^(-2i/d)."""
    s, d = x.shape[-2], x.shape[-1]
    half = d // 2
    theta = base ** (-torch.arange(half, dtype=torch.float64) * 2.0 / d)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * theta[None, :]  # [s, d/2]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.cfg = cfg
        self.c_attn = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.c_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x):
        b, s, h = x.shape
        n = self.cfg.num_heads
        q, k, v = self.c_attn(x).split(h, dim=-1)
        q, k, v = (t.reshape(b, s, n, h // n).permute(0, 2, 1, 3) for t in (q, k, v))  # [b, n, s, d]
        if self.cfg.rotary:
            q, k = rotate(q, self.cfg.rotary_base), rotate(k, self.cfg.rotary_base)
        scores = q @ k.transpose(-1, -2) / math.sqrt(h // n)
        future = torch.ones(s, s, dtype=torch.bool).triu(diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
        weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        weights = weights / weights.sum(dim=-1, keepdim=True)
        y = (weights @ v).permute(0, 2, 1, 3).reshape(b, s, h)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.c_proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)

    def forward(self, x):
        return self.c_proj(gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ReferenceGPT(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = None if cfg.rotary else nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tied_head:
            self.lm_head.weight = self.wte.weight

    def forward(self, tokens, targets=None, loss_mask=None):
        """Logits [b, s, V]; with targets, the mean cross entropy over tokens where loss_mask is 1."""
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        logits = logits[..., :self.cfg.real_vocab_size or self.cfg.vocab_size]
        log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        nll = -log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return (nll * loss_mask).sum() / loss_mask.sum()


def load_megatron_lite_state(model: ReferenceGPT, state: dict) -> None:
    """Copy a TP = 1 GPTModel state_dict in. Its layers are numbered in spec order: 0 the
    embedding, 1..L the transformer layers, L+1 the final LayerNorm, L+2 an untied head.
    The fused QKV weight is [Q; K; V], each of whole heads in order, as c_attn expects."""
    L = model.cfg.num_layers
    names = {"wte.weight": "layers.0.word_embeddings.weight",
             "ln_f.weight": f"layers.{L + 1}.weight", "ln_f.bias": f"layers.{L + 1}.bias"}
    if model.wpe is not None:
        names["wpe.weight"] = "layers.0.position_embeddings.weight"
    names["lm_head.weight"] = names["wte.weight"] if model.cfg.tied_head else f"layers.{L + 2}.output.weight"
    ours = {"ln_1": "input_layernorm", "attn.c_attn": "attention.query_key_value", "attn.c_proj": "attention.dense",
            "ln_2": "post_attention_layernorm", "mlp.c_fc": "mlp.dense_h_to_4h", "mlp.c_proj": "mlp.dense_4h_to_h"}
    for i in range(L):
        for mine, theirs in ours.items():
            for p in ("weight", "bias"):
                names[f"h.{i}.{mine}.{p}"] = f"layers.{i + 1}.{theirs}.{p}"
    if set(names.values()) != set(state):
        raise KeyError(f"unmapped GPTModel entries {sorted(set(state) - set(names.values()))}, "
                       f"missing {sorted(set(names.values()) - set(state))}")
    model.load_state_dict({mine: state[theirs] for mine, theirs in names.items()})
