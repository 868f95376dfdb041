"""Compose-style ``${VAR}`` interpolation, as `docker compose` applies it to a parsed Compose file.

Compose parses the YAML first and then interpolates string values, so a value such as ``["key"]``
stays a string (it would turn into a list if the text were interpolated before parsing).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?message}, ${NAME?message}; '$$' is a literal '$'.
_PATTERN = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


class MissingVariableError(KeyError):
    """A ``${NAME:?message}`` (or ``${NAME?message}``) whose variable is unset."""


def interpolate(text: str, variables: Mapping[str, str]) -> str:
    """Replace every ``${...}`` of ``text`` from ``variables``, following the Compose specification.

    Raises MissingVariableError for a required variable that is missing (or empty, with ``:?``), and
    ValueError if a bare ``$NAME`` remains, which this project's files never use.
    """

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group("name"), match.group("op"), match.group("arg")
        value = variables.get(name)
        unset = value is None or (value == "" and op is not None and op.startswith(":"))
        if not unset:
            return str(value)
        if op in (":?", "?"):
            raise MissingVariableError(f"{name}: {arg}")
        if op in (":-", "-"):
            return arg
        return ""

    result = _PATTERN.sub(replace, text)
    leftover = re.search(r"(?<!\$)\$[A-Za-z_{]", _PATTERN.sub("", text))
    if leftover:
        raise ValueError(f"unsupported interpolation near {text[leftover.start() : leftover.start() + 20]!r}")
    return result


def required_variables(text: str) -> set[str]:
    """Names of the variables that ``text`` requires (``${NAME:?...}`` / ``${NAME?...}``)."""
    return {m.group("name") for m in _PATTERN.finditer(text) if m.group("op") in (":?", "?")}


def interpolate_document(node: Any, variables: Mapping[str, str]) -> Any:
    """A copy of a parsed YAML document with every string value interpolated (keys are left alone)."""
    if isinstance(node, str):
        return interpolate(node, variables)
    if isinstance(node, dict):
        return {key: interpolate_document(value, variables) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate_document(value, variables) for value in node]
    return node
