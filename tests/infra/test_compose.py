"""infra/compose/compose.yaml: valid Compose, the services DejaVu needs, credentials from secrets.env."""

from __future__ import annotations

import importlib.resources
import json
import tomllib
from typing import Any

import jsonschema
import pytest

from .conftest import COMPOSE_FILE, INFRA, REPO
from .interpolation import MissingVariableError, interpolate, required_variables


def compose_schema() -> dict[str, Any]:
    """The compose-spec JSON schema vendored by the check-jsonschema package."""
    path = importlib.resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    return json.loads(path.read_text())


def test_matches_the_compose_specification(compose: dict[str, Any]) -> None:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_the_schema_check_catches_a_mistake(compose: dict[str, Any]) -> None:
    schema = compose_schema()
    broken = json.loads(json.dumps(compose))
    broken["services"]["controller"]["restart_policy"] = "always"  # not a service key
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_has_redis_controller_two_stage_pipelines_and_a_spare(compose: dict[str, Any]) -> None:
    services = compose["services"]
    images = {name: svc["image"].rsplit("/", 1)[-1].split(":")[0] for name, svc in services.items()}
    assert images["redis"] == "redis"
    assert images["controller"] == "dejavu-controller"
    prompt = [n for n, i in images.items() if i == "dejavu-prompt-worker"]
    token = [n for n, i in images.items() if i == "dejavu-token-worker"]
    spares = [n for n in token if "--spare" in (services[n].get("command") or [])]
    env = services["controller"]["environment"]
    assert len(prompt) == int(env["DEJAVU_CONTROLLER__PROMPT_DEPTH"])
    assert len(token) - len(spares) == int(env["DEJAVU_CONTROLLER__TOKEN_DEPTH"])
    assert spares == ["token-worker-spare"]
    # A worker's id is '<p|t>-<hostname>': distinct hostnames keep the ids distinct.
    hostnames = [services[n]["hostname"] for n in prompt + token]
    assert len(set(hostnames)) == len(hostnames)
    for name in prompt + token:
        assert services[name]["environment"]["DEJAVU_TRANSPORT__HOST"] == services[name]["hostname"]
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_redis_is_password_protected_and_persistent(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    assert redis["command"] == ["sh", "/etc/dejavu/redis/start.sh"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in redis["volumes"]}
    assert (COMPOSE_FILE.parent / mounts["/etc/dejavu/redis"]).resolve() == INFRA / "redis"
    assert mounts["/data"] in compose["volumes"]
    workers = {n: s for n, s in compose["services"].items() if n not in ("redis", "controller")}
    ids = {
        f"{'p' if 'prompt' in n else 't'}-{s['hostname']}" for n, s in workers.items()
    }  # as the workers name themselves
    assert set(redis["environment"]["REDIS_WORKER_IDS"].split(",")) == ids
    per_worker = {"REDIS_PASSWORD_WORKER_" + i.upper().replace("-", "_") for i in ids}
    assert (
        set(redis["environment"])
        == {"REDIS_PASSWORD_CONTROLLER", "REDIS_PASSWORD_ADMIN", "REDIS_WORKER_IDS"} | per_worker
    )
    assert compose["services"]["controller"]["environment"]["DEJAVU_REDIS__USERNAME"] == "controller"
    # Each worker logs in as its own user: no shared worker credential in a Compose deployment.
    users = {s["environment"]["DEJAVU_REDIS__USERNAME"] for s in workers.values()}
    assert users == {f"worker-{i}" for i in ids}


def test_every_required_variable_comes_from_generate_sh(secrets_env: dict[str, str]) -> None:
    text = COMPOSE_FILE.read_text()
    assert required_variables(text) <= set(secrets_env)
    with pytest.raises(MissingVariableError):
        interpolate(text, {})


def test_default_image_tags_are_the_ones_make_builds(compose: dict[str, Any]) -> None:
    def version(folder: str) -> str:
        return tomllib.loads((REPO / "services" / folder / "pyproject.toml").read_text())["project"]["version"]

    expected = {
        "dejavu-controller": f"dejavu-controller:{version('controller')}",
        "dejavu-prompt-worker": f"dejavu-prompt-worker:{version('prompt_worker')}-cpu",
        "dejavu-token-worker": f"dejavu-token-worker:{version('token_worker')}-cpu",
    }
    for service in compose["services"].values():
        name = service["image"].split(":")[0]
        if name in expected:
            assert service["image"] == expected[name]


def test_every_worker_serves_its_metrics_on_the_port_the_file_lists(compose: dict[str, Any]) -> None:
    services = compose["services"]
    workers = [n for n, svc in services.items() if "worker" in svc["image"]]
    assert len(workers) == 5
    for name in workers:
        env = services[name]["environment"]
        assert env["DEJAVU_WORKER__METRICS_HOST"] == "0.0.0.0"
        assert [str(p) for p in services[name]["expose"]] == [str(env["DEJAVU_WORKER__METRICS_PORT"])]
