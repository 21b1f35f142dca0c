"""A GGUF file's metadata and tensor table, read without its vocabulary.

The ``gguf`` package's ``GGUFReader`` makes a numpy view of every metadata value, one string
at a time: for the default model's 49,152 tokens and 48,900 merges that took 2.4 s of the
2.5 s ``spillover estimate`` spent here, and a 128k-token vocabulary has about four times as
many strings. The memory model needs none of them: only the scalars, the short numeric arrays
(per-layer head counts and widths), how long the vocabulary is, and the tensor table.

Rules:

1. ``fields`` holds every scalar (a string decoded as UTF-8, bad bytes replaced) and every
   numeric array of at most ``ARRAY_KEPT`` values, as Python values, under its key. A longer
   array, or one of strings or of arrays, is stepped over: ``lengths`` holds every array's
   element count, kept or not.
2. ``tensors`` holds each tensor's ``name``, ``shape`` (llama.cpp's ``ne``: the innermost
   dimension first, as ``GGUFReader`` gives it), ``tensor_type``, ``n_bytes`` and
   ``data_offset`` (from the start of the file), as ``GGUFReader``'s tensors do.
3. Anything else refuses with ``ValueError``: not GGUF, a version other than 2 or 3, a
   big-endian file, an unknown value or tensor type, a duplicated tensor, or a tensor whose
   data would end past the end of the file (a truncated download). The caller then reads the
   file with ``GGUFReader``, whose own error is the one the user sees.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["ARRAY_KEPT", "Header", "TensorInfo", "read_header"]

ARRAY_KEPT = 4096  # rule 1: numeric arrays up to this long are kept (per-layer lists), longer ones stepped over

# GGUF value types: their struct format, or None for a string (8) and an array (9).
_SCALARS: dict[int, str] = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_ALIGNMENT = 32  # general.alignment's default


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table (rule 2)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    n_bytes: int
    data_offset: int


@dataclass
class Header:
    """A GGUF file's metadata (rule 1) and tensor table (rule 2)."""

    fields: dict[str, Any] = field(default_factory=dict)
    lengths: dict[str, int] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        text = bytes(self.buf[self.pos : end]).decode("utf-8", "replace")
        self.pos = end
        return text

    def skip_string(self) -> None:
        n = self.take("Q")
        self.pos += n
        if self.pos > len(self.buf):
            raise ValueError("a string runs past the end of the file")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.take(fmt)

    def array(self) -> tuple[int, list[Any] | None]:
        """An array's length, and its values when rule 1 keeps them."""
        etype, count = self.take("I"), self.take("Q")
        fmt = _SCALARS.get(etype)
        if fmt is not None:
            size = struct.calcsize(fmt) * count
            if self.pos + size > len(self.buf):
                raise ValueError("an array runs past the end of the file")
            values = list(struct.unpack_from(f"<{count}{fmt}", self.buf, self.pos)) if count <= ARRAY_KEPT else None
            self.pos += size
            return count, values
        if etype == _STRING:
            for _ in range(count):
                self.skip_string()
            return count, None
        if etype == _ARRAY:
            for _ in range(count):
                self.array()
            return count, None
        raise ValueError(f"unknown GGUF array type {etype}")


def read_header(path: str | Path) -> Header:
    """The file's metadata and tensor table (see the module's rules)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise ValueError("too short for a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse(buf, size)
            except struct.error as exc:  # a field runs past the end
                raise ValueError(f"the header runs past the end of the file: {exc}") from None


def _parse(buf: Any, size: int) -> Header:
    c = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("not a GGUF file")
    c.pos = 4
    version = c.take("I")
    if version not in (2, 3):  # a big-endian file reads as a huge version
        raise ValueError(f"GGUF version {version} is not read here")
    n_tensors, n_kv = c.take("Q"), c.take("Q")
    h = Header()
    for _ in range(n_kv):
        key = c.string()
        vtype = c.take("I")
        if vtype == _ARRAY:
            h.lengths[key], values = c.array()
            if values is not None:
                h.fields[key] = values
        else:
            h.fields[key] = c.value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.take("I")
        if n_dims > 8:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = tuple(c.take("Q") for _ in range(n_dims))
        ttype = GGMLQuantizationType(c.take("I"))  # ValueError for an unknown type
        infos.append((name, dims, ttype, c.take("Q")))
    alignment = int(h.fields.get("general.alignment", _ALIGNMENT)) or _ALIGNMENT
    start = c.pos + (-c.pos % alignment)
    seen: set[str] = set()
    for name, dims, ttype, offset in infos:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        block, type_size = GGML_QUANT_SIZES[ttype]
        n_elements = 1
        for d in dims:
            n_elements *= d
        n_bytes = n_elements * type_size // block
        if start + offset + n_bytes > size:
            raise ValueError(f"tensor {name!r} ends past the end of the file (truncated?)")
        h.tensors.append(TensorInfo(name, dims, ttype, n_bytes, start + offset))
    return h
