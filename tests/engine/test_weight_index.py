"""Weight-file indexes and the files of some of their tensors, read back by the formats' own readers (``gguf``'s
GGUFReader, ``safetensors``' safe_open): the same tensors, bit for bit, the same metadata."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants
from safetensors import safe_open
from safetensors.torch import save_file

from dejavu_engine.weight_index import Layout, ShortHeader, WeightIndex, WeightIndexError, parse_index


def _write(layout: Layout, data: bytes, path: Path) -> None:
    with path.open("wb") as out:
        out.write(layout.header)
        out.truncate(layout.size)
        for piece in layout.pieces:
            out.seek(piece.target)
            out.write(data[piece.source : piece.source + piece.size])


def _index(data: bytes) -> WeightIndex:
    """The index read from prefixes as a client reads them: as long as the header says it needs."""
    size = 64
    while True:
        try:
            return parse_index(data[:size], len(data))
        except ShortHeader as short:
            size = max(short.needed, size * 2)


@pytest.mark.parametrize("alignment", [None, 64])
def test_a_gguf_file_of_some_tensors_holds_their_blocks_and_every_key(alignment: int | None, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(tmp_path / "whole.gguf"), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_head_count(4)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    for i, kind in enumerate(["Q4_1", "Q8_0", "F32", "Q5_0", "F16"]):
        rows = rng.standard_normal((5 + 3 * i, 64)).astype(np.float32)
        qtype = GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor(f"t{i}", rows)
        elif kind == "F16":
            writer.add_tensor(f"t{i}", rows.astype(np.float16))
        else:
            writer.add_tensor(f"t{i}", quants.quantize(rows, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = (tmp_path / "whole.gguf").read_bytes()
    index = _index(data)
    assert index.kind == "gguf" and list(index.tensors) == [f"t{i}" for i in range(5)]
    assert index.alignment == (alignment or 32)
    _write(index.subset(["t3", "t1", "t4"]), data, tmp_path / "part.gguf")
    whole, part = GGUFReader(str(tmp_path / "whole.gguf")), GGUFReader(str(tmp_path / "part.gguf"))
    assert [t.name for t in part.tensors] == ["t1", "t3", "t4"]
    originals = {t.name: t for t in whole.tensors}
    for tensor in part.tensors:
        original = originals[tensor.name]
        assert tensor.tensor_type == original.tensor_type and list(tensor.shape) == list(original.shape)
        assert np.array_equal(np.asarray(tensor.data), np.asarray(original.data))
        assert tensor.data_offset % (alignment or 32) == 0
    assert {k: f.contents() for k, f in part.fields.items() if not k.startswith("GGUF.")} == {
        k: f.contents() for k, f in whole.fields.items() if not k.startswith("GGUF.")
    }


def test_a_safetensors_file_of_some_tensors_keeps_their_dtypes_and_the_metadata(tmp_path: Path) -> None:
    tensors = {
        "a.weight": torch.randn(3, 5),
        "b.weight": torch.randint(-128, 127, (4, 6), dtype=torch.int8),
        "b.weight_scale": torch.rand(4, 1),
        "c.bias": torch.randn(7, dtype=torch.bfloat16),
    }
    save_file(tensors, str(tmp_path / "whole.safetensors"), metadata={"format": "pt", "note": "kept"})
    data = (tmp_path / "whole.safetensors").read_bytes()
    index = _index(data)
    _write(index.subset(["b.weight", "b.weight_scale", "c.bias"]), data, tmp_path / "part.safetensors")
    with safe_open(str(tmp_path / "part.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt", "note": "kept"}
        assert set(handle.keys()) == {"b.weight", "b.weight_scale", "c.bias"}
        for name in handle.keys():  # noqa: SIM118 (safe_open is no mapping)
            assert (
                torch.equal(handle.get_tensor(name), tensors[name])
                and handle.get_tensor(name).dtype == tensors[name].dtype
            )


def test_a_malformed_header_or_unknown_tensor_is_refused(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(4)}, str(tmp_path / "m.safetensors"))
    data = (tmp_path / "m.safetensors").read_bytes()
    with pytest.raises(WeightIndexError, match="outside the file"):
        parse_index(data, len(data) - 1)  # the file cut short: its tensor ends past the end
    with pytest.raises(WeightIndexError, match="not a safetensors file"):
        parse_index(b"\xff" * 16, 16)
    with pytest.raises(KeyError, match="not in the weight file: b"):
        parse_index(data, len(data)).subset(["a", "b"])
    with pytest.raises(WeightIndexError, match="GGUF version 9"):
        parse_index(b"GGUF" + (9).to_bytes(4, "little") + bytes(16), 24)
