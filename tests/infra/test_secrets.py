"""infra/secrets/generate.sh: fresh random credentials, written once, private to their owner."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from .conftest import generate_secrets, read_env_file

KEYS = {
    "REDIS_PASSWORD_CONTROLLER",
    "REDIS_PASSWORD_WORKER",
    "REDIS_PASSWORD_ADMIN",
    "DATA_PLANE_SECRET",
    "ADMIN_CREDENTIAL",
    "CONTROLLER_API_KEYS",
}


def test_writes_every_credential_random_and_private(tmp_path: Path) -> None:
    first = generate_secrets(tmp_path / "a.env")
    second = generate_secrets(tmp_path / "b.env")
    assert set(first) == KEYS
    api_keys = json.loads(first["CONTROLLER_API_KEYS"])
    assert isinstance(api_keys, list) and len(api_keys) == 1
    values = [v for k, v in first.items() if k != "CONTROLLER_API_KEYS"] + api_keys
    assert all(len(v) == 64 and all(c in "0123456789abcdef" for c in v) for v in values)
    assert len(set(values)) == len(values), "two credentials are equal"
    assert not set(first.values()) & set(second.values()), "two runs gave a common credential"
    assert stat.S_IMODE((tmp_path / "a.env").stat().st_mode) == 0o600


def test_keeps_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "secrets.env"
    first = generate_secrets(path)
    assert generate_secrets(path) == first
    assert read_env_file(path) == first
