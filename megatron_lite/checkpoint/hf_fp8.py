"""Block-scaled fp8 weights (DeepSeek-V3's and Kimi K2's releases), read dequantized.

Their config.json says `quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128]}`; each
quantized weight W [out, in] is stored in float8_e4m3fn beside `<name>_scale_inv` [ceil(out/128), ceil(in/128)]
(fp32), and its value is W[i, j] x scale_inv[i // 128, j // 128] (DeepSeek's own weight_dequant; the name says
inverse because the quantizer divided by it). `BlockScaledWeights` wraps the folder's WeightFiles: the scales are
not tensors of the model (names() leaves them out), and read() / read_rows() return a quantized weight as that
product in fp32, exact (an e4m3 value times an fp32 scale is an fp32 multiply of the two), one tensor or row range
at a time with only the scale rows it needs: the importer's memory bound (hf_import.py) holds. The import writes
fp32, so nothing is rounded after the product.
"""
from __future__ import annotations

from typing import Tuple

import torch

from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.hf_fields import as_json
from megatron_lite.checkpoint.hf_folder import WeightFiles

SCALE_SUFFIX = "_scale_inv"


def block_size(hf: dict, where: str):
    """The (rows, columns) of a scale's block from config.json's quantization_config, or None when the weights are not
    block-scaled fp8; any other quantization is refused by name."""
    quantized = hf.get("quantization_config")
    if not quantized:
        return None
    if not isinstance(quantized, dict) or quantized.get("quant_method") != "fp8" or \
            quantized.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{where}: quantization_config {as_json(quantized)}: only fp8 e4m3 weights with block "
                              f"scales (DeepSeek-V3's, Kimi K2's: quant_method fp8, weight_block_size) are read; dequantize "
                              f"the others first")
    block = quantized.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{where}: quantization_config.weight_block_size {as_json(block)} is not two positive "
                              f"whole numbers (DeepSeek-V3: [128, 128])")
    return tuple(block)


class BlockScaledWeights:
    """A WeightFiles whose fp8 weights read as their dequantized fp32 values (module docstring)."""

    def __init__(self, files: WeightFiles, block: Tuple[int, int]):
        self.files, self.block = files, block
        names = files.names()
        self.scaled = {n[:-len(SCALE_SUFFIX)] for n in names if n.endswith(SCALE_SUFFIX)}
        self._names = [n for n in names if not n.endswith(SCALE_SUFFIX)]

    def __getattr__(self, name: str):  # folder, kind, where: the files'
        return getattr(self.files, name)

    def names(self):
        return list(self._names)

    def shape(self, name: str) -> Tuple[int, ...]:
        return self.files.shape(name)

    def read(self, name: str) -> torch.Tensor:
        return self._dequantized(name, self.files.read(name), 0)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._dequantized(name, self.files.read_rows(name, start, stop), start)

    def _dequantized(self, name: str, tensor: torch.Tensor, first_row: int) -> torch.Tensor:
        """tensor: rows first_row.. of weight `name` as stored."""
        if tensor.dtype != torch.float8_e4m3fn:
            return tensor
        if name not in self.scaled:
            raise CheckpointError(f"{self.files.folder}: {name} is fp8 without {name}{SCALE_SUFFIX}, the block scales "
                                  f"its values need")
        rows, cols = self.block
        out, inner = self.files.shape(name)
        expected = (-(-out // rows), -(-inner // cols))
        if self.files.shape(name + SCALE_SUFFIX) != expected:
            raise CheckpointError(f"{self.files.folder}: {name}{SCALE_SUFFIX} has shape "
                                  f"{list(self.files.shape(name + SCALE_SUFFIX))}, but {list((out, inner))} in blocks of "
                                  f"{list(self.block)} (quantization_config.weight_block_size) needs {list(expected)}")
        last_row = first_row + tensor.shape[0]
        first_block, end_block = first_row // rows, -(-last_row // rows)
        scales = self.files.read_rows(name + SCALE_SUFFIX, first_block, end_block).to(torch.float32)
        per_row = scales.repeat_interleave(rows, dim=0)[first_row - first_block * rows:][:tensor.shape[0]]
        return tensor.to(torch.float32) * per_row.repeat_interleave(cols, dim=1)[:, :inner]
