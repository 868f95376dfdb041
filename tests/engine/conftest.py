"""Fixtures of the engine tests: tiny checkpoints of each family, built once per session, and the device the
stages run on (``--engine-device``, CPU by default)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.tiny_models import FAMILIES, build_checkpoint

torch.set_num_threads(1)  # modest: the machine is shared

# The modules whose tests hold on any device: the stages' arithmetic against transformers and against itself
# (batching, paging, sampling). The others test the host: the CPU's native kernels and oneDNN GEMMs, worker
# processes, the command line, the prepared default model.
DEVICE_GENERIC = {
    "test_families",
    "test_windowed_families",
    "test_rope_scaling",
    "test_batching",
    "test_generate",
    "test_paged",
    "test_stage",
}


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> str:
    """The device the engine tests' stages run on; a device this host lacks fails every test that asks."""
    name = str(pytestconfig.getoption("--engine-device"))
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.fail(f"--engine-device {name}: CUDA is not available here", pytrace=False)
    return name


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a device other than the CPU, only the device-generic modules run (skipped at collection, so that no
    fixture of a host test, such as the prepared model, is set up)."""
    device = str(config.getoption("--engine-device"))
    if torch.device(device).type == "cpu":
        return
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason=f"tests the CPU host, not the engine on {device}")
    for item in items:
        if item.path.parent == here and item.path.stem not in DEVICE_GENERIC:
            item.add_marker(skip)


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
