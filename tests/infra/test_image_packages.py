"""Each image installs a fixed set of the monorepo's packages (infra/docker); those packages' declared
dependencies must cover everything their code imports, since no image is built and run here.

The dev virtualenv has every package installed, so a missing declaration goes unnoticed there; inside an
image it is an ImportError at start. Imports of another DejaVu package not in the image break the seam
(e.g. the controller importing torch code).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

from .conftest import REPO

WORKER_LIBS = ("libs/common", "libs/dejavulib", "libs/engine", "libs/worker")
IMAGES = {
    "controller": ("libs/common", "services/controller"),
    "prompt-worker": (*WORKER_LIBS, "services/prompt_worker"),
    "token-worker": (*WORKER_LIBS, "services/token_worker"),
}


def project(folder: str) -> dict:
    return tomllib.loads((REPO / folder / "pyproject.toml").read_text())["project"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_modules(folder: str) -> dict[str, str]:
    """Top-level module -> first file importing it, over every .py file of the package folder."""
    found: dict[str, str] = {}
    for path in sorted((REPO / folder).glob("*/**/*.py")):
        if ".egg-info" in str(path):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(REPO)))
    return found


def dependency_closure(roots: list[str]) -> set[str]:
    """Distributions installed by pip for ``roots`` (canonical names), following installed metadata."""
    seen: set[str] = set()
    todo = [canonical(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonical(req.name))
    return seen


def installed_without_dependencies(image: str) -> set[str]:
    """Distributions an image's Dockerfile installs with ``pip install --no-deps`` (outside pip's resolver: xgrammar
    without its triton dependency, the model package): canonical names, read from the image's build stage."""
    if image == "controller":
        return set()  # the controller's image installs nothing that way
    dockerfile = (REPO / "infra/docker/base.Dockerfile").read_text().replace("\\\n", " ")
    names: set[str] = set()
    for line in dockerfile.splitlines():
        for command in line.split("&&"):
            if "pip install" in command and "--no-deps" in command:
                words = [w for w in command.split() if not w.startswith("-") and "/" not in w and "=" not in w]
                names |= {canonical(w) for w in words[words.index("install") + 1 :]}
    return names


@pytest.mark.parametrize(
    "image",
    list(IMAGES),
)
def test_declared_dependencies_cover_the_imports(image: str) -> None:
    folders = IMAGES[image]
    local_dists = [project(f)["name"] for f in folders]
    local_modules = {p.name for f in folders for p in (REPO / f).iterdir() if (p / "__init__.py").is_file()}
    closure = dependency_closure(local_dists) | installed_without_dependencies(image)
    owners = md.packages_distributions()
    problems = []
    for folder in folders:
        for module, where in imported_modules(folder).items():
            if module in sys.stdlib_module_names or module in local_modules or module == "__future__":
                continue
            if module.startswith("dejavu"):
                problems.append(f"{where}: imports {module}, a DejaVu package that the {image} image lacks")
                continue
            dists = {canonical(d) for d in owners.get(module, [])}
            if not dists & closure:
                problems.append(f"{where}: imports {module} (from {sorted(dists) or '?'}), not a declared dependency")
    assert not problems, "\n".join(problems)
