"""Where each tensor's bytes lie in a weight file, and a smaller file of some of its tensors, byte for byte.

A weight file is a header that indexes its tensors, then their data:

* safetensors: an 8-byte little-endian header length, a JSON header (``name -> {dtype, shape, data_offsets}``,
  offsets relative to the data that follows), then the data;
* GGUF (versions 2 and 3, little-endian): magic, version, tensor and key-value counts, the key-value pairs
  (architecture, tokenizer, ...), one entry a tensor (name, dimensions, block type, offset), padding to
  ``general.alignment``, then the data, each tensor at an aligned offset.

:func:`parse_index` reads such a header from a prefix of the file (raising :class:`ShortHeader` with the size to
read when the prefix is too short), and :meth:`WeightIndex.subset` lays out a file of the named tensors: the same
header (GGUF: the same key-value bytes; safetensors: the same metadata) indexing only them, and their bytes as
stored, so quantized blocks and int8 tensors are never converted. Pure: no I/O, no torch.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
GGUF_ALIGNMENT = 32  # gguf's default where a file sets no general.alignment
SAFETENSORS_ALIGNMENT = 8  # safetensors pads its header with spaces to a multiple of 8 bytes
MAX_HEADER_BYTES = 1 << 30  # beyond this a header is taken to be corrupt

# GGUF value type -> struct format of one value (8: string, 9: array, handled apart).
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class ShortHeader(Exception):
    """The prefix given does not hold the whole header; ``needed`` bytes of the file do (at least)."""

    def __init__(self, needed: int) -> None:
        super().__init__(f"the header needs at least {needed} bytes")
        self.needed = needed


class WeightIndexError(ValueError):
    """A weight file's header is malformed or of an unsupported kind."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a weight file: its stored name, where its bytes lie (``[start, end)`` in the file), and the
    header entry it is written back with (safetensors: its JSON dict; GGUF: its entry's bytes before the offset)."""

    name: str
    start: int
    end: int
    entry: bytes | dict

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Piece:
    """``size`` bytes copied from ``source`` in the weight file to ``target`` in the file :meth:`WeightIndex.subset`
    lays out."""

    source: int
    target: int
    size: int


@dataclass(frozen=True)
class Layout:
    """A file of some tensors of a weight file: its header bytes, then the pieces of data, ``size`` bytes in all."""

    header: bytes
    pieces: tuple[Piece, ...]
    size: int


@dataclass(frozen=True)
class WeightIndex:
    """The tensors of one weight file (``kind``: ``"safetensors"`` or ``"gguf"``), in file order."""

    kind: str
    tensors: dict[str, TensorEntry]
    header_bytes: int  # where the data begins
    _prefix: bytes  # GGUF: magic and version; safetensors: unused
    _middle: bytes  # GGUF: the key-value count and pairs; safetensors: the JSON of __metadata__ (or b"")
    alignment: int

    def subset(self, names: Iterable[str]) -> Layout:
        """The layout of a file holding the tensors named ``names`` (stored names; KeyError for another) as this
        file holds them, in this file's order."""
        wanted = set(names)
        chosen = [t for t in self.tensors.values() if t.name in wanted]
        missing = wanted - {t.name for t in chosen}
        if missing:
            raise KeyError(f"not in the weight file: {', '.join(sorted(missing))}")
        if self.kind == "safetensors":
            return self._safetensors_subset(chosen)
        return self._gguf_subset(chosen)

    def _safetensors_subset(self, chosen: list[TensorEntry]) -> Layout:
        header: dict[str, object] = {}
        if self._middle:
            header["__metadata__"] = json.loads(self._middle)
        at = 0
        placed: list[tuple[TensorEntry, int]] = []
        for tensor in chosen:
            entry = dict(tensor.entry)  # type: ignore[arg-type]
            entry["data_offsets"] = [at, at + tensor.size]
            header[tensor.name] = entry
            placed.append((tensor, at))
            at += tensor.size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % SAFETENSORS_ALIGNMENT)
        head = struct.pack("<Q", len(text)) + text
        pieces = tuple(Piece(t.start, len(head) + offset, t.size) for t, offset in placed)
        return Layout(head, pieces, len(head) + at)

    def _gguf_subset(self, chosen: list[TensorEntry]) -> Layout:
        entries = bytearray()
        at = 0
        offsets: list[int] = []
        for tensor in chosen:
            entries += tensor.entry  # type: ignore[operator]
            entries += struct.pack("<Q", at)
            offsets.append(at)
            at = _aligned(at + tensor.size, self.alignment)
        head = self._prefix + struct.pack("<Q", len(chosen)) + self._middle + bytes(entries)
        head += b"\0" * (-len(head) % self.alignment)
        pieces = tuple(Piece(t.start, len(head) + offset, t.size) for t, offset in zip(chosen, offsets, strict=True))
        end = len(head) + (offsets[-1] + chosen[-1].size if chosen else 0)
        return Layout(head, pieces, end)


def parse_index(prefix: bytes, file_size: int, gguf_type_bytes: Callable[[int, int], int] | None = None) -> WeightIndex:
    """The index of a weight file of ``file_size`` bytes from its first bytes ``prefix``: safetensors or GGUF by
    the magic. ``gguf_type_bytes(block_type, elements)`` gives a GGUF tensor's bytes (default: gguf's table of
    block sizes). Raises :class:`ShortHeader` where ``prefix`` is too short and :class:`WeightIndexError` for a
    malformed header or a tensor past the end of the file."""
    if prefix[:4] == GGUF_MAGIC:
        return _parse_gguf(prefix, file_size, gguf_type_bytes or _gguf_type_bytes)
    return _parse_safetensors(prefix, file_size)


def _parse_safetensors(prefix: bytes, file_size: int) -> WeightIndex:
    if len(prefix) < 8:
        raise ShortHeader(8)
    (length,) = struct.unpack_from("<Q", prefix)
    if length > MAX_HEADER_BYTES or 8 + length > file_size:
        raise WeightIndexError(f"not a safetensors file (a header of {length} bytes in a file of {file_size})")
    if len(prefix) < 8 + length:
        raise ShortHeader(8 + length)
    try:
        header = json.loads(prefix[8 : 8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightIndexError(f"safetensors header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise WeightIndexError("safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    data = 8 + length
    tensors: list[TensorEntry] = []
    for name, entry in header.items():
        try:
            begin, end = (int(v) for v in entry["data_offsets"])
        except (TypeError, KeyError, ValueError) as exc:
            raise WeightIndexError(f"safetensors entry {name!r} has no data_offsets") from exc
        if not 0 <= begin <= end or data + end > file_size:
            raise WeightIndexError(f"safetensors tensor {name!r} lies outside the file ({begin}, {end})")
        tensors.append(TensorEntry(name, data + begin, data + end, {k: v for k, v in entry.items()}))
    tensors.sort(key=lambda t: t.start)
    middle = json.dumps(metadata).encode() if metadata is not None else b""
    return WeightIndex("safetensors", {t.name: t for t in tensors}, data, b"", middle, SAFETENSORS_ALIGNMENT)


class _Cursor:
    """Reads little-endian values off a prefix of a file; :class:`ShortHeader` past its end."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, size: int) -> bytes:
        if size > MAX_HEADER_BYTES:
            raise WeightIndexError(f"GGUF header field of {size} bytes")
        end = self.at + size
        if end > len(self.data):
            raise ShortHeader(end)
        out = self.data[self.at : end]
        self.at = end
        return out

    def unpack(self, fmt: str) -> int | float | bool:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = int(self.unpack("<Q"))
        return self.take(length).decode("utf-8", errors="replace")

    def value(self, kind: int) -> object:
        """A value of GGUF type ``kind`` (an array's items are skipped, returned as None)."""
        if kind in _GGUF_SCALARS:
            return self.unpack(_GGUF_SCALARS[kind])
        if kind == _GGUF_STRING:
            return self.string()
        if kind != _GGUF_ARRAY:
            raise WeightIndexError(f"GGUF value type {kind} is not one of gguf's")
        item, count = int(self.unpack("<I")), int(self.unpack("<Q"))
        if item in _GGUF_SCALARS:
            self.take(struct.calcsize(_GGUF_SCALARS[item]) * count)
        else:
            for _ in range(count):
                self.value(item)
        return None


def _parse_gguf(prefix: bytes, file_size: int, type_bytes: Callable[[int, int], int]) -> WeightIndex:
    cursor = _Cursor(prefix)
    magic_version = cursor.take(8)
    version = struct.unpack_from("<I", magic_version, 4)[0]
    if version not in GGUF_VERSIONS:
        raise WeightIndexError(f"GGUF version {version} is not supported (little-endian {GGUF_VERSIONS} only)")
    tensor_count = int(cursor.unpack("<Q"))
    kv_start = cursor.at
    kv_count = int(cursor.unpack("<Q"))
    alignment = GGUF_ALIGNMENT
    for _ in range(kv_count):
        key = cursor.string()
        value = cursor.value(int(cursor.unpack("<I")))
        if key == "general.alignment":
            if not isinstance(value, int) or value <= 0 or value % 8:
                raise WeightIndexError(f"GGUF general.alignment {value!r} is not a positive multiple of 8")
            alignment = value
    middle = prefix[kv_start : cursor.at]
    raw: list[tuple[str, bytes, int, int]] = []  # name, entry bytes before the offset, offset, bytes
    for _ in range(tensor_count):
        entry_start = cursor.at
        name = cursor.string()
        dims = [int(cursor.unpack("<Q")) for _ in range(int(cursor.unpack("<I")))]
        block_type = int(cursor.unpack("<I"))
        entry = prefix[entry_start : cursor.at]
        offset = int(cursor.unpack("<Q"))
        raw.append((name, entry, offset, type_bytes(block_type, math.prod(dims))))
    data = _aligned(cursor.at, alignment)
    tensors: list[TensorEntry] = []
    for name, entry, offset, size in raw:
        start = data + offset
        if start + size > file_size:
            raise WeightIndexError(f"GGUF tensor {name!r} lies past the end of the file")
        tensors.append(TensorEntry(name, start, start + size, entry))
    tensors.sort(key=lambda t: t.start)
    return WeightIndex("gguf", {t.name: t for t in tensors}, data, magic_version, middle, alignment)


def _gguf_type_bytes(block_type: int, elements: int) -> int:
    """Bytes of a GGUF tensor of ``elements`` values in block type ``block_type`` (gguf's table)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(block_type)]
    except (KeyError, ValueError) as exc:
        raise WeightIndexError(f"GGUF block type {block_type} is unknown to gguf") from exc
    if elements % block:
        raise WeightIndexError(f"GGUF tensor of {elements} values is no whole number of {block}-value blocks")
    return elements // block * size


def _aligned(at: int, alignment: int) -> int:
    return at + (-at % alignment)
