"""The sizes behind every activation term (cost/activations.py's notation): element bytes, TP, the
sequence-parallel divisor, CP, micro batch, sequence, widths and heads, for one config and device."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config import Config


@dataclass(frozen=True)
class Dims:
    e: int
    k: int
    t: int
    r: int
    c: int
    b: int
    S: int
    """The whole sequence (what attention sees)."""
    h: int
    f: int
    a: int
    g: int
    d: int
    """Head width (--kv-channels, h / a when not given): queries' and keys' (d_n + d_r under MLA)."""
    v: int
    """Values' head width: d, or --v-head-dim under MLA."""

    @property
    def s(self) -> int:
        """Tokens of a sample this rank holds outside attention: S / c."""
        return self.S // self.c

    @property
    def bs(self) -> int:
        return self.b * self.s

    @property
    def bsh(self) -> int:
        return self.b * self.s * self.h

    @property
    def head_dim(self) -> int:
        return self.d

    @property
    def local_heads(self) -> int:
        return self.a // self.t

    @property
    def local_groups(self) -> int:
        from megatron_lite.parallel.qkv import local_query_groups

        return local_query_groups(self.g, self.t)

    @property
    def attention_heads(self) -> int:
        """n_c: query heads this rank attends with, over all S tokens."""
        return self.local_heads // self.c

    @property
    def attention_groups(self) -> int:
        """m_c: key/value groups this rank attends with (after the repeat to c groups when m < c)."""
        from megatron_lite.parallel.context_parallel import context_parallel_groups

        return context_parallel_groups(self.local_groups, self.c) // self.c


def dims(config: Config, device: str) -> Dims:
    m, p = config.model, config.parallel
    e = 4 if config.precision.dtype_name == "fp32" else 2
    t = p.tensor_model_parallel_size
    return Dims(e=e, k=1 if device == "cuda" else e, t=t, r=t if p.sequence_parallel else 1,
                c=p.context_parallel_size, b=config.batch.micro_batch_size, S=m.seq_length, h=m.hidden_size,
                f=m.ffn_hidden_size, a=m.num_attention_heads, g=m.num_query_groups or m.num_attention_heads,
                d=m.head_dim, v=m.value_head_dim)
