"""Multi-Token Prediction (DeepSeek-V3, GLM-4.5; Megatron-LM's --mtp-num-layers): D depths after the model, on
the last pipeline stage, sharing the embedding and the output head.

Depth k = 1..D, with h_0 the model's hidden state after its final norm and e_k the embedding of the token k ahead
(data/mtp.py makes those tokens, per document, before the context-parallel split):

    h_k = final_norm_k(layer_k(eh_proj_k([enorm_k(e_k), hnorm_k(h_{k-1})])))    (embedding first, as every
                                                                                implementation orders it)
    loss_k = cross entropy of head(h_k) against the label k ahead (the token k + 1 ahead), own loss mask

layer_k is a decoder layer of the model's kind (MLA, experts as the last layer's), numbered L + k (its dropout
streams, its MoE layer number). The model's loss is L_main + factor / D x sum_k loss_k for the gradient, while
its value stays L_main: the depths' part enters as (x - x.detach()), in the same graph, so it goes through
every scaling the main loss's gradient goes through (accumulation steps, CP, the fp16 loss scale), with no
other injection; the depths' losses are recorded apart for the logs (`take_losses`). eh_proj is whole on every
TP rank (parallel/layers.ReplicatedLinear: under SP it sees the rank's sequence shard and its gradient is summed
over TP), the rest is the decoder layer's own parallelism.

What the last stage receives is (hidden, [document ids], depth tokens [b, D, s]); the head then computes logits
for [h_0; h_1; ...; h_D] stacked along the batch, and `depth_losses` takes them apart for the loss.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.model.attention_options import needs_document_ids
from megatron_lite.model.mlp import normal_init
from megatron_lite.model.norms import build_norm
from megatron_lite.model.transformer import TransformerLayer
from megatron_lite.parallel.layers import ReplicatedLinear
from megatron_lite.parallel.random import seeded

_last_losses: List[List[float]] = []
"""Per micro-batch since the last `take_losses`, each depth's loss (this rank's value: under CP its share)."""


def take_losses() -> List[List[float]]:
    """The depths' losses recorded since the last call, per micro-batch; and forget them."""
    global _last_losses
    taken, _last_losses = _last_losses, []
    return taken


def carries_depth_tokens(x, model: ModelConfig) -> bool:
    """Whether what crosses a stage holds the depths' tokens (training and evaluation; generation does not)."""
    return bool(model.mtp_num_layers) and isinstance(x, tuple) and len(x) > 1 + needs_document_ids(model)


class MTPDepth(nn.Module):
    def __init__(self, config: ModelConfig, layer_number: int, sequence_parallel: bool):
        super().__init__()
        h = config.hidden_size
        self.enorm = build_norm(config, sequence_parallel)
        self.hnorm = build_norm(config, sequence_parallel)
        self.eh_proj = ReplicatedLinear(2 * h, h, bias=False, init_method=normal_init(config.init_method_std),
                                        sequence_parallel=sequence_parallel)
        self.layer = TransformerLayer(config, layer_number, sequence_parallel)
        self.final_layernorm = build_norm(config, sequence_parallel)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, documents: Optional[torch.Tensor]):
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))
        return self.final_layernorm(self.layer._layer(x, None, documents))


class MultiTokenPredictionPipe(nn.Module):
    """(h_0, [document ids], e_1..e_D stacked along the batch) -> [h_0; h_1; ...; h_D] along the batch; anything
    else (generation: no depth tokens) passes through."""

    def __init__(self, config: ModelConfig, init_seed: int, sequence_parallel: bool = False):
        super().__init__()
        with seeded(init_seed):
            self.depths = nn.ModuleList(MTPDepth(config, config.num_layers + k, sequence_parallel)
                                        for k in range(1, config.mtp_num_layers + 1))
        self.with_documents = needs_document_ids(config)

    def forward(self, x):
        if not isinstance(x, tuple):
            return x
        hidden, *rest = x
        documents = rest[0] if self.with_documents else None
        embedded = rest[-1].chunk(len(self.depths))  # e_k: [b, s(/tp), h] each
        outputs = [hidden]
        for depth, e in zip(self.depths, embedded):
            outputs.append(depth(e, outputs[-1], documents))
        return torch.cat(outputs, dim=0)


def embed_depth_tokens(embedding, x):
    """(h_0, [documents], depth tokens [b, D, s]) -> (h_0, [documents], their embeddings [D b, s(/tp), h]) through
    the model's (tied) embedding module; anything else passes through (the final norm passes a tuple on only when
    it carries the depth tokens: model/gpt.py)."""
    if not isinstance(x, tuple):
        return x
    hidden, *rest, tokens = x
    b, depths, s = tokens.shape
    return (hidden, *rest, embedding._embed(tokens.transpose(0, 1).reshape(depths * b, s), None))


def depth_losses(logits: torch.Tensor, labels: Tuple[torch.Tensor, ...], token_losses, reduce):
    """(the main loss, the depths' losses [D]) of logits [(1 + D) b, s, V/tp] against (labels, loss mask, depth labels
    [b, D, s], depth masks or weights [b, D, s]): one cross entropy over all of them (token_losses(logits, labels)
    -> [.., s], which may write into the logits), then each part reduced with its own mask (reduce(losses, mask))."""
    main_labels, main_mask, depth_labels, depth_masks = labels
    depths = depth_labels.shape[1]
    every = token_losses(logits, torch.cat([main_labels, *depth_labels.unbind(1)]))
    parts = every.chunk(1 + depths)
    main = reduce(parts[0], main_mask)
    return main, torch.stack([reduce(part, depth_masks[:, k]) for k, part in enumerate(parts[1:])])


def mtp_loss(logits: torch.Tensor, labels: Tuple[torch.Tensor, ...], token_losses, reduce, factor: float):
    """The loss the engine backpropagates and reports: the main loss's value, the depths' gradient too."""
    if len(labels) == 2:  # no depth labels (generation's logits, a plain batch)
        return reduce(token_losses(logits, labels[0]), labels[1])
    main, depths = depth_losses(logits, labels, token_losses, reduce)
    _last_losses.append([float(d) for d in depths.detach()])
    scaled = depths.sum() * (factor / depths.numel())
    return main + (scaled - scaled.detach())
