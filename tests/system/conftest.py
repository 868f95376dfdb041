"""Fixtures shared by the system tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from dejavu_common.settings import Settings
from dejavu_engine.checkpoint import ensure_default_model


@pytest.fixture(scope="module")
def model() -> Path:
    """The default model's prepared folder (converted once, never downloaded)."""
    return ensure_default_model(Settings())
