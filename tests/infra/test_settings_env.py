"""Every DEJAVU_* variable that a Dockerfile, the Compose file or a Kubernetes manifest sets is a field of
dejavu_common.settings.Settings, and each process's whole environment builds valid Settings."""

from __future__ import annotations

import base64
import enum
import os
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import pytest
from pydantic import SecretStr

from dejavu_common.settings import Settings

from .conftest import INFRA
from .env_sources import EnvVar, compose_env, dockerfile_env, k8s_env
from .settings_fields import env_names

DOCKERFILES = sorted((INFRA / "docker").glob("*.Dockerfile"))


def dejavu_vars(env: Iterable[EnvVar]) -> list[EnvVar]:
    return [v for v in env if v.name.upper().startswith("DEJAVU_")]


def assert_known(env: Iterable[EnvVar]) -> None:
    known = env_names(Settings)
    unknown = [f"{v.where}: {v.name}" for v in dejavu_vars(env) if v.name not in known]
    assert not unknown, "not fields of Settings:\n" + "\n".join(unknown)


def assert_builds_settings(env: Iterable[EnvVar], monkeypatch: pytest.MonkeyPatch) -> None:
    """Build Settings from each process's DEJAVU_* variables alone, as the process would."""
    per_process: dict[str, list[EnvVar]] = defaultdict(list)
    for var in dejavu_vars(env):
        per_process[var.where].append(var)
    assert per_process, "no DEJAVU_* variable found"
    for where, variables in per_process.items():
        with monkeypatch.context() as m:
            for name in [n for n in os.environ if n.upper().startswith("DEJAVU_")]:
                m.delenv(name)
            for var in variables:
                m.setenv(var.name, var.value)
            settings = Settings()
            for var in variables:
                value = _get(settings, var.name.removeprefix("DEJAVU_").lower().split("__"))
                if not isinstance(value, list):
                    assert _as_text(value) == var.value, f"{where}: {var.name}"


def _get(obj: Any, path: list[str]) -> Any:
    for part in path:
        obj = getattr(obj, part)
    return obj


def _as_text(value: Any) -> str:
    """A scalar setting as the environment spells it."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value)


def test_the_field_walk_knows_nested_and_top_level_names() -> None:
    names = env_names(Settings)
    assert {"DEJAVU_REDIS__URL", "DEJAVU_CONTROLLER__API_KEYS", "DEJAVU_LOG_LEVEL", "DEJAVU_REDIS"} <= names
    assert "DEJAVU_REDIS__NO_SUCH_FIELD" not in names
    assert "DEJAVU_URL" not in names


def test_dockerfiles(monkeypatch: pytest.MonkeyPatch) -> None:
    env = [v for path in DOCKERFILES for v in dockerfile_env(path)]
    assert {"DEJAVU_MODEL__CACHE_DIR", "DEJAVU_CONTROLLER__PORT"} <= {v.name for v in env}
    assert_known(env)
    assert_builds_settings(env, monkeypatch)


def test_compose(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    env = list(compose_env(compose))
    assert_known(env)
    assert_builds_settings(env, monkeypatch)
    # Every DejaVu service has its Redis identity.
    for name, service in compose["services"].items():
        if name != "redis":
            assert {"DEJAVU_REDIS__URL", "DEJAVU_REDIS__USERNAME", "DEJAVU_REDIS__PASSWORD"} <= set(
                service["environment"]
            )


def test_kubernetes(rendered: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    env = list(k8s_env(rendered))
    assert_known(env)
    assert_builds_settings(env, monkeypatch)


def test_an_unknown_name_is_caught() -> None:
    with pytest.raises(AssertionError, match="DEJAVU_REDIS__HOST"):
        assert_known([EnvVar("example", "DEJAVU_REDIS__HOST", "redis")])


def _holders(env: Iterable[EnvVar], name: str) -> dict[str, str]:
    return {v.where.split(":", 1)[1]: v.value for v in env if v.name == name}


def assert_credentials_reach_only_their_users(env: list[EnvVar], credentials: dict[str, str]) -> None:
    """API keys: the controller; data-plane secret and admin verify key: the workers (which verify admin
    commands); the admin signing key: nobody; each Redis user's password: its processes."""
    processes = {v.where.split(":", 1)[1] for v in env if v.name.startswith("DEJAVU_")}  # not init containers
    controller = {p for p in processes if "controller" in p}
    workers = {p for p in processes if "worker" in p}
    assert len(controller) == 1 and len(workers) >= 3
    assert set(_holders(env, "DEJAVU_CONTROLLER__API_KEYS")) == controller
    assert set(_holders(env, "DEJAVU_TRANSPORT__SECRET")) == workers
    assert set(_holders(env, "DEJAVU_ADMIN__VERIFY_KEY")) == workers
    assert set(_holders(env, "DEJAVU_ADMIN__VERIFY_KEY").values()) == {credentials["ADMIN_VERIFY_KEY"]}
    assert not _holders(env, "DEJAVU_ADMIN__SIGNING_KEY")
    assert credentials["ADMIN_SIGNING_KEY"] not in {v.value for v in env}
    passwords = _holders(env, "DEJAVU_REDIS__PASSWORD")
    users = _holders(env, "DEJAVU_REDIS__USERNAME")
    assert {passwords[p] for p in controller} == {credentials["REDIS_PASSWORD_CONTROLLER"]}
    files = _holders(env, "DEJAVU_REDIS__PASSWORD_FILE")
    for p in workers:  # its own Redis user, and its own password: from the env (Compose) or a file (Kubernetes)
        assert users[p].startswith("worker-"), p
        if p in files:  # written by the pod's init container, the only one that mounts the passwords
            assert p not in passwords and "$(POD_NAME)" in users[p], p
            continue
        variable = "REDIS_PASSWORD_" + users[p].upper().replace("-", "_").replace(".", "_")
        assert passwords[p] == credentials[variable], p
    named = [users[p] for p in workers if p not in files]  # (a pod's user carries its own pod name)
    assert len(set(named)) == len(named), "two workers share a Redis user"


def test_compose_credentials_reach_only_their_users(compose: dict[str, Any], secrets_env: dict[str, str]) -> None:
    assert_credentials_reach_only_their_users(list(compose_env(compose)), secrets_env)


def test_kubernetes_credentials_reach_only_their_users(rendered: list[dict[str, Any]]) -> None:
    (secret,) = [d for d in rendered if d["kind"] == "Secret"]
    credentials = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert_credentials_reach_only_their_users(list(k8s_env(rendered)), credentials)
