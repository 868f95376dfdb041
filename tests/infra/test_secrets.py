"""infra/secrets/generate.sh: fresh random credentials, written once, private to their owner."""

from __future__ import annotations

import base64
import json
import stat
import subprocess
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from .conftest import GENERATE, generate_secrets, read_env_file

DEFAULT_WORKERS = (
    "p-prompt-worker-0",
    "p-prompt-worker-1",
    "t-token-worker-0",
    "t-token-worker-1",
    "t-token-worker-spare",  # Compose's spare
    "t-token-worker-spare-0",  # the Kubernetes spare's pod
)
KEYS = {
    "REDIS_PASSWORD_CONTROLLER",
    *("REDIS_PASSWORD_WORKER_" + w.upper().replace("-", "_") for w in DEFAULT_WORKERS),
    "REDIS_PASSWORD_ADMIN",
    "DATA_PLANE_SECRET",
    "ADMIN_SIGNING_KEY",
    "ADMIN_VERIFY_KEY",
    "CONTROLLER_API_KEYS",
}


def test_writes_every_credential_random_and_private(tmp_path: Path) -> None:
    first = generate_secrets(tmp_path / "a.env")
    second = generate_secrets(tmp_path / "b.env")
    assert set(first) == KEYS
    api_keys = json.loads(first["CONTROLLER_API_KEYS"])
    assert isinstance(api_keys, list) and len(api_keys) == 1
    not_hex = ("CONTROLLER_API_KEYS", "ADMIN_SIGNING_KEY", "ADMIN_VERIFY_KEY")
    values = [v for k, v in first.items() if k not in not_hex]
    values += api_keys
    assert all(len(v) == 64 and all(c in "0123456789abcdef" for c in v) for v in values)
    assert len(set(values)) == len(values), "two credentials are equal"
    assert not set(first.values()) & set(second.values()), "two runs gave a common credential"
    assert stat.S_IMODE((tmp_path / "a.env").stat().st_mode) == 0o600
    assert first["ADMIN_SIGNING_KEY"] != second["ADMIN_SIGNING_KEY"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.env", "b.env"]  # no key file left behind


def test_each_named_worker_gets_its_own_redis_password(tmp_path: Path) -> None:
    secrets = generate_secrets(tmp_path / "a.env", "t0", "token.worker-7")
    assert {k for k in secrets if k.startswith("REDIS_PASSWORD_WORKER_")} == {
        "REDIS_PASSWORD_WORKER_T0",
        "REDIS_PASSWORD_WORKER_TOKEN_WORKER_7",
    }
    result = subprocess.run(["sh", str(GENERATE), str(tmp_path / "b.env"), "bad*id"], capture_output=True, text=True)
    assert result.returncode == 2 and not (tmp_path / "b.env").exists()


def test_the_admin_keys_are_an_ed25519_pair(tmp_path: Path) -> None:
    secrets = generate_secrets(tmp_path / "a.env")
    private = Ed25519PrivateKey.from_private_bytes(base64.b64decode(secrets["ADMIN_SIGNING_KEY"]))
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    assert base64.b64encode(public).decode() == secrets["ADMIN_VERIFY_KEY"]


def test_keeps_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "secrets.env"
    first = generate_secrets(path)
    assert generate_secrets(path) == first
    assert read_env_file(path) == first
