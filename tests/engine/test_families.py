"""Each family's forward equals transformers' own forward, whole or split into stages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dejavu_engine.geometry import BatchGeometry
from dejavu_engine.pipeline import Pipeline
from engine.tiny_models import FAMILIES

PROMPT, DECODE = 9, 5
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_checkpoints: dict[str, Path]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """family -> (token ids [1, PROMPT + DECODE], HF logits for every position)."""
    out = {}
    generator = torch.Generator().manual_seed(1)
    for family, folder in tiny_checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        ids = torch.randint(3, 300, (1, PROMPT + DECODE), generator=generator)
        with torch.no_grad():
            out[family] = (ids, model(ids).logits)
    return out


@pytest.mark.parametrize("path", ["host", "generic"])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_match_transformers(
    family: str,
    stages: int,
    path: str,
    device: str,
    tiny_checkpoints: dict[str, Path],
    reference: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """On ``device``: ``host``, the stage as this host builds it (on a CPU, oneDNN-packed GEMMs and the native
    kernels where they build); ``generic``, the device-generic path alone (dense weights, torch's attention),
    which is what a CUDA device runs."""
    ids, expected = reference[family]
    generic = path == "generic"
    pipeline = Pipeline(tiny_checkpoints[family], stages, device, pack_gemms=not generic, native_attention=not generic)
    caches = pipeline.allocate(1, PROMPT + DECODE)
    geometry = BatchGeometry((0,), PROMPT)
    prefill = pipeline.forward(ids[:, :PROMPT], caches, geometry, all_logits=True)
    assert prefill.device.type == torch.device(device).type  # computed there, from token ids on the host
    torch.testing.assert_close(prefill.cpu(), expected[:, :PROMPT], atol=TOLERANCE, rtol=0)
    for t in range(PROMPT, PROMPT + DECODE):  # teacher forcing: feed the reference token
        geometry = geometry.advance()
        logits = pipeline.forward(ids[:, t : t + 1], caches, geometry)
        torch.testing.assert_close(logits[:, 0].cpu(), expected[:, t], atol=TOLERANCE, rtol=0)
