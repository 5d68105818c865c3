"""A GGUF file's header, checked field by field: its metadata keys and value types, and its tensor table.

``gguf.GGUFReader`` decodes every metadata value into numpy views (a 50k-token vocabulary is
hundreds of thousands of them: seconds on every start) and, on a malformed file, fails with whatever
numpy raised (an ``IndexError`` deep inside). This reader walks the header with ``struct`` over a
memory map, skips the values it is not asked for, bounds every count and length by the bytes left,
and reports any defect as one ``ValueError`` naming the file, the offset and the field. It refuses what
gguf's own reader refuses (a repeated key or tensor name, an alignment that is not a uint32 power of
two) and more (counts, lengths and offsets past the end of the file, arrays nested without end);
what it does not judge (a vocabulary's text) is left to transformers, whose errors the loader reports
the same way. The engine reads the weights through its tensor table (``tensor_view``) without
building a ``GGUFReader`` at all.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# Metadata value types -> struct codes of their fixed sizes (8 string, 9 array: read apart).
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
UINT32, STRING, ARRAY = 4, 8, 9
# Arrays of arrays deeper than this are refused (a file could nest them until Python's stack ends).
MAX_ARRAY_DEPTH = 8
# Unquantized tensor types -> numpy element types (the rest are blocks of bytes).
_PLAIN_TYPES = {0: "f4", 1: "f2", 24: "i1", 25: "i2", 26: "i4", 27: "i8", 28: "f8"}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table: ``dims`` in GGUF's order (fastest-varying first), ``offset`` from
    the start of the file."""

    name: str
    type: int  # a gguf.GGMLQuantizationType value
    dims: tuple[int, ...]
    offset: int
    num_bytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.dims)


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    byte_order: str  # "<" or ">"
    alignment: int
    fields: dict[str, Any]  # the values asked for (read_header's ``keys``)
    tensors: list[TensorInfo]


class _Cursor:
    """Reads values of the header in order, every read bounded by the file's end."""

    def __init__(self, buf: Any, size: int, order: str) -> None:
        self.buf, self.size, self.order, self.pos = buf, size, order, 0

    def need(self, count: int, what: str) -> None:
        if count < 0 or self.pos + count > self.size:
            raise _Defect(f"{what} needs {count} bytes at offset {self.pos}, but the file ends at {self.size}")

    def scalar(self, code: str, what: str) -> Any:
        n = struct.calcsize(code)
        self.need(n, what)
        (value,) = struct.unpack_from(self.order + code, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str) -> str:
        length = self.scalar("Q", f"the length of {what}")
        self.need(length, what)
        raw = bytes(self.buf[self.pos:self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Defect(f"{what} is not UTF-8 text ({e})") from None

    def unique_string(self, seen: set[str], what: str, kind: str) -> str:
        """A name (a metadata key, a tensor's name) that must not repeat one in ``seen``; added to it."""
        name = self.string(what)
        if name in seen:
            raise _Defect(f"{kind} {name!r} appears twice")
        seen.add(name)
        return name

    def value(self, kind: int, what: str, keep: bool, depth: int = 0) -> Any:
        """The value of a metadata type (returned where ``keep``, else skipped)."""
        if kind in SCALARS:
            if keep:
                return self.scalar(SCALARS[kind], what)
            self.need(struct.calcsize(SCALARS[kind]), what)
            self.pos += struct.calcsize(SCALARS[kind])
            return None
        if kind == STRING:
            if keep:
                return self.string(what)
            length = self.scalar("Q", f"the length of {what}")
            self.need(length, what)
            self.pos += length
            return None
        if kind == ARRAY:
            item = self.scalar("I", f"the item type of {what}")
            count = self.scalar("Q", f"the item count of {what}")
            if item in SCALARS:
                width = struct.calcsize(SCALARS[item])
                self.need(count * width, f"{what} ({count} items of type {item})")
                if keep:
                    values = list(struct.unpack_from(f"{self.order}{count}{SCALARS[item]}", self.buf, self.pos))
                    self.pos += count * width
                    return values
                self.pos += count * width
                return None
            if item not in (STRING, ARRAY):
                raise _Defect(f"{what} has items of unknown type {item}")
            # Every string or array item takes at least 8 bytes: a count the file cannot hold fails here,
            # not after looping over it.
            self.need(count * 8, f"{what} ({count} items of type {item})")
            if item == STRING and not keep:
                self._skip_strings(count, what)
                return None
            if item == ARRAY and depth >= MAX_ARRAY_DEPTH:
                raise _Defect(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH} levels")
            values = [self.value(item, f"{what}[{i}]", keep, depth + 1) for i in range(count)]
            return values if keep else None
        raise _Defect(f"{what} has unknown value type {kind}")


    def _skip_strings(self, count: int, what: str) -> None:
        """Step over ``count`` strings (a vocabulary: tens of thousands, so in one tight loop)."""
        length_at = struct.Struct(self.order + "Q").unpack_from
        buf, size, pos = self.buf, self.size, self.pos
        for i in range(count):
            if pos + 8 > size:
                raise _Defect(f"{what}[{i}] runs past the end of the file ({size} bytes)")
            pos += 8 + length_at(buf, pos)[0]
        if pos > size:
            raise _Defect(f"{what}[{count - 1}] runs past the end of the file ({size} bytes)")
        self.pos = pos


class _Defect(Exception):
    """A malformed header field (turned into a ValueError naming the file)."""


def read_header(path: str | Path, keys: tuple[str, ...] = ()) -> GGUFHeader:
    """The header of a GGUF file, with the metadata values of ``keys`` decoded (the others skipped);
    ValueError saying what is wrong with a file that is not a well-formed GGUF file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    p = Path(path)
    try:
        with p.open("rb") as f, contextlib.ExitStack() as stack:
            size = p.stat().st_size
            if size < 24:
                raise _Defect(f"the file has {size} bytes, fewer than a GGUF header's first 24")
            buf: Any = stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            if buf[:4] != MAGIC:
                raise _Defect(f"it does not start with the GGUF magic bytes (found {bytes(buf[:4])!r})")
            order = "<" if struct.unpack_from("<I", buf, 4)[0] < 2**16 else ">"
            cur = _Cursor(buf, size, order)
            cur.pos = 4
            version = cur.scalar("I", "the version")
            if version not in VERSIONS:
                raise _Defect(f"GGUF version {version} is not one of {', '.join(map(str, VERSIONS))}")
            num_tensors = cur.scalar("Q", "the tensor count")
            num_fields = cur.scalar("Q", "the metadata count")
            # Each metadata entry takes at least 12 bytes and each tensor entry at least 24.
            cur.need(num_fields * 12 + num_tensors * 24, f"{num_fields} metadata entries and {num_tensors} tensors")
            wanted = set(keys) | {"general.alignment"}
            fields: dict[str, Any] = {}
            seen: set[str] = set()
            alignment = DEFAULT_ALIGNMENT
            for i in range(num_fields):
                key = cur.unique_string(seen, f"metadata key #{i}", "metadata key")
                kind = cur.scalar("I", f"the value type of {key!r}")
                value = cur.value(kind, repr(key), keep=key in wanted)
                if key == "general.alignment":
                    if kind != UINT32 or value <= 0 or value & (value - 1):
                        raise _Defect(f"general.alignment must be a power of two of type uint32, got {value!r} of "
                                      f"type {kind}")
                    alignment = value
                if key in keys:
                    fields[key] = value
            entries = []
            names: set[str] = set()
            for i in range(num_tensors):
                name = cur.unique_string(names, f"the name of tensor #{i}", "tensor")
                n_dims = cur.scalar("I", f"the dimension count of {name!r}")
                if not 1 <= n_dims <= MAX_DIMS:
                    raise _Defect(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} are possible)")
                dims = tuple(cur.scalar("Q", f"a dimension of {name!r}") for _ in range(n_dims))
                kind = cur.scalar("I", f"the type of {name!r}")
                try:
                    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                except (ValueError, KeyError):
                    raise _Defect(f"tensor {name!r} has unknown type {kind}") from None
                if any(d == 0 for d in dims) or dims[0] % block:
                    raise _Defect(f"tensor {name!r} has dimensions {list(dims)}, which its type's blocks of "
                                  f"{block} cannot tile")
                entries.append((name, kind, dims, cur.scalar("Q", f"the data offset of {name!r}"),
                                math.prod(dims) // block * block_bytes))
            data_start = -(-cur.pos // alignment) * alignment
            tensors = []
            for name, kind, dims, offset, num_bytes in entries:
                if offset % alignment:
                    raise _Defect(f"tensor {name!r}'s data offset {offset} is not a multiple of the alignment "
                                  f"{alignment}")
                start = data_start + offset
                if start + num_bytes > size:
                    raise _Defect(f"tensor {name!r}'s {num_bytes} bytes at offset {start} run past the end of "
                                  f"the file ({size} bytes): the file is truncated")
                tensors.append(TensorInfo(name, kind, dims, start, num_bytes))
            return GGUFHeader(p, version, order, alignment, fields, tensors)
    except _Defect as e:
        raise ValueError(f"{p} is not a readable GGUF file: {e}") from None
    except (OSError, struct.error, OverflowError, MemoryError) as e:
        raise ValueError(f"{p} is not a readable GGUF file: {e}") from None


def tensor_view(header: GGUFHeader, data: np.ndarray, tensor: TensorInfo) -> np.ndarray:
    """The tensor's data in ``data`` (the whole file, memory-mapped as uint8), shaped as
    ``gguf.GGUFReader`` shapes it: rows of elements for plain types, rows of block bytes otherwise."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    raw = data[tensor.offset:tensor.offset + tensor.num_bytes]
    shape = tuple(reversed(tensor.dims))
    if tensor.type in _PLAIN_TYPES:
        return raw.view(np.dtype(header.byte_order + _PLAIN_TYPES[tensor.type])).reshape(shape)
    return raw.reshape(quant_shape_to_byte_shape(shape, GGMLQuantizationType(tensor.type)))
