"""The GPT as a list of DeepSpeed layer specs, and the pipeline module built from it.

    embedding (tied) -> N x transformer layer -> final norm -> head (tied to the embedding) -> loss

Micro-batches are ((tokens, position_ids), (labels, loss_mask)). Only the
hidden states [b, s, h] cross pipeline stages; the causal mask is implicit in
the softmax kernel of each stage, and a sliding window is built by each layer.
With --reset-attention-mask (or --reset-position-ids under RoPE) the inputs are
(tokens, position_ids, document_ids) and every stage passes (hidden states,
document ids) on: the int32 [b, s] ids of the whole sequence are what each layer
builds its document mask and rotary positions from (model/attention_mask.py);
a fixed shape, and no gradient, as DeepSpeed's pipeline engine needs.

Every layer seeds its own initialisation from (seed, position in the list), so
weights do not depend on which stage builds a layer nor on TP: a pipeline of
any shape starts from the same weights as `GPTModel`, the single-process
reference used by tests and tools. Dropout likewise draws from streams named by
the layer number (parallel/random.py), not from the stage's generator.

With --sequence-parallel the embedding output is scattered along the sequence, every
layer and the final LayerNorm work on [b, s/tp, h] (that is also what crosses pipeline
stages), and the head gathers the sequence back for the vocab-parallel cross entropy.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from megatron_lite.config import Config, ModelConfig, require_vocab
from megatron_lite.deepspeed_compat import startup
from megatron_lite.deepspeed_compat.dualpipev import DualPipeVStages
from megatron_lite.deepspeed_compat.pipeline import OwnPartitionPipelineModule
from megatron_lite.model.mlp import normal_init
from megatron_lite.model.mtp import MultiTokenPredictionPipe, carries_depth_tokens, embed_depth_tokens, mtp_loss
from megatron_lite.model.norms import RMSNorm
from megatron_lite.model.partition import PipelineSplit
from megatron_lite.model.recompute import run_stage
from megatron_lite.model.transformer import TransformerLayer
from megatron_lite.model.virtual_stages import stage_count
from megatron_lite.parallel.chunked_cross_entropy import OutputLayerInput, output_layer_input
from megatron_lite.parallel.cross_entropy import masked_mean, vocab_parallel_cross_entropy, weighted_sum
from megatron_lite.parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    parallel_lm_logits,
    set_matrix_attributes,
    set_sequence_parallel_parameters,
)
from megatron_lite.parallel.mappings import scatter_to_sequence_parallel_region
from megatron_lite.parallel.random import EMBEDDING_RNG, MODEL_PARALLEL_RNG, get_rng_tracker, seeded

EMBEDDING_KEY = "embedding"


class EmbeddingPipe(nn.Module):
    """(tokens, position_ids) -> word (+ learned position) embeddings -> dropout: [b, s, h]
    (sequence parallel: [b, s/tp, h])."""

    def __init__(self, config: ModelConfig, init_seed: int, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        with seeded(init_seed):
            self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size,
                                                          init_method=normal_init(config.init_method_std))
            self.position_embeddings = None
            if config.position_embedding_type == "learned_absolute":
                self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
                normal_init(config.init_method_std)(self.position_embeddings.weight)
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, inputs: Tuple[torch.Tensor, ...]):
        tokens, position_ids, *rest = inputs  # rest: [document ids], [Multi-Token Prediction's tokens]
        x = self._embed(tokens, position_ids)
        return (x, *rest) if rest else x

    def _embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)  # [b, s] -> [b, s, h]
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        stream = EMBEDDING_RNG
        if self.sequence_parallel:
            # Positions are added before the split, so the position table's gradient stays whole on
            # every rank (the scatter's backward gathers it); each rank's shard has its own dropout stream.
            x = scatter_to_sequence_parallel_region(x)  # [b, s, h] -> [b, s/tp, h]
            stream = MODEL_PARALLEL_RNG
        with get_rng_tracker().fork(stream):
            return self.embedding_dropout(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied output head: [b, s, h] (sequence parallel: [b, s/tp, h]) -> [b, s, V/tp] with the
        word-embedding weight."""
        return parallel_lm_logits(hidden, self.word_embeddings.weight, sequence_parallel=self.sequence_parallel)


def _tied_head_forward(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    return embedding.logits(hidden)


def _tied_chunked_head(chunk_size: int):
    """The tied head's forward under --output-loss-chunk-size: in training, the head's mapped input and the
    embedding's weight for the loss to multiply chunk by chunk; without autograd (evaluation, generation) the
    logits, as without the flag. (A named function, not a partial: stage profiles name specs by it.)"""
    def _tied_chunked_head_forward(embedding: EmbeddingPipe, hidden: torch.Tensor):
        if not torch.is_grad_enabled():
            return embedding.logits(hidden)
        return output_layer_input(hidden, embedding.word_embeddings.weight, chunk_size, embedding.sequence_parallel)
    return _tied_chunked_head_forward


class TransformerLayerPipe(TransformerLayer):
    def __init__(self, config: ModelConfig, init_seed: int, layer_number: int, sequence_parallel: bool = False):
        with seeded(init_seed):
            super().__init__(config, layer_number, sequence_parallel)


def _final_norm(norm, x, model: ModelConfig):
    """The final norm of the hidden states a stage passes on; the document ids end with the last layer, unless
    Multi-Token Prediction's depths follow (they take the normed states, the ids and their tokens on)."""
    if not isinstance(x, tuple):
        return norm(x)
    return (norm(x[0]), *x[1:]) if carries_depth_tokens(x, model) else norm(x[0])


class FinalLayerNormPipe(nn.LayerNorm):
    def __init__(self, config: ModelConfig, init_seed: int, sequence_parallel: bool = False):
        super().__init__(config.hidden_size, eps=config.norm_epsilon)
        self.model_config = config
        if sequence_parallel:  # it normalises this rank's sequence shard
            set_sequence_parallel_parameters(self)

    def forward(self, x):
        return _final_norm(super().forward, x, self.model_config)


class FinalRMSNormPipe(RMSNorm):
    """The final norm under --normalization RMSNorm (its own class: stage costs and DeepSpeed's
    type:<regex> partitioning tell layers apart by class name)."""

    def __init__(self, config: ModelConfig, init_seed: int, sequence_parallel: bool = False):
        super().__init__(config.hidden_size, config.norm_epsilon)
        self.model_config = config
        if sequence_parallel:
            set_sequence_parallel_parameters(self)

    def forward(self, x):
        return _final_norm(super().forward, x, self.model_config)


def final_norm_class(config: ModelConfig):
    return FinalRMSNormPipe if config.normalization == "RMSNorm" else FinalLayerNormPipe


class LMHeadPipe(nn.Module):
    """Untied output head: its own vocab-parallel weight [V/tp, h]."""

    def __init__(self, config: ModelConfig, init_seed: int, sequence_parallel: bool = False):
        super().__init__()
        with seeded(init_seed):
            self.output = ColumnParallelLinear(config.hidden_size, config.padded_vocab_size, bias=False,
                                               init_method=normal_init(config.init_method_std),
                                               sequence_parallel=sequence_parallel)
        set_matrix_attributes(self.output.weight, hidden=False)  # a vocabulary matrix: AdamW under --optimizer muon
        self.loss_chunk_size = config.output_loss_chunk_size
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor):
        if self.loss_chunk_size and torch.is_grad_enabled():  # the loss multiplies chunk by chunk (token_losses)
            return output_layer_input(hidden, self.output.weight, self.loss_chunk_size, self.sequence_parallel)
        return self.output(hidden)  # [b, s, h] (sequence parallel: [b, s/tp, h]) -> [b, s, V/tp]


def token_losses(logits, labels: torch.Tensor, vocab_size: Optional[int] = None) -> torch.Tensor:
    """Cross entropy per token [b, s]; logits stay split over TP, and the padded vocabulary columns (from
    vocab_size on) are out of the softmax. Under --output-loss-chunk-size the head hands over its input and
    weight instead of logits, and the same losses come chunk by chunk."""
    if isinstance(logits, OutputLayerInput):
        return logits.token_losses(labels, vocab_size)
    return vocab_parallel_cross_entropy(logits.float(), labels, vocab_size)


def reduce_losses(losses: torch.Tensor, loss_mask: torch.Tensor, weighted: bool = False) -> torch.Tensor:
    """Mean over the unmasked tokens of a micro-batch; weighted (context parallelism): the mask holds loss
    weights, and this rank's share of the loss is their weighted sum."""
    return weighted_sum(losses, loss_mask) if weighted else masked_mean(losses, loss_mask)


def loss_fn(logits: torch.Tensor, labels_and_mask: Tuple[torch.Tensor, torch.Tensor],
            vocab_size: Optional[int] = None, weighted: bool = False) -> torch.Tensor:
    """Mean cross entropy over the unmasked tokens of a micro-batch (token_losses, reduce_losses)."""
    labels, loss_mask = labels_and_mask
    return reduce_losses(token_losses(logits, labels, vocab_size), loss_mask, weighted)  # [b, s] (CP: [b, s/C])


def model_loss_fn(config: Config):
    """The loss DeepSpeed's pipeline calls with (logits, (labels, loss mask)) for this model's vocabulary
    (under context parallelism, with loss weights); with --mtp-num-layers, (logits of the main model and of each
    depth, (labels, loss mask, the depths' labels and masks)) (model/mtp.py)."""
    vocab, weighted = config.model.vocab_size, config.parallel.context_parallel_size > 1
    if not config.model.mtp_num_layers:
        return functools.partial(loss_fn, vocab_size=vocab, weighted=weighted)
    return functools.partial(mtp_loss, token_losses=functools.partial(token_losses, vocab_size=vocab),
                             reduce=functools.partial(reduce_losses, weighted=weighted),
                             factor=config.model.mtp_loss_scaling_factor)


def layer_specs(config: Config) -> List[LayerSpec]:
    """The whole GPT, in order, as DeepSpeed specs."""
    model, seed = require_vocab(config), config.training.seed
    sp = config.parallel.sequence_parallel
    specs: List[LayerSpec] = [
        TiedLayerSpec(EMBEDDING_KEY, EmbeddingPipe, model, seed, sp, tied_weight_attr=["word_embeddings.weight"])
    ]
    specs += [LayerSpec(TransformerLayerPipe, model, seed + 1 + i, 1 + i, sp) for i in range(model.num_layers)]
    specs.append(LayerSpec(final_norm_class(model), model, seed + 1 + model.num_layers, sp))
    if model.mtp_num_layers:  # on the last stage, reading the embedding it shares with stage 0 (model/mtp.py)
        specs.append(TiedLayerSpec(EMBEDDING_KEY, EmbeddingPipe, model, seed, sp, forward_fn=embed_depth_tokens,
                                   tied_weight_attr=["word_embeddings.weight"]))
        specs.append(LayerSpec(MultiTokenPredictionPipe, model, seed + 3 + model.num_layers, sp))
    if model.untie_embeddings_and_output_weights:
        specs.append(LayerSpec(LMHeadPipe, model, seed + 2 + model.num_layers, sp))
    else:
        head = _tied_chunked_head(model.output_loss_chunk_size) if model.output_loss_chunk_size else _tied_head_forward
        specs.append(TiedLayerSpec(EMBEDDING_KEY, EmbeddingPipe, model, seed, sp, forward_fn=head,
                                   tied_weight_attr=["word_embeddings.weight"]))
    return specs


class GPTPipe(OwnPartitionPipelineModule):
    """DeepSpeed PipelineModule cut where `split` says (cost/stages.py `pipeline_split` decides, from FLOPs
    or, under `--pipeline-partition-method profile`, the seconds training/model_setup.py measures)."""

    def __init__(self, config: Config, topology, split: PipelineSplit):
        self._config = config
        self._split = split
        self.stage_table = ""
        with startup.quiet_prints(config.logging.log_level):
            super().__init__(
                layers=layer_specs(config),
                topology=topology,
                loss_fn=model_loss_fn(config),
                partition_method=config.parallel.pipeline_partition_method,
                activation_checkpoint_interval=0,
            )
        if self.global_rank == 0:
            print(self.stage_table, flush=True)

    def run_stage(self, functions, x):
        return run_stage(functions, x, self._config.model)

    def stage_boundaries(self, num_stages: int) -> List[int]:
        p = self._config.parallel
        assert num_stages == len(self._split.bounds) - 1 == stage_count(p.pipeline_model_parallel_size,
                                                                        p.pipeline_schedule)
        self.layers_per_stage = list(self._split.layers_per_stage)
        self.stage_table = self._split.table
        return list(self._split.bounds)


class GPTDualPipeV(DualPipeVStages, GPTPipe):
    """The same GPT under --pipeline-schedule dualpipev: `split` cuts 2 PP stages, and this rank builds stages
    r and 2 PP - 1 - r (model/virtual_stages.py), as DeepSpeed's DualPipeVModule, for its DualPipeVEngine."""


def build(config: Config, topology, split: PipelineSplit) -> GPTPipe:
    """The GPT as a PipelineModule for DeepSpeed's pipeline engine, on this rank's stage (two stages under
    --pipeline-schedule dualpipev)."""
    if config.parallel.pipeline_schedule == "dualpipev":
        return GPTDualPipeV(config, topology, split)
    return GPTPipe(config, topology, split)


class GPTModel(nn.Module):
    """The same specs built into one module: the single-process reference the pipeline must
    match, and the module DeepSpeed's non-pipeline engine trains at PP = 1 with ZeRO 2/3."""

    def __init__(self, config: Config):
        super().__init__()
        self.model_config = config.model
        self.loss = model_loss_fn(config)
        tied = {}
        self.layers = nn.ModuleList()
        self._forward_fns = []
        for spec in layer_specs(config):
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in tied:  # built once, as DeepSpeed does; later specs reuse it
                    tied[spec.key] = spec.build()
                    self.layers.append(tied[spec.key])
                else:  # a placeholder without parameters, so `layers.N` is spec N as in the layer files
                    self.layers.append(nn.Identity())
                module = tied[spec.key]
                fn = module if spec.forward_fn is None else (lambda x, m=module, f=spec.forward_fn: f(m, x))
            else:
                module = spec.build()
                self.layers.append(module)
                fn = module
            self._forward_fns.append(fn)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, labels=None, loss_mask=None,
                document_ids: Optional[torch.Tensor] = None, mtp: Optional[Tuple[torch.Tensor, ...]] = None):
        """Logits [b, s, V/tp]; or, given labels and loss_mask, the micro-batch loss. document_ids [b, s]
        (whole sequence): with --reset-attention-mask / --reset-position-ids (data/documents.py). mtp: Multi-Token
        Prediction's (tokens, labels, loss mask), each [b, D, s] (data/mtp.py); the logits are then the main
        model's and each depth's, stacked along the batch."""
        inputs = (tokens, position_ids) + ((document_ids,) if document_ids is not None else ()) + \
            ((mtp[0],) if mtp is not None else ())
        x = run_stage(self._forward_fns, inputs, self.model_config)
        if labels is None:
            return x.logits() if isinstance(x, OutputLayerInput) else x
        return self.loss(x, (labels, loss_mask) + (tuple(mtp[1:]) if mtp is not None else ()))
