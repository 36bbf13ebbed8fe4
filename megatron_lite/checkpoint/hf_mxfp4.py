"""MXFP4 expert weights (gpt-oss's release), read dequantized.

Their config.json says `quantization_config: {quant_method: mxfp4, modules_to_not_convert: [...]}`; each quantized
expert stack W (bf16 layout [E, in, out]: gpt-oss's gate_up_proj [E, h, 2I], down_proj [E, I, h]) is stored as
`<name>_blocks` [E, out, in/32, 16] uint8 beside `<name>_scales` [E, out, in/32] uint8. A block is 32 weights along
`in` that share one scale: its 16 bytes hold two E2M1 codes each, the low nibble first (weight 2j in the low nibble
of byte j, 2j + 1 in the high one); a code is the value E2M1_VALUES[code] (bit 3 the sign) and the scale s an E8M0
exponent, 2^(s - 127). So W[e, i, o] = E2M1_VALUES[code of blocks[e, o, i // 32, (i % 32) // 2]] * 2^(s - 127) with
s = scales[e, o, i // 32]: the dequantized [E, out, in] transposed to the bf16 layout. This is transformers'
convert_moe_packed_tensors (integrations/mxfp4.py: its lut indexed by `blocks & 0x0F` into the even columns and
`blocks >> 4` into the odd ones, torch.ldexp by `scales - 127`, then transpose(1, 2)) in fp32, where every product
is exact (a code has 2 significant bits). `Mxfp4Weights` wraps the folder's WeightFiles, as hf_fp8.BlockScaledWeights
does: names() shows `<name>` for the pair, and read() / read_rows() (rows: experts) return the dequantized fp32
stack, reading only those experts' blocks and scales: the importer's memory bound (hf_import.py) holds.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_folder import WeightFiles

BLOCKS, SCALES = "_blocks", "_scales"
BLOCK = 32
"""Weights per scale (and per 16 bytes of blocks)."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit code (transformers' FP4_VALUES)."""
SCALE_BIAS = 127


def is_mxfp4(hf: dict) -> bool:
    """Whether config.json's quantization_config says MXFP4 (anything else: hf_fp8.block_size decides)."""
    quantized = hf.get("quantization_config")
    return isinstance(quantized, dict) and quantized.get("quant_method") == "mxfp4"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [n, out, G, 16] uint8, scales [n, out, G] uint8 -> [n, G * 32, out] fp32 (the bf16 layout)."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [n, out, G, 32]: low nibble first
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)[codes.long()]
    values = torch.ldexp(values, (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1))
    return values.flatten(-2).transpose(1, 2).contiguous()  # [n, out, in] -> [n, in, out]


class Mxfp4Weights:
    """A WeightFiles whose MXFP4 pairs read as their dequantized fp32 stacks (module docstring)."""

    def __init__(self, files: WeightFiles):
        self.files = files
        names = set(files.names())
        self.quantized = {n[:-len(BLOCKS)] for n in names if n.endswith(BLOCKS) and n[:-len(BLOCKS)] + SCALES in names}
        # A lone _blocks or _scales stays under its own name: the importer names it as a tensor no table has.
        pairs = {n + suffix for n in self.quantized for suffix in (BLOCKS, SCALES)}
        self._names: List[str] = sorted(names - pairs) + sorted(self.quantized)

    def __getattr__(self, name: str):  # folder, kind, where: the files'
        return getattr(self.files, name)

    def names(self) -> List[str]:
        return list(self._names)

    def _shapes(self, name: str) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """(blocks' shape, scales' shape), checked against each other."""
        blocks, scales = self.files.shape(name + BLOCKS), self.files.shape(name + SCALES)
        if len(blocks) != 4 or blocks[-1] != BLOCK // 2 or tuple(blocks[:-1]) != tuple(scales):
            raise CheckpointError(f"{self.files.folder}: {name}{BLOCKS} {list(blocks)} and {name}{SCALES} "
                                  f"{list(scales)} are not an MXFP4 expert stack ([E, out, in/32, 16] uint8 blocks "
                                  f"beside [E, out, in/32] uint8 scales)")
        return tuple(blocks), tuple(scales)

    def shape(self, name: str) -> Tuple[int, ...]:
        """A quantized stack's dequantized shape [E, in, out] (nothing read)."""
        if name not in self.quantized:
            return self.files.shape(name)
        (experts, out, groups, _), _ = self._shapes(name)
        return experts, groups * BLOCK, out

    def read(self, name: str) -> torch.Tensor:
        if name not in self.quantized:
            return self.files.read(name)
        return self.read_rows(name, 0, self.shape(name)[0])

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Experts start..stop of a stack, reading only their blocks and scales."""
        if name not in self.quantized:
            return self.files.read_rows(name, start, stop)
        self._shapes(name)
        blocks = self.files.read_rows(name + BLOCKS, start, stop)
        scales = self.files.read_rows(name + SCALES, start, stop)
        for tensor, suffix in ((blocks, BLOCKS), (scales, SCALES)):
            if tensor.dtype != torch.uint8:
                raise CheckpointError(f"{self.files.folder}: {name}{suffix} is {tensor.dtype}, MXFP4 stores uint8")
        return dequantize(blocks, scales)
