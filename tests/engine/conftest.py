"""Fixtures of the engine tests: tiny checkpoints of each family, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.tiny_models import FAMILIES, build_checkpoint

torch.set_num_threads(1)  # modest: the machine is shared


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> folder of a tiny random checkpoint with tokenizer."""
    root = tmp_path_factory.mktemp("tiny-checkpoints")
    return {family: build_checkpoint(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The prepared default checkpoint (converted from the bundled GGUF on first use)."""
    from dejavu_common.settings import Settings
    from dejavu_engine.checkpoint import ensure_default_model

    return ensure_default_model(Settings())
