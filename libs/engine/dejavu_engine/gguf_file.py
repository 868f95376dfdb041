"""Tensors of a GGUF file under their Hugging Face checkpoint names, kept quantized as published.

A GGUF file (llama.cpp's format) holds each weight in a block type: float (F32, F16, BF16) or quantized in
blocks of 32 values with a float16 scale ``d`` (and minimum ``m``). :func:`decode_blocks` reads the five legacy
block types into a :class:`~dejavu_engine.quant.QuantizedWeight` with 32-value groups and float32 scales
(offsets: the minimums), losslessly; the 4-bit and 5-bit types of :data:`PACKED_TYPES` keep the file's bytes of
nibbles (and the 5-bit types' word of fifth bits a block) as they are (the packed layouts are GGUF's), Q8_0 is
int8:

| type | bytes a block | value | held |
|---|---|---|---|
| Q8_0 | 34: d, 32 int8 | ``d * q`` | int8 ``q`` |
| Q4_0 | 18: d, 16 bytes of nibbles | ``d * (q - 8)`` | the nibbles, zero 8 |
| Q4_1 | 20: d, m, 16 bytes of nibbles | ``d * q + m`` | the nibbles, offset ``m`` |
| Q5_0 | 22: d, 4 bytes of high bits, 16 of nibbles | ``d * (q - 16)`` | the nibbles and high bits, zero 16 |
| Q5_1 | 24: d, m, 4 bytes of high bits, 16 of nibbles | ``d * q + m`` | the nibbles and high bits, offset ``m`` |

A block's low nibbles are its values 0-15 and its high nibbles 16-31; bit ``i`` of the high-bit word is value
``i``'s fifth bit (held as an int32 ``[rows, columns / 32]``, :attr:`QuantizedWeight.high`). With ``packed=False``
every type is widened to int8 (one value a byte: the packed kernels' reference). The values are gguf's
(``gguf.quants.dequantize``) bit for bit. Other types (the K-quants, IQ types) are refused with their name.

:class:`GGUFTensors` reads a Llama-architecture file (SmolLM2, Llama 2/3 as llama.cpp converts them): GGUF's
names mapped to the checkpoint names the Llama family loads, and the rows of ``attn_q`` / ``attn_k`` put back in
Hugging Face's order (llama.cpp interleaves each head's rotary halves; the inverse is a permutation of output
rows, so it applies to blocks and scales alike), as transformers does when it loads the file.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from dejavu_engine.quant import QuantizedWeight

BLOCK = 32
# type name -> (bytes a block, has a minimum, bits a value)
BLOCK_TYPES: dict[str, tuple[int, bool, int]] = {
    "Q8_0": (34, False, 8),
    "Q4_0": (18, False, 4),
    "Q4_1": (20, True, 4),
    "Q5_0": (22, False, 5),
    "Q5_1": (24, True, 5),
}
PACKED_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1"})  # kept packed in memory; the others widened to int8
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": None}
_SUPPORTED = ", ".join([*BLOCK_TYPES, *FLOAT_TYPES])

# GGUF name (per layer: "blk.{i}.") -> Hugging Face Llama name.
_LLAMA_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def decode_blocks(data: np.ndarray, kind: str, columns: int, packed: bool | None = None) -> QuantizedWeight:
    """Rows of blocks (uint8 ``[rows, bytes]``) of block type ``kind``, ``columns`` values a row -> the weight:
    packed 4-bit or 5-bit values (Q4_x, Q5_x where ``packed``; by default those of :data:`PACKED_TYPES`) or int8 values,
    float32 scales and offsets (or None) ``[rows, columns / 32]``. Raises ValueError for another type or a size
    that does not fit."""
    if kind not in BLOCK_TYPES:
        raise ValueError(f"GGUF block type {kind} is not supported (supported: {_SUPPORTED})")
    size, has_min, bits = BLOCK_TYPES[kind]
    rows = data.shape[0]
    if columns % BLOCK or data.shape[1] != columns // BLOCK * size:
        raise ValueError(f"{kind}: {data.shape[1]} bytes a row do not hold {columns} values")
    blocks = np.ascontiguousarray(data).reshape(rows, columns // BLOCK, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    at = 2
    m = None
    if has_min:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        at = 4
    scale, offset = torch.from_numpy(d), torch.from_numpy(m) if m is not None else None
    if bits in (4, 5) and (kind in PACKED_TYPES if packed is None else packed):
        fifth = None
        if bits == 5:  # the block's word of fifth bits, little-endian, as int32
            fifth = torch.from_numpy(np.ascontiguousarray(blocks[..., at : at + 4]).view("<i4")[..., 0].copy())
            at += 4
        nibbles = np.ascontiguousarray(blocks[..., at:]).reshape(rows, columns // 2)
        zero = 0 if has_min else 1 << (bits - 1)
        return QuantizedWeight(torch.from_numpy(nibbles), scale, offset, kind=kind, zero=zero, high=fifth)
    if bits == 8:
        q = blocks[..., at:].view(np.int8)
    else:
        high = None
        if bits == 5:
            word = blocks[..., at : at + 4].copy().view("<u4")  # [rows, blocks, 1]
            high = ((word >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.int16) << 4
            at += 4
        nibbles = blocks[..., at:]
        q16 = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.int16)
        if high is not None:
            q16 |= high
        if not has_min:
            q16 -= 1 << (bits - 1)
        q = q16.astype(np.int8)
    values = torch.from_numpy(np.ascontiguousarray(q).reshape(rows, columns))
    return QuantizedWeight(values, scale, offset, kind=kind)


class GGUFTensors:
    """The tensors of one GGUF file by checkpoint name: quantized ones as :class:`QuantizedWeight`, float ones
    as float32 tensors. Raises ValueError for an architecture other than Llama's."""

    def __init__(self, path: Path) -> None:
        import gguf  # the reader of llama.cpp's project; imported only where a GGUF file is read

        self.path = path
        self._reader = gguf.GGUFReader(str(path))
        arch = self._field("general.architecture")
        if arch != "llama":
            raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported (llama only)")
        self.heads = int(self._field("llama.attention.head_count"))
        self.kv_heads = int(self._field("llama.attention.head_count_kv") or self.heads)
        self._tensors = {_hf_name(t.name): t for t in self._reader.tensors}

    def _field(self, key: str) -> object:
        field = self._reader.fields.get(key)
        return field.contents() if field is not None else None

    def names(self) -> list[str]:
        return list(self._tensors)

    def kind(self, name: str) -> str:
        """The block type of tensor ``name`` (``"Q4_1"``, ``"F32"``, ...)."""
        return self._tensors[name].tensor_type.name

    def load(self, name: str, dtype: torch.dtype) -> torch.Tensor | QuantizedWeight:
        """Tensor ``name``: a quantized weight kept quantized, a float one cast to ``dtype``."""
        tensor = self._tensors[name]
        kind = tensor.tensor_type.name
        columns = int(tensor.shape[0])  # GGUF lists dimensions innermost first
        if kind in BLOCK_TYPES:
            return self._unpermute(name, decode_blocks(np.asarray(tensor.data), kind, columns))
        if kind not in FLOAT_TYPES:
            raise ValueError(f"{name}: GGUF type {kind} is not supported (supported: {_SUPPORTED})")
        data = np.asarray(tensor.data)
        if kind == "BF16":
            dense = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
        else:
            dense = torch.from_numpy(data.copy())
        dense = dense.reshape([int(n) for n in reversed(tensor.shape)])
        return self._unpermute(name, dense.to(dtype))

    def _unpermute(self, name: str, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        """``attn_q`` / ``attn_k`` rows back in Hugging Face's order (transformers' ``reverse_permute``)."""
        if name.endswith("self_attn.q_proj.weight"):
            heads = self.heads
        elif name.endswith("self_attn.k_proj.weight"):
            heads = self.kv_heads
        else:
            return weight
        rows = weight.shape[0]
        order = torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)
        if isinstance(weight, QuantizedWeight):  # index_select: ~25x advanced indexing's speed on int8 rows here
            offset = weight.offset.index_select(0, order) if weight.offset is not None else None
            high = weight.high.index_select(0, order) if weight.high is not None else None
            q, scale = weight.q.index_select(0, order), weight.scale.index_select(0, order)
            return QuantizedWeight(q, scale, offset, kind=weight.kind, zero=weight.zero, high=high)
        return weight.index_select(0, order)


def _hf_name(name: str) -> str:
    if name in _LLAMA_GLOBAL:
        return _LLAMA_GLOBAL[name]
    match = _LAYER_NAME.match(name)
    if match is None or match.group(2) not in _LLAMA_LAYER:
        return name  # kept under its GGUF name; no family asks for it
    layer, module, kind = match.groups()
    return f"model.layers.{layer}.{_LLAMA_LAYER[module]}.{kind}"
