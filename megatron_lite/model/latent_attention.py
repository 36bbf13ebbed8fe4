"""Multi-head Latent Attention (MLA: DeepSeek-V2/V3, Kimi K2) on tensor-parallel building blocks.

Per token, with n heads, d_n = --qk-head-dim, d_r = --qk-pos-emb-head-dim, d_v = --v-head-dim:

    c_q = norm_q(x W_qd)                 [q_lora]          (no --q-lora-rank: q = x W_q directly)
    q   = c_q W_qu                       [n, d_n + d_r]    each head's rows [nope | rope]
    [c_kv | k_r] = x W_kvd               [kv_lora + d_r]   k_r: ONE rotary key, shared by every head
    [k_n | v] = norm_kv(c_kv) W_kvu      [n, d_n + d_v]    each head's rows [k_nope | v]
    attention(q = [RoPE(q_r), q_n], k = [RoPE(k_r), k_n], v), softmax scale m^2 / sqrt(d_n + d_r)
    out = context W_o                    [n d_v] -> [h]

with m = YaRN's m(s, --mscale-all-dim) under --rope-type yarn (else 1), as transformers' DeepseekV3Attention and
Megatron-LM's MultiLatentAttention scale the softmax; the norms are there with --qk-layernorm (Megatron-LM's
rule). Inside attention the rotary dimensions come first ([rope | nope]: q . k is the same sum), so RoPE turns a
head's first d_r dimensions like partial RoPE does; checkpoints keep Hugging Face's [nope | rope] rows.

Under TP the down projections W_qd and W_kvd are whole on every rank (parallel/layers.ReplicatedLinear), the
up projections column-parallel by head (n/TP whole heads per rank), W_o row-parallel. Their column-parallel
input mapping sums the latents' gradient over TP, so without sequence parallelism the down projections'
gradients are whole; with it they see [b, s/tp, h] shards (tagged, summed over TP once per step) and the
up projections all-gather the small latents, not the hidden state. The shared k_r is gathered over the
sequence under SP, copied into the TP region otherwise (its gradient summed over TP either way: Megatron-LM
#1416 gathered it with SP off), then expanded to this rank's heads. Everything after the projections
(context-parallel all-to-alls with keys expanded per head, documents, windows, both backends, recompute, the
KV cache) is ParallelAttention's; values are d_v wide where queries and keys are d_n + d_r. The KV cache holds
the expanded per-head keys and values (n/TP x (d_n + d_r + d_v) numbers per token and layer, where caching the
latents would hold kv_lora + d_r).
"""
from __future__ import annotations

import math

import torch

from megatron_lite.config import ModelConfig
from megatron_lite.model.attention import ParallelAttention
from megatron_lite.model.mlp import normal_init
from megatron_lite.model.norms import build_norm
from megatron_lite.model.rotary import mla_softmax_mscale
from megatron_lite.parallel.layers import ColumnParallelLinear, ReplicatedLinear
from megatron_lite.parallel.mappings import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region


class MultiLatentAttention(ParallelAttention):
    def _build_projections(self, config: ModelConfig, sequence_parallel: bool) -> None:
        h, heads, init = config.hidden_size, config.num_attention_heads, normal_init(config.init_method_std)
        self.nope_dim, self.rope_dim = config.qk_head_dim, config.qk_pos_emb_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.sequence_parallel = sequence_parallel
        # Hugging Face's attention_bias (--add-bias-linear here) is on the down projections and o_proj alone.
        bias = config.add_bias_linear
        q_width = heads * self.head_dim
        if config.q_lora_rank:
            self.linear_q_down_proj = ReplicatedLinear(h, config.q_lora_rank, bias, init,
                                                       sequence_parallel=sequence_parallel)
            self.q_layernorm = (build_norm(config, sequence_parallel, config.q_lora_rank)
                                if config.qk_layernorm else None)
            self.linear_q_up_proj = ColumnParallelLinear(config.q_lora_rank, q_width, bias=False, init_method=init,
                                                         sequence_parallel=sequence_parallel)
        else:
            self.linear_q_proj = ColumnParallelLinear(h, q_width, bias=False, init_method=init,
                                                      sequence_parallel=sequence_parallel)
        self.linear_kv_down_proj = ReplicatedLinear(h, self.kv_lora_rank + self.rope_dim, bias, init,
                                                    sequence_parallel=sequence_parallel)
        self.kv_layernorm = (build_norm(config, sequence_parallel, self.kv_lora_rank)
                             if config.qk_layernorm else None)
        self.linear_kv_up_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope_dim + self.value_dim),
                                                      bias=False, init_method=init, sequence_parallel=sequence_parallel)
        self.local_groups = self.local_heads  # every head has its own key and value

    def _softmax_scale(self, config: ModelConfig) -> float:
        return mla_softmax_mscale(config) ** 2 / math.sqrt(self.head_dim)

    def _project(self, x: torch.Tensor):
        if hasattr(self, "linear_q_up_proj"):
            latent = self.linear_q_down_proj(x)  # [b, s(/tp), q_lora]
            q = self.linear_q_up_proj(latent if self.q_layernorm is None else self.q_layernorm(latent))
        else:
            q = self.linear_q_proj(x)
        b, s = q.shape[:2]  # the whole sequence here under SP (the up projection gathered it)
        n = self.local_heads
        q_nope, q_rope = q.view(b, s, n, self.head_dim).split((self.nope_dim, self.rope_dim), dim=-1)

        latent, k_rope = self.linear_kv_down_proj(x).split((self.kv_lora_rank, self.rope_dim), dim=-1)
        kv = self.linear_kv_up_proj(latent if self.kv_layernorm is None else self.kv_layernorm(latent))
        k_nope, v = kv.view(b, s, n, self.nope_dim + self.value_dim).split((self.nope_dim, self.value_dim), dim=-1)
        # The shared rotary key enters the TP region like the latents do inside the up projections.
        if self.sequence_parallel:
            k_rope = gather_from_sequence_parallel_region(k_rope)  # [b, s/tp, d_r] -> [b, s, d_r]
        else:
            k_rope = copy_to_tensor_model_parallel_region(k_rope)
        q = torch.cat((q_rope, q_nope), dim=-1)  # rotary dimensions first (module docstring)
        k = torch.cat((k_rope.unsqueeze(2).expand(b, s, n, self.rope_dim), k_nope), dim=-1)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
