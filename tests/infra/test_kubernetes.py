"""infra/k8s: both overlays render (kustomize) to manifests that the Kubernetes schemas accept, with
probes, resources, credentials from the Secret, stable worker identities and the images `make` builds."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from .conftest import INFRA, REPO, render_overlay

K8S_VERSION = "1.33.0"
BASE = INFRA / "k8s" / "base"


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return doc["spec"]["template"]["spec"]["containers"]


def service_version(folder: str) -> str:
    return tomllib.loads((REPO / "services" / folder / "pyproject.toml").read_text())["project"]["version"]


def overlay_of(docs: list[dict[str, Any]]) -> str:
    workers = by_kind(docs, "StatefulSet")["prompt-worker"]
    return "gpu" if "nvidia.com/gpu" in containers(workers)[0]["resources"]["limits"] else "cpu"


def test_manifests_pass_the_kubernetes_schemas(rendered: list[dict[str, Any]]) -> None:
    for doc in rendered:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_schema_check_catches_a_mistake(rendered: list[dict[str, Any]]) -> None:
    controller = dict(by_kind(rendered, "Deployment")["controller"])
    controller["spec"] = {**controller["spec"], "replica": 1}  # misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(controller, K8S_VERSION, strict=True)


def test_everything_lives_in_the_dejavu_namespace(rendered: list[dict[str, Any]]) -> None:
    assert [d["metadata"]["name"] for d in rendered if d["kind"] == "Namespace"] == ["dejavu"]
    assert all(d["metadata"].get("namespace") == "dejavu" for d in rendered if d["kind"] != "Namespace")


def test_every_container_has_probes_and_resource_requests(rendered: list[dict[str, Any]]) -> None:
    workloads = [*by_kind(rendered, "Deployment").values(), *by_kind(rendered, "StatefulSet").values()]
    assert {w["metadata"]["name"] for w in workloads} == {
        "redis",
        "controller",
        "prompt-worker",
        "token-worker",
        "token-worker-spare",
    }
    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            assert {"readinessProbe", "livenessProbe"} <= set(c), workload["metadata"]["name"]
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), workload["metadata"]["name"]


def test_probes_use_the_health_endpoints(rendered: list[dict[str, Any]]) -> None:
    controller = containers(by_kind(rendered, "Deployment")["controller"])[0]
    assert controller["livenessProbe"]["httpGet"]["path"] == "/health"
    assert controller["readinessProbe"]["httpGet"]["path"] == "/ready"
    # Both on the probe listener, which the API port's connections cannot starve.
    ports = {port["name"]: port["containerPort"] for port in controller["ports"]}
    env = {e["name"]: e.get("value") for e in controller["env"]}
    assert ports["probe"] == int(env["DEJAVU_CONTROLLER__PROBE_PORT"]) != ports["http"]
    assert controller["livenessProbe"]["httpGet"]["port"] == controller["readinessProbe"]["httpGet"]["port"] == "probe"
    for name, module in [
        ("prompt-worker", "dejavu_prompt_worker"),
        ("token-worker", "dejavu_token_worker"),
        ("token-worker-spare", "dejavu_token_worker"),
    ]:
        worker = containers(by_kind(rendered, "StatefulSet")[name])[0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert worker[probe]["exec"]["command"] == ["python", "-m", module, "--check"]


def test_workers_have_stable_identities(rendered: list[dict[str, Any]]) -> None:
    services = by_kind(rendered, "Service")
    sets = by_kind(rendered, "StatefulSet")
    for name in ("prompt-worker", "token-worker", "token-worker-spare"):
        assert sets[name]["spec"]["serviceName"] == name
        assert services[name]["spec"]["clusterIP"] == "None"
    assert containers(sets["token-worker-spare"])[0]["args"] == ["--spare"]
    env = {e["name"]: e.get("value") for e in containers(by_kind(rendered, "Deployment")["controller"])[0]["env"]}
    assert sets["prompt-worker"]["spec"]["replicas"] == int(env["DEJAVU_CONTROLLER__PROMPT_DEPTH"])
    assert sets["token-worker"]["spec"]["replicas"] == int(env["DEJAVU_CONTROLLER__TOKEN_DEPTH"])


def test_credentials_come_from_the_generated_secret(rendered: list[dict[str, Any]]) -> None:
    secrets = by_kind(rendered, "Secret")
    assert len(secrets) == 1
    (name, secret) = next(iter(secrets.items()))
    assert re.fullmatch(r"dejavu-secrets-[a-z0-9]{10}", name), "the name carries the content hash"
    refs = [
        e["valueFrom"]["secretKeyRef"]
        for d in rendered
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in containers(d)
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    ]
    assert refs and all(r["name"] == name and r["key"] in secret["data"] for r in refs)
    # Nothing secret is written out as a plain value.
    plain = [e for d in rendered if d["kind"] != "Secret" for e in _env_items(d) if "value" in e]
    secret_names = r"PASSWORD|SECRET|CREDENTIAL|API_KEYS|SIGNING_KEY"
    assert not [e for e in plain if re.search(secret_names, e["name"]) and not e["name"].endswith("_FILE")]


def test_each_worker_pod_gets_only_its_own_redis_password(rendered: list[dict[str, Any]]) -> None:
    sets = by_kind(rendered, "StatefulSet")
    redis_env = {e["name"]: e for e in containers(sets["redis"])[0]["env"]}
    ids = []
    for name in ("prompt-worker", "token-worker", "token-worker-spare"):
        pod = sets[name]["spec"]["template"]["spec"]
        ids += [f"{name[0]}-{name}-{i}" for i in range(sets[name]["spec"]["replicas"])]  # '<p|t>-<pod name>'
        assert pod["automountServiceAccountToken"] is False
        secret_volumes = {v["name"] for v in pod["volumes"] if "secret" in v}
        (init,) = pod["initContainers"]
        assert {m["name"] for m in init["volumeMounts"]} & secret_volumes  # the init container reads them...
        for container in pod["containers"]:  # ...the worker never mounts them
            assert not {m["name"] for m in container.get("volumeMounts", [])} & secret_volumes, name
            env = {e["name"]: e for e in container["env"]}
            assert env["DEJAVU_REDIS__USERNAME"]["value"] == f"worker-{name[0]}-$(POD_NAME)"
            assert "DEJAVU_REDIS__PASSWORD" not in env
            assert env["DEJAVU_REDIS__PASSWORD_FILE"]["value"].startswith("/run/dejavu/")
    # Redis makes a user for exactly these pods, each with its password from the Secret.
    assert redis_env["REDIS_WORKER_IDS"]["value"].split(",") == ids
    for worker_id in ids:
        variable = "REDIS_PASSWORD_WORKER_" + worker_id.upper().replace("-", "_")
        assert redis_env[variable]["valueFrom"]["secretKeyRef"]["key"] == variable


def _env_items(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] not in ("Deployment", "StatefulSet"):
        return []
    return [e for c in containers(doc) for e in c.get("env", [])]


def test_redis_config_is_mounted_from_infra_redis(rendered: list[dict[str, Any]]) -> None:
    (config,) = [d for d in rendered if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("redis-config")]
    for file in ("redis.conf", "users.acl.rules", "start.sh"):
        assert config["data"][file] == (INFRA / "redis" / file).read_text()
    redis = by_kind(rendered, "StatefulSet")["redis"]
    volumes = {v["name"]: v for v in redis["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == config["metadata"]["name"]
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_only_dejavu_pods_reach_redis(rendered: list[dict[str, Any]]) -> None:
    policy = by_kind(rendered, "NetworkPolicy")["redis"]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "redis"}
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    (expression,) = source["podSelector"]["matchExpressions"]
    clients = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
        for d in rendered
        if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] != "redis"
    }
    assert expression["operator"] == "In" and set(expression["values"]) == clients
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]


def test_only_the_deployments_workers_reach_a_workers_data_plane(rendered: list[dict[str, Any]]) -> None:
    """Every worker pod is selected by a policy whose one ingress rule admits worker pods of this namespace
    only (no namespace selector, no address blocks), and no other pod carries the worker label."""
    policy = by_kind(rendered, "NetworkPolicy")["worker-data-plane"]["spec"]
    selector = policy["podSelector"]["matchLabels"]
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    assert source == {"podSelector": {"matchLabels": selector}}
    workloads = {**by_kind(rendered, "Deployment"), **by_kind(rendered, "StatefulSet")}
    selected = {
        name
        for name, doc in workloads.items()
        if selector.items() <= doc["spec"]["template"]["metadata"]["labels"].items()
    }
    assert selected == {"prompt-worker", "token-worker", "token-worker-spare"}


def test_images_are_the_ones_make_builds(rendered: list[dict[str, Any]]) -> None:
    variant = {"cpu": "cpu", "gpu": "cuda"}[overlay_of(rendered)]
    expected = {
        "controller": f"dejavu-controller:{service_version('controller')}",
        "prompt-worker": f"dejavu-prompt-worker:{service_version('prompt_worker')}-{variant}",
        "token-worker": f"dejavu-token-worker:{service_version('token_worker')}-{variant}",
        "token-worker-spare": f"dejavu-token-worker:{service_version('token_worker')}-{variant}",
    }
    workloads = {**by_kind(rendered, "Deployment"), **by_kind(rendered, "StatefulSet")}
    for name, image in expected.items():
        assert containers(workloads[name])[0]["image"] == image


def test_only_the_gpu_overlay_asks_for_gpus(rendered: list[dict[str, Any]]) -> None:
    gpu = overlay_of(rendered) == "gpu"
    for doc in by_kind(rendered, "StatefulSet").values():
        c = containers(doc)[0]
        is_worker = doc["metadata"]["name"] != "redis"
        asks = "nvidia.com/gpu" in c["resources"].get("limits", {})
        assert asks == (gpu and is_worker), doc["metadata"]["name"]
        if is_worker:
            device = {e["name"]: e.get("value") for e in c["env"]}["DEJAVU_MODEL__DEVICE"]
            assert device == ("cuda" if gpu else "cpu")


def test_a_registry_renames_the_dejavu_images_only(tmp_path: Path) -> None:
    docs = render_overlay(tmp_path, "cpu", registry="registry.example/acme/")
    images = {c["image"] for d in docs if d["kind"] in ("Deployment", "StatefulSet") for c in containers(d)}
    assert {i for i in images if "dejavu-" in i} == {
        f"registry.example/acme/dejavu-controller:{service_version('controller')}",
        f"registry.example/acme/dejavu-prompt-worker:{service_version('prompt_worker')}-cpu",
        f"registry.example/acme/dejavu-token-worker:{service_version('token_worker')}-cpu",
    }
    assert any(i.startswith("redis:") for i in images)


BASE_RESOURCES = sorted(p for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("path", BASE_RESOURCES, ids=lambda p: p.name)
def test_base_files_pass_the_schemas_on_their_own(path: Path) -> None:
    """Runs without kubectl too: every base resource file is a complete manifest."""
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_every_worker_pod_is_scraped_on_the_port_its_metrics_are_served_at(rendered: list[dict[str, Any]]) -> None:
    """The scrape annotations name the port the worker serves its metrics on (on every interface), a container
    port called 'metrics', and a policy admits the cluster's pods to that port (docs/metrics.md)."""
    workers = {n: d for n, d in by_kind(rendered, "StatefulSet").items() if n != "redis"}
    assert set(workers) == {"prompt-worker", "token-worker", "token-worker-spare"}
    for name, doc in workers.items():
        annotations = doc["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        port = int(annotations["prometheus.io/port"])
        (worker,) = containers(doc)
        env = {e["name"]: e.get("value") for e in worker["env"]}
        assert int(env["DEJAVU_WORKER__METRICS_PORT"]) == port, name
        assert env["DEJAVU_WORKER__METRICS_HOST"] == "0.0.0.0", name
        assert {"name": "metrics", "containerPort": port} in worker["ports"], name
        policy = by_kind(rendered, "NetworkPolicy")["worker-metrics"]["spec"]
        assert policy["podSelector"]["matchLabels"].items() <= doc["spec"]["template"]["metadata"]["labels"].items()
        assert policy["ingress"][0]["ports"] == [{"port": port, "protocol": "TCP"}]
