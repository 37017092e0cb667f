"""The GGUF container: metadata, the tensor table, and each tensor's bytes in the file.

Our own parser instead of `gguf.GGUFReader`: that one builds a numpy view for every string of
the vocabulary and the merges (about 3 s for a 49k-token vocabulary); this one walks past
string arrays unless asked for them (about 50 ms), so config checks, `action=plan` and the
engine all read the header cheaply. Dequantization is the `gguf` package's.
No torch here: config validation reads model configs without loading torch.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # v1 counted in 32 bits; llama.cpp has not written it since 2023
DEFAULT_ALIGNMENT = 32
# Fixed-size metadata value types by GGUF type id: u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF lists the fastest-moving dimension first)
    ggml_type: GGMLQuantizationType
    offset: int  # absolute, in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]  # string arrays not asked for are given as their length
    tensors: dict[str, TensorInfo]

    def data(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as `gguf.dequantize` takes them: rows of blocks (or of values)."""
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
        rows = math.prod(info.shape[:-1]) if len(info.shape) > 1 else 1
        return raw.reshape(rows, info.nbytes // rows)


class _Cursor:
    """Little-endian reads from the header; running off the end is a truncated file."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def read(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.read("Q")
        raw = bytes(self.buf[self.pos:self.pos + length])
        if len(raw) != length:
            raise struct.error("string runs past the end of the file")
        self.pos += length
        return raw.decode("utf-8")

    def value(self, kind: int, keep_strings: bool) -> Any:
        if kind in _SCALARS:
            return self.read(_SCALARS[kind])[0]
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = self.read("IQ")
        if item in _SCALARS:
            return list(self.read(f"{count}{_SCALARS[item]}"))
        if item == _STRING and not keep_strings:  # a vocabulary or merge table: walk past it
            for _ in range(count):
                (length,) = self.read("Q")
                self.pos += length
            return count
        return [self.value(item, keep_strings) for _ in range(count)]


def read_gguf(path: str | Path, string_arrays: Container[str] = ()) -> GGUFFile:
    """Metadata and tensor table of a GGUF file; `string_arrays` names the string-array keys
    to read in full. A missing, truncated or corrupt file is one ValueError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            if f.read(4) != MAGIC:
                raise ValueError("it does not start with the GGUF magic bytes: not a GGUF file")
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        return _parse(path, memoryview(mapped), size, string_arrays)
    except (struct.error, UnicodeDecodeError) as err:
        raise ValueError(f"GGUF file {str(path)!r} is truncated or corrupt: its header is "
                         f"unreadable ({err}); download or convert it again") from None
    except ValueError as err:
        raise ValueError(f"GGUF file {str(path)!r}: {err}") from None


def _parse(path: Path, buf: memoryview, size: int, string_arrays: Container[str]) -> GGUFFile:
    cur = _Cursor(buf)
    cur.pos = len(MAGIC)
    (version,) = cur.read("I")
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (supported: {VERSIONS}; "
                         "a big-endian file also shows up here)")
    tensor_count, kv_count = cur.read("QQ")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        (kind,) = cur.read("I")
        metadata[key] = cur.value(kind, key in string_arrays)
    table = [_tensor_entry(cur) for _ in range(tensor_count)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, shape, ggml_type, offset in table:
        info = TensorInfo(name, shape, ggml_type, data_start + offset, _nbytes(name, shape, ggml_type))
        if info.offset + info.nbytes > size:
            raise ValueError(f"the file is truncated: tensor {name!r} ends at byte "
                             f"{info.offset + info.nbytes} but the file has {size} bytes; "
                             "download or convert it again")
        tensors[name] = info
    return GGUFFile(path, metadata, tensors)


def _tensor_entry(cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cur.string()
    (ndim,) = cur.read("I")
    dims = cur.read(f"{ndim}Q")
    type_id, offset = cur.read("IQ")
    try:
        ggml_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(f"tensor {name!r} has unknown ggml type {type_id}") from None
    return name, tuple(reversed(dims)), ggml_type, offset


def _nbytes(name: str, shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
    block, block_bytes = GGML_QUANT_SIZES[ggml_type]
    if shape and shape[-1] % block:
        raise ValueError(f"tensor {name!r}: its rows of {shape[-1]} values are not whole "
                         f"{ggml_type.name} blocks of {block}")
    return math.prod(shape) // block * block_bytes
