"""Where deployment files set environment variables: Compose services, Kubernetes containers, Dockerfiles.

Each source yields :class:`EnvVar` values, so one test can check every ``DEJAVU_*`` name and value the
deployment hands to a DejaVu process against the settings root.
"""

from __future__ import annotations

import base64
import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Stand-ins for values that only exist at run time (a pod's own IP address and name).
POD_IP_STAND_IN = "10.0.0.7"
POD_NAME_STAND_IN = "pod-0"


@dataclass(frozen=True)
class EnvVar:
    """One variable set for one process: ``where`` names the file and service/container."""

    where: str
    name: str
    value: str


def compose_env(compose: Mapping[str, Any], where: str = "compose") -> Iterator[EnvVar]:
    """The ``environment`` of every service of an interpolated Compose document."""
    for service_name, service in compose.get("services", {}).items():
        env = service.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
        for name, value in env.items():
            yield EnvVar(f"{where}:{service_name}", name, "" if value is None else str(value))


def _secret_values(docs: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    values: dict[tuple[str, str], str] = {}
    for doc in docs:
        if doc.get("kind") == "Secret":
            name = doc["metadata"]["name"]
            for key, encoded in (doc.get("data") or {}).items():
                values[(name, key)] = base64.b64decode(encoded).decode()
            for key, value in (doc.get("stringData") or {}).items():
                values[(name, key)] = value
    return values


def _pod_specs(doc: dict[str, Any]) -> dict[str, Any] | None:
    spec = doc.get("spec") or {}
    if doc.get("kind") == "Pod":
        return spec
    template = spec.get("template")
    return template.get("spec") if template else None


def k8s_env(docs: list[dict[str, Any]], where: str = "k8s") -> Iterator[EnvVar]:
    """The ``env`` of every container of rendered manifests, secret references resolved.

    A ``secretKeyRef`` takes its value from a Secret among ``docs`` (KeyError if none has it); a
    ``fieldRef`` to the pod IP or name gets a stand-in. Other references raise ValueError.
    """
    secrets = _secret_values(docs)
    for doc in docs:
        pod = _pod_specs(doc)
        if pod is None:
            continue
        for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
            label = f"{where}:{doc['kind']}/{doc['metadata']['name']}/{container['name']}"
            for item in container.get("env", []):
                if "value" in item:
                    yield EnvVar(label, item["name"], str(item["value"]))
                    continue
                ref = item.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    key = (ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"])
                    yield EnvVar(label, item["name"], secrets[key])
                elif ref.get("fieldRef", {}).get("fieldPath") == "status.podIP":
                    yield EnvVar(label, item["name"], POD_IP_STAND_IN)
                elif ref.get("fieldRef", {}).get("fieldPath") == "metadata.name":
                    yield EnvVar(label, item["name"], POD_NAME_STAND_IN)
                else:
                    raise ValueError(f"{label}: unsupported env source {item}")


_ENV_LINE = re.compile(r"^\s*ENV\s+(?P<body>.*)$", re.IGNORECASE)


def dockerfile_env(path: Path) -> Iterator[EnvVar]:
    """The ``ENV KEY=VALUE ...`` instructions of a Dockerfile (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    for line in text.splitlines():
        match = _ENV_LINE.match(line)
        if not match:
            continue
        for word in shlex.split(match.group("body")):
            if "=" not in word:
                raise ValueError(f"{path.name}: use ENV KEY=VALUE, not the legacy form: {line.strip()}")
            name, value = word.split("=", 1)
            yield EnvVar(f"{path.name}", name, value)
