"""Fixtures of the infra checks: generated credentials, the interpolated Compose file, rendered overlays."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .interpolation import interpolate_document

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
COMPOSE_FILE = INFRA / "compose" / "compose.yaml"
GENERATE = INFRA / "secrets" / "generate.sh"
OVERLAYS = ("cpu", "gpu")


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines, as Compose's --env-file and kustomize's secretGenerator read them."""
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))
    return {key: value for key, value in pairs}


def generate_secrets(path: Path, *worker_ids: str) -> dict[str, str]:
    """Run infra/secrets/generate.sh into ``path`` (for ``worker_ids``, or its defaults) and return what it wrote."""
    subprocess.run(["sh", str(GENERATE), str(path), *worker_ids], check=True, capture_output=True, timeout=30)
    return read_env_file(path)


def render_overlay(workdir: Path, overlay: str, registry: str | None = None) -> list[dict[str, Any]]:
    """Render an overlay with infra/k8s/render.sh from a copy of infra/ that has fresh credentials.

    The copy keeps the repository's tree clean (the secretGenerator needs base/secrets.env).
    """
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (which carries kustomize) is not on PATH: rendered overlays not checked")
    copy = workdir / "infra"
    if not copy.exists():
        for part in ("k8s", "redis", "secrets"):
            shutil.copytree(INFRA / part, copy / part)
        generate_secrets(copy / "k8s" / "base" / "secrets.env")
    args = ["sh", str(copy / "k8s" / "render.sh"), overlay, *([registry] if registry else [])]
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="session")
def secrets_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return generate_secrets(tmp_path_factory.mktemp("secrets") / "secrets.env")


@pytest.fixture(scope="session")
def compose(secrets_env: dict[str, str]) -> dict[str, Any]:
    """compose.yaml as `docker compose --env-file secrets.env` sees it (defaults for everything else)."""
    return interpolate_document(yaml.safe_load(COMPOSE_FILE.read_text()), secrets_env)


@pytest.fixture(scope="session", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The manifests of one overlay (parametrized over cpu and gpu)."""
    return render_overlay(tmp_path_factory.mktemp("k8s"), request.param)
