"""A Hugging Face model folder, read one tensor at a time: config.json and the weights, in safetensors
(`model.safetensors`, or shards named by `model.safetensors.index.json`) or, only when there is no
safetensors file, PyTorch's pickle format (`pytorch_model.bin` or its index) read with
`torch.load(weights_only=True)`: a file that needs any class to load is refused, so nothing in it runs.

A safetensors tensor is read with plain file reads into a tensor of its own (the format: an 8-byte
little-endian header length, a JSON header of dtype, shape and byte offsets per tensor, then the data),
not through safetensors' memory map: pages of a mapped file count in the process's memory while any
tensor of the file lives, and the map faults in more than the tensor read (measured: a 94 MiB read took
the peak up by 109 MiB). So an import holds the tensor it reads and nothing else of the source
(the memory bound of checkpoint/hf_import.py).
"""
from __future__ import annotations

import json
import math
import os
import struct
from typing import Callable, Dict, List, Tuple

import torch

from megatron_lite.checkpoint.format import CheckpointError
from megatron_lite.checkpoint.preflight import hf_config_path
from megatron_lite.reading import UnreadableFile, read_json

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn}  # fp8: read dequantized (hf_fp8.py)


def read_config(folder: str) -> dict:
    path = hf_config_path(folder)
    try:
        config = read_json(path)
    except UnreadableFile as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: holds {type(config).__name__}, not a JSON object")
    return config


def _index(folder: str, index_name: str) -> Dict[str, str]:
    path = os.path.join(folder, index_name)
    try:
        weight_map = read_json(path)["weight_map"]
        items = list(weight_map.items())
    except UnreadableFile as e:
        raise CheckpointError(str(e)) from None
    except (KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{path}: not a shard index: it has no weight_map object") from None
    for name, shard in items:
        if os.path.basename(shard) != shard or not os.path.isfile(os.path.join(folder, shard)):
            raise CheckpointError(f"{path} puts {name} in {shard}, which is not a file in {folder}")
    return weight_map


class WeightFiles:
    """The weights of a Hugging Face folder by name; `read(name)` loads that one tensor. `rename` maps a name
    as stored to the name it is asked by (GPT-2 files saved from a bare GPT2Model lack `transformer.`)."""

    def __init__(self, folder: str, rename: Callable[[str], str] = lambda name: name):
        self.folder = folder
        self._headers: Dict[str, dict] = {}
        self._loaded: Dict[str, Dict[str, torch.Tensor]] = {}
        files = set(os.listdir(folder))
        if SAFETENSORS_INDEX in files:
            self.kind, stored = "safetensors", _index(folder, SAFETENSORS_INDEX)
        elif SAFETENSORS in files:
            self.kind, stored = "safetensors", {n: SAFETENSORS for n in self._safetensors_names(SAFETENSORS)}
        elif PICKLE_INDEX in files or PICKLE in files:
            self.kind = "pickle"
            stored = _index(folder, PICKLE_INDEX) if PICKLE_INDEX in files else {n: PICKLE for n in self._pickle(PICKLE)}
        else:
            raise CheckpointError(f"--input {folder} has no weights: none of {SAFETENSORS}, {SAFETENSORS_INDEX}, "
                                  f"{PICKLE}, {PICKLE_INDEX}")
        # asked name -> (file, name in the file)
        self.where: Dict[str, Tuple[str, str]] = {rename(n): (file, n) for n, file in stored.items()}

    def names(self) -> List[str]:
        return list(self.where)

    def _safetensors_names(self, file: str) -> List[str]:
        return [name for name in self._header(file) if not name.startswith("__")]

    def _header(self, file: str) -> Dict[str, dict]:
        """A safetensors file's header (tensor name -> dtype, shape, data offsets), with the data's start."""
        headers = self._headers
        if file not in headers:
            path = os.path.join(self.folder, file)
            try:
                with open(path, "rb") as f:
                    (length,) = struct.unpack("<Q", f.read(8))
                    if length > os.path.getsize(path):
                        raise ValueError(f"its header length {length} is past the end of the file")
                    header = json.loads(f.read(length))
                header["__data_start__"] = 8 + length
            except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
            headers[file] = header
        return headers[file]

    def shape(self, name: str) -> Tuple[int, ...]:
        """A tensor's shape, from the file's header (nothing read)."""
        file, stored = self._located(name)
        if self.kind == "pickle":
            return tuple(self._pickle(file)[stored].shape)
        return tuple(self._header(file)[stored].get("shape", ()))

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop of a tensor (dim 0), reading only their bytes."""
        file, stored = self._located(name)
        if self.kind == "pickle":
            return self._pickle(file)[stored][start:stop].clone()
        return self._read_safetensors(file, stored, (start, stop))

    def _read_safetensors(self, file: str, name: str, rows=None) -> torch.Tensor:
        header, path = self._header(file), os.path.join(self.folder, file)
        entry = header[name]
        dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
        shape: Tuple[int, ...] = tuple(entry.get("shape", ()))
        start, end = entry.get("data_offsets", (0, -1))
        if dtype is None:
            raise CheckpointError(f"{path}: {name} has dtype {entry.get('dtype')}, not a weight dtype "
                                  f"({', '.join(SAFETENSORS_DTYPES)})")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if end - start != math.prod(shape) * itemsize or header["__data_start__"] + end > os.path.getsize(path):
            raise CheckpointError(f"{path}: {name}'s bytes {start}..{end} do not hold its shape {list(shape)} of "
                                  f"{entry['dtype']}, or lie past the end of the file")
        offset = 0
        if rows is not None:  # a row-major tensor's rows are one contiguous run of bytes
            row_bytes = math.prod(shape[1:]) * itemsize
            offset, shape = rows[0] * row_bytes, (rows[1] - rows[0],) + shape[1:]
        tensor = torch.empty(shape, dtype=dtype)
        nbytes = tensor.numel() * itemsize
        with open(path, "rb") as f:
            f.seek(header["__data_start__"] + start + offset)
            view = memoryview(tensor.view(torch.uint8).reshape(-1).numpy()) if nbytes else memoryview(b"")
            if f.readinto(view) != nbytes:
                raise CheckpointError(f"{path}: {name} is cut short (the file is truncated)")
        return tensor

    def _pickle(self, file: str) -> Dict[str, torch.Tensor]:
        """A pickle shard, memory-mapped (tensors are read from disk when used), without running anything."""
        if file not in self._loaded:
            path = os.path.join(self.folder, file)
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001 - any failure to read means the same thing to the user
                text = str(e)
                if "weights_only" in text or "Unsupported global" in text or "GLOBAL" in text:
                    raise CheckpointError(f"{path}: refused, it is a pickle that needs more than tensors to load "
                                          f"(loading it could run code); convert it to safetensors") from None
                raise CheckpointError(f"{path}: cannot be read as PyTorch weights ({text.splitlines()[0] if text else e})"
                                      ) from None
            if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
                raise CheckpointError(f"{path}: does not hold a dict of tensors")
            self._loaded = {file: state}  # one shard mapped at a time
        return self._loaded[file]

    def _located(self, name: str) -> Tuple[str, str]:
        if name not in self.where:
            raise CheckpointError(f"--input {self.folder} lacks the tensor {name}: the weights do not match "
                                  f"config.json")
        return self.where[name]

    def read(self, name: str) -> torch.Tensor:
        file, stored = self._located(name)
        if self.kind == "pickle":
            return self._pickle(file)[stored].clone()
        return self._read_safetensors(file, stored)
