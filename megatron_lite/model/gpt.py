"""The GPT as a list of DeepSpeed layer specs, and the pipeline module built from it.

    embedding (tied) -> N x transformer layer -> final LayerNorm -> head (tied to the embedding) -> loss

Micro-batches are ((tokens, position_ids), (labels, loss_mask)). Only the
hidden states [b, s, h] cross pipeline stages; the causal mask is implicit in
the softmax kernel of each stage.

Every layer seeds its own initialisation from (seed, position in the list), so
weights do not depend on which stage builds a layer nor on TP: a pipeline of
any shape starts from the same weights as `GPTModel`, the single-process
reference used by tests and tools. Dropout likewise draws from streams named by
the layer number (parallel/random.py), not from the stage's generator.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import List, Tuple

import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from megatron_lite.config import Config, ConfigError, ModelConfig
from megatron_lite.deepspeed_compat import OwnPartitionPipelineModule
from megatron_lite.model.partition import SpecCost, partition, stage_table
from megatron_lite.model.spec_profile import measure_spec_seconds
from megatron_lite.parallel import state
from megatron_lite.model.transformer import TransformerLayer, normal_init
from megatron_lite.parallel.cross_entropy import masked_mean, vocab_parallel_cross_entropy
from megatron_lite.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding, parallel_lm_logits
from megatron_lite.parallel.random import EMBEDDING_RNG, get_rng_tracker

EMBEDDING_KEY = "embedding"


@contextlib.contextmanager
def _seeded(seed: int):
    """Initialise under a private seed without disturbing the caller's generators."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class EmbeddingPipe(nn.Module):
    """(tokens, position_ids) -> word (+ learned position) embeddings -> dropout: [b, s, h]."""

    def __init__(self, config: ModelConfig, init_seed: int):
        super().__init__()
        with _seeded(init_seed):
            self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size,
                                                          init_method=normal_init(config.init_method_std))
            self.position_embeddings = None
            if config.position_embedding_type == "learned_absolute":
                self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
                normal_init(config.init_method_std)(self.position_embeddings.weight)
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, inputs: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, position_ids = inputs
        x = self.word_embeddings(tokens)  # [b, s] -> [b, s, h]
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        with get_rng_tracker().fork(EMBEDDING_RNG):
            return self.embedding_dropout(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied output head: [b, s, h] -> [b, s, V/tp] with the word-embedding weight."""
        return parallel_lm_logits(hidden, self.word_embeddings.weight)


def _tied_head_forward(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    return embedding.logits(hidden)


class TransformerLayerPipe(TransformerLayer):
    def __init__(self, config: ModelConfig, init_seed: int, layer_number: int):
        with _seeded(init_seed):
            super().__init__(config, layer_number)


class FinalLayerNormPipe(nn.LayerNorm):
    def __init__(self, config: ModelConfig, init_seed: int):
        super().__init__(config.hidden_size, eps=config.layernorm_epsilon)


class LMHeadPipe(nn.Module):
    """Untied output head: its own vocab-parallel weight [V/tp, h]."""

    def __init__(self, config: ModelConfig, init_seed: int):
        super().__init__()
        with _seeded(init_seed):
            self.output = ColumnParallelLinear(config.hidden_size, config.padded_vocab_size, bias=False,
                                               init_method=normal_init(config.init_method_std))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(hidden)  # [b, s, h] -> [b, s, V/tp]


def loss_fn(logits: torch.Tensor, labels_and_mask: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross entropy over the unmasked tokens of a micro-batch; logits stay split over TP."""
    labels, loss_mask = labels_and_mask
    losses = vocab_parallel_cross_entropy(logits.float(), labels)  # [b, s]
    return masked_mean(losses, loss_mask)


def _require_vocab(config: Config) -> ModelConfig:
    model = config.model
    if model.padded_vocab_size is None:
        raise ConfigError("the model needs a vocabulary size: give --vocab-size N or a --tokenizer-model")
    return model


def layer_specs(config: Config) -> List[LayerSpec]:
    """The whole GPT, in order, as DeepSpeed specs."""
    model, seed = _require_vocab(config), config.training.seed
    specs: List[LayerSpec] = [
        TiedLayerSpec(EMBEDDING_KEY, EmbeddingPipe, model, seed, tied_weight_attr=["word_embeddings.weight"])
    ]
    specs += [LayerSpec(TransformerLayerPipe, model, seed + 1 + i, 1 + i) for i in range(model.num_layers)]
    specs.append(LayerSpec(FinalLayerNormPipe, model, seed + 1 + model.num_layers))
    if model.untie_embeddings_and_output_weights:
        specs.append(LayerSpec(LMHeadPipe, model, seed + 2 + model.num_layers))
    else:
        specs.append(TiedLayerSpec(EMBEDDING_KEY, EmbeddingPipe, model, seed, forward_fn=_tied_head_forward,
                                   tied_weight_attr=["word_embeddings.weight"]))
    return specs


def spec_costs(config: Config) -> List[SpecCost]:
    """Forward FLOPs per token and parameter count of each spec, from the config alone."""
    m = _require_vocab(config)
    h, f, s, v = m.hidden_size, m.ffn_hidden_size, m.seq_length, m.padded_vocab_size
    layer_params = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    # QKV + output projection + MLP matmuls (2 FLOPs per multiply-add), and the two attention
    # matmuls over s keys (causal: half of them, on average).
    layer_flops = 2 * (4 * h * h + 2 * h * f) + 2 * s * h
    embed_params = v * h + (m.max_position_embeddings * h if m.position_embedding_type == "learned_absolute" else 0)
    costs = [SpecCost("EmbeddingPipe", 4.0 * h, embed_params, False)]
    costs += [SpecCost("TransformerLayerPipe", float(layer_flops), layer_params, True) for _ in range(m.num_layers)]
    costs.append(SpecCost("FinalLayerNormPipe", 5.0 * h, 2 * h, False))
    head_name = "LMHeadPipe" if m.untie_embeddings_and_output_weights else "EmbeddingPipe"
    # Head matmul plus the softmax cross entropy over the vocabulary.
    costs.append(SpecCost(head_name, 2.0 * h * v + 5.0 * v, v * h if m.untie_embeddings_and_output_weights else 0,
                          False))
    return costs


class GPTPipe(OwnPartitionPipelineModule):
    """DeepSpeed PipelineModule whose stage boundaries come from our partitioner."""

    def __init__(self, config: Config, topology):
        self._config = config
        super().__init__(
            layers=layer_specs(config),
            topology=topology,
            loss_fn=loss_fn,
            partition_method=config.parallel.pipeline_partition_method,
            activation_checkpoint_interval=0,
        )

    def stage_boundaries(self, num_stages: int) -> List[int]:
        config = self._config
        method = config.parallel.pipeline_partition_method
        costs = spec_costs(config)
        if method == "profile":
            costs = measured_spec_costs(config, costs, self._layer_specs)
        bounds = partition(costs, num_stages, method)
        self.layers_per_stage = [sum(c.is_transformer for c in costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        if self.global_rank == 0:
            table = stage_table(costs, bounds, config.batch.gradient_accumulation_steps)
            print(f"pipeline stages ({method}):\n{table}", flush=True)
        return bounds


def _this_rank_device() -> torch.device:
    """Where the engine will put this rank's stage (init_distributed chose the CUDA device)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def measured_spec_costs(config: Config, costs: List[SpecCost], specs) -> List[SpecCost]:
    """`costs` with seconds measured on this device; every rank takes rank 0's numbers, so all
    of them cut the pipeline at the same places."""
    m = config.model
    seconds = measure_spec_seconds(
        specs, loss_fn, config.batch.micro_batch_size, m.seq_length, m.hidden_size, m.vocab_size,
        config.training.seed, m.num_layers, device=_this_rank_device())
    seconds = state.agree_with_rank0(seconds)
    return [dataclasses.replace(c, seconds=t) for c, t in zip(costs, seconds)]


def build(config: Config, topology) -> GPTPipe:
    """The GPT as a PipelineModule for DeepSpeed's pipeline engine, on this rank's stage."""
    return GPTPipe(config, topology)


class GPTModel(nn.Module):
    """The same specs built into one module: the single-process reference the pipeline must
    match, and the module DeepSpeed's non-pipeline engine trains at PP = 1 with ZeRO 2/3."""

    def __init__(self, config: Config):
        super().__init__()
        tied = {}
        self.layers = nn.ModuleList()
        self._forward_fns = []
        for spec in layer_specs(config):
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in tied:  # built once, as DeepSpeed does; later specs reuse it
                    tied[spec.key] = spec.build()
                    self.layers.append(tied[spec.key])
                module = tied[spec.key]
                fn = module if spec.forward_fn is None else (lambda x, m=module, f=spec.forward_fn: f(m, x))
            else:
                module = spec.build()
                self.layers.append(module)
                fn = module
            self._forward_fns.append(fn)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, labels=None, loss_mask=None) -> torch.Tensor:
        """Logits [b, s, V/tp]; or, given labels and loss_mask, the micro-batch loss."""
        x = (tokens, position_ids)
        for fn in self._forward_fns:
            x = fn(x)
        if labels is None:
            return x
        return loss_fn(x, (labels, loss_mask))
