"""Structured outputs at the gateway: the request fields that ask for one, as one ``GrammarSpec``.

A request names at most one of OpenAI's ``response_format`` (``json_object``, ``json_schema``) and vLLM's
``guided_json``, ``guided_regex``, ``guided_choice`` and ``structured_outputs`` (``json``, ``regex``,
``choice``, ``json_object``). The workers compile the grammar (xgrammar, on the last stage); the gateway is
torch-free and cannot run xgrammar, so it checks here what xgrammar refuses that it can tell cheaply, each a
400 naming the field: malformed JSON, a schema that is not an object, unknown ``type`` names, lower bounds
above upper bounds, ``$ref`` that do not resolve inside the schema, and regular expressions that do not
compile or use what xgrammar's regular expressions lack (lookaround, backreferences, named groups, Unicode
property classes). A grammar that passes these checks but that xgrammar still refuses is refused by the last
stage before its first token (``FinishReason.REFUSED``, with xgrammar's reason), which ``Generation.start``
answers 400 before any response is sent.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dejavu_common.messages import (
    MAX_GRAMMAR_CHARS,
    MAX_GRAMMAR_CHOICE_CHARS,
    MAX_GRAMMAR_CHOICES,
    GrammarKind,
    GrammarSpec,
)

from .errors import InvalidRequestError
from .schemas.common import SamplingRequest

_JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
_BOUNDS = (
    ("minimum", "maximum"),
    ("exclusiveMinimum", "exclusiveMaximum"),
    ("minLength", "maxLength"),
    ("minItems", "maxItems"),
    ("minProperties", "maxProperties"),
)
# Keywords whose values are JSON values, not subschemas.
_VALUES = frozenset({"enum", "const", "default", "examples"})
#: Deepest nesting of a schema the gateway walks (and accepts).
MAX_SCHEMA_DEPTH = 64
# What xgrammar's regular expressions lack: lookahead and lookbehind, named groups, backreferences, Unicode
# property classes. (Python's ``re`` checks the rest of the syntax.)
_UNSUPPORTED_REGEX = re.compile(r"\(\?(?:[=!]|<[=!]|P|<[A-Za-z_])|\\[1-9]|\\[pPk]")
_GUIDED_KEYS = {"json": GrammarKind.JSON_SCHEMA, "regex": GrammarKind.REGEX, "choice": GrammarKind.CHOICE}


def grammar_of(body: SamplingRequest) -> GrammarSpec | None:
    """The request's structured output (None: free text); :class:`InvalidRequestError` for a malformed one or
    for more than one."""
    asked: list[tuple[str, GrammarSpec]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", GrammarSpec(kind=GrammarKind.JSON_OBJECT)))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise InvalidRequestError(
                "`response_format` of type json_schema needs `json_schema.schema`", param="response_format"
            )
        asked.append(("response_format", json_schema_spec(fmt.json_schema.json_schema, "response_format")))
    if body.guided_json is not None:
        asked.append(("guided_json", json_schema_spec(body.guided_json, "guided_json")))
    if body.guided_regex is not None:
        asked.append(("guided_regex", _regex(body.guided_regex, "guided_regex")))
    if body.guided_choice is not None:
        asked.append(("guided_choice", _choice(body.guided_choice, "guided_choice")))
    if body.guided_grammar is not None:
        raise InvalidRequestError(
            "`guided_grammar` is not supported: use a JSON schema or a regex", param="guided_grammar"
        )
    if body.structured_outputs is not None:
        asked.extend(_structured_outputs(body.structured_outputs))
    if len(asked) > 1:
        names = ", ".join(f"`{name}`" for name, _ in asked)
        raise InvalidRequestError(f"a request takes one structured output, got {names}", param=asked[1][0])
    return asked[0][1] if asked else None


def _structured_outputs(options: dict[str, Any]) -> list[tuple[str, GrammarSpec]]:
    """vLLM's ``structured_outputs`` object: one of ``json``, ``regex``, ``choice``, ``json_object``."""
    param = "structured_outputs"
    unknown = sorted(set(options) - {*_GUIDED_KEYS, "json_object", "disable_any_whitespace", "whitespace_pattern"})
    if unknown:
        raise InvalidRequestError(f"`structured_outputs` does not support {', '.join(unknown)}", param=param)
    asked = []
    if options.get("json") is not None:
        asked.append((param, json_schema_spec(options["json"], param)))
    if options.get("regex") is not None:
        asked.append((param, _regex(options["regex"], param)))
    if options.get("choice") is not None:
        asked.append((param, _choice(options["choice"], param)))
    if options.get("json_object"):
        asked.append((param, GrammarSpec(kind=GrammarKind.JSON_OBJECT)))
    return asked


def json_schema_spec(schema: Any, param: str) -> GrammarSpec:
    """The grammar of a JSON schema (an object, or its text) given in ``param``; 400 where it is malformed or
    uses what the gateway can tell the grammar engine refuses."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequestError(f"`{param}` is not valid JSON: {exc}", param=param) from exc
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(f"`{param}` must be a JSON schema (an object)", param=param)
    source = json.dumps(schema, ensure_ascii=False)
    if len(source) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(f"`{param}` is longer than {MAX_GRAMMAR_CHARS} characters", param=param)
    problem = _schema_problem(schema, schema, "#", 0)
    if problem is not None:
        raise InvalidRequestError(f"`{param}` is not a schema this server can enforce: {problem}", param=param)
    return GrammarSpec(kind=GrammarKind.JSON_SCHEMA, source=source)


def _schema_problem(node: Any, root: Any, where: str, depth: int) -> str | None:
    """The first thing in ``node`` (a subschema at ``where``) that xgrammar refuses; None if none."""
    if depth > MAX_SCHEMA_DEPTH:
        return f"nested deeper than {MAX_SCHEMA_DEPTH} levels at {where}"
    if isinstance(node, list):
        for i, item in enumerate(node):
            if (problem := _schema_problem(item, root, f"{where}/{i}", depth + 1)) is not None:
                return problem
        return None
    if not isinstance(node, dict):
        return None
    types = node.get("type")
    for name in types if isinstance(types, list) else [types] if types is not None else []:
        if name not in _JSON_TYPES:
            return f"unknown type {name!r} at {where}"
    for low, high in _BOUNDS:
        lo, hi = node.get(low), node.get(high)
        if isinstance(lo, int | float) and isinstance(hi, int | float) and lo > hi:
            return f"{low} {lo} is above {high} {hi} at {where}"
    ref = node.get("$ref")
    if isinstance(ref, str) and not _resolves(ref, root):
        return f"$ref {ref!r} at {where} does not point inside the schema"
    pattern = node.get("pattern")
    if isinstance(pattern, str) and (problem := _regex_problem(pattern)) is not None:
        return f"pattern at {where}: {problem}"
    for key, value in node.items():
        if key in _VALUES or not isinstance(value, dict | list):
            continue
        if (problem := _schema_problem(value, root, f"{where}/{key}", depth + 1)) is not None:
            return problem
    return None


def _resolves(ref: str, root: Any) -> bool:
    """Whether a JSON pointer ``ref`` (``#`` or ``#/...``) names a part of ``root``."""
    if ref == "#":
        return True
    if not ref.startswith("#/"):
        return False
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True


def _regex_problem(pattern: str) -> str | None:
    if not pattern:
        return "the regular expression is empty"
    if (bad := _UNSUPPORTED_REGEX.search(pattern)) is not None:
        return f"{bad.group()!r} (lookaround, named groups, backreferences, \\p classes) is not supported"
    try:
        re.compile(pattern)
    except re.error as exc:
        return f"invalid regular expression: {exc}"
    return None


def _regex(pattern: Any, param: str) -> GrammarSpec:
    if not isinstance(pattern, str):
        raise InvalidRequestError(f"`{param}` must be a regular expression (a string)", param=param)
    if len(pattern) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(f"`{param}` is longer than {MAX_GRAMMAR_CHARS} characters", param=param)
    if (problem := _regex_problem(pattern)) is not None:
        raise InvalidRequestError(f"`{param}`: {problem}", param=param)
    return GrammarSpec(kind=GrammarKind.REGEX, source=pattern)


def _choice(choices: Any, param: str) -> GrammarSpec:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError(f"`{param}` must be a non-empty list of non-empty strings", param=param)
    if len(choices) > MAX_GRAMMAR_CHOICES or any(len(c) > MAX_GRAMMAR_CHOICE_CHARS for c in choices):
        raise InvalidRequestError(
            f"`{param}` takes at most {MAX_GRAMMAR_CHOICES} choices of at most {MAX_GRAMMAR_CHOICE_CHARS} characters",
            param=param,
        )
    return GrammarSpec(kind=GrammarKind.CHOICE, choices=tuple(dict.fromkeys(choices)))
